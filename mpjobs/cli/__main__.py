"""`python -m mpjobs.cli`: the same as the `mpjobs` console script."""

import sys

from mpjobs.cli import main

if __name__ == "__main__":
    sys.exit(main())
