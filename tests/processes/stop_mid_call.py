"""`python -m worker` that stops itself (SIGSTOP) inside its first call of several steps past STOP_PAST_STEP.

The call has begun (its callbacks ran, its batches are handed over) and its steps are not yet recorded:
a SIGKILL then lands mid-call, on any machine. It first writes `{steps before the call} {steps in it}`
to STOP_MARK, which the test waits for.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np

from worker.__main__ import main
from worker.engine.stepper import Stepper

PAST = int(os.environ.get("STOP_PAST_STEP", "50"))
run_call = Stepper.__call__
done = {"steps": 0, "stopped": False}


def stopping_call(self: Stepper, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    steps = len(x) // self.batch_size
    if not done["stopped"] and done["steps"] >= PAST and steps > 1:
        done["stopped"] = True
        Path(os.environ["STOP_MARK"]).write_text(f"{done['steps']} {steps}")
        os.kill(os.getpid(), signal.SIGSTOP)
    done["steps"] += steps
    return run_call(self, x, y)


if __name__ == "__main__":  # only when run: pytest imports this module too (its doctests)
    Stepper.__call__ = stopping_call  # type: ignore[method-assign]
    sys.exit(main())
