"""`python -m worker` whose training steps each take SLOW_STEP_S seconds more: a slow model on a slow processor.

The wait is inside each compiled call, SLOW_STEP_S for each of its steps, where the engine times its calls:
its automatic steps per call then runs one step per call, as for any step longer than a call's 20 ms.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from worker.__main__ import main
from worker.engine.stepper import Stepper

STEP_S = float(os.environ.get("SLOW_STEP_S", "2"))
run_call = Stepper.__call__


def slow_call(self: Stepper, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    time.sleep(STEP_S * (len(x) // self.batch_size))  # inside the call: each of its steps lasts STEP_S longer
    return run_call(self, x, y)


if __name__ == "__main__":  # only when run: pytest imports this module too (its doctests), and must not slow down
    Stepper.__call__ = slow_call  # type: ignore[method-assign]
    sys.exit(main())
