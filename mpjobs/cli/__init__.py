"""`mpjobs`: submit, follow and compare training jobs from a shell, over the HTTP API.

It is built on the Python client (`mpjobs.Client`: httpx and the API's schemas) and never imports
TensorFlow, `worker`, redis or FastAPI. The server validates every spec; its 422 is the authority,
printed field by field.

Exit codes are the same for every command: `EXIT_CODES` in parser.py, and docs/cli.md.
"""

from __future__ import annotations

import os
import sys

from mpjobs import Client, MpjobsError
from mpjobs.cli.exit_codes import CliError, Exit, cli_error
from mpjobs.cli.parser import build_parser
from mpjobs.cli.words import comparison_report, summary_lines

__all__ = ["CliError", "Exit", "build_parser", "comparison_report", "main", "summary_lines"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    client = Client(args.url, args.api_key, args.timeout)
    try:
        try:
            return int(args.run(client, args))
        except MpjobsError as exc:
            raise cli_error(exc) from exc
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
        client.close()
