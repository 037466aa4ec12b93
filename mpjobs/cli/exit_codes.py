"""Exit codes, the one error that ends a command (`CliError`), and the client's errors as exit codes."""

from __future__ import annotations

from enum import IntEnum

import mpjobs
from mpjobs.contract.jobs import JobState


class Exit(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    CANCELED = 3
    NOT_FOUND = 4
    UNAVAILABLE = 5
    INTERRUPTED = 130


STATE_EXIT = {JobState.SUCCEEDED: Exit.OK, JobState.FAILED: Exit.FAILED, JobState.CANCELED: Exit.CANCELED}


class CliError(Exception):
    """Ends the command: `message` goes to stderr, `code` is the exit status."""

    def __init__(self, code: Exit, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def exit_for(state: str) -> Exit:
    return STATE_EXIT.get(mpjobs.member(JobState, state), Exit.OK)


def cli_error(exc: mpjobs.MpjobsError) -> CliError:
    """The one place a client error becomes an exit code and a message (docs/cli.md)."""
    if isinstance(exc, mpjobs.InvalidSpec) and isinstance(exc.detail, list):
        return CliError(Exit.USAGE, str(exc))  # each field on a line of its own
    if isinstance(exc, mpjobs.NotFound):
        return CliError(Exit.NOT_FOUND, str(exc.detail))
    if isinstance(exc, mpjobs.Unauthorized):
        return CliError(Exit.UNAVAILABLE, f"{exc.detail} ({exc.status}; pass --api-key or set MPJOBS_API_KEY)")
    if isinstance(exc, mpjobs.ClientError):
        return CliError(Exit.USAGE, f"{exc.detail} ({exc.status})")
    if isinstance(exc, mpjobs.ServerError):
        return CliError(Exit.UNAVAILABLE, f"the API answered {exc.status}: {exc.detail}")
    if isinstance(exc, mpjobs.Timeout):
        return CliError(Exit.UNAVAILABLE, f"{exc} (--timeout)")
    if isinstance(exc, mpjobs.BadResponse):
        return CliError(Exit.UNAVAILABLE, str(exc).replace("is the url right?", "is --url right?"))
    return CliError(Exit.UNAVAILABLE, str(exc))
