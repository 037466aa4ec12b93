"""`mpjobs`: submit, follow and compare training jobs from a shell, over the HTTP API.

It speaks HTTP only (httpx) and never imports TensorFlow, `worker`, redis or FastAPI.
The server validates every spec; its 422 is the authority, printed field by field.

Exit codes are the same for every command: `EXIT_CODES` in parser.py, and docs/cli.md.
"""

from __future__ import annotations

import os
import sys

from app.cli.api import Api
from app.cli.errors import CliError, Exit
from app.cli.parser import build_parser
from app.cli.words import comparison_report, summary_lines

__all__ = ["Api", "CliError", "Exit", "build_parser", "comparison_report", "main", "summary_lines"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    api = Api(args.url, args.api_key, args.timeout)
    try:
        return int(args.run(api, args))
    except CliError as exc:
        print(f"mpjobs: {exc.message}", file=sys.stderr)
        return int(exc.code)
    except KeyboardInterrupt:
        print("\nmpjobs: interrupted", file=sys.stderr)
        return int(Exit.INTERRUPTED)
    except BrokenPipeError:
        # `mpjobs metrics ID | head`: the reader has what it wanted.
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # so the exit-time flush of stdout cannot fail again
        return int(Exit.OK)
    finally:
        api.client.close()

