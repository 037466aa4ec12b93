"""Exit codes and the one error that ends a command (`CliError`); docs/cli.md lists the codes."""

from __future__ import annotations

from enum import IntEnum

from app.core.job import JobState


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
    return STATE_EXIT.get(JobState(state), Exit.OK)
