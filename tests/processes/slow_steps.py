"""`python -m worker` whose training steps each take SLOW_STEP_S seconds more: a slow model on a slow processor."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from worker.__main__ import main
from worker.callbacks.recorder import StepRecorder

STEP_S = float(os.environ.get("SLOW_STEP_S", "2"))
recorded = StepRecorder.on_train_batch_end


def slow_step(self: StepRecorder, batch: int, logs: dict[str, Any] | None = None) -> None:
    time.sleep(STEP_S)  # inside the step, before it is recorded: the step lasts STEP_S longer
    recorded(self, batch, logs)


if __name__ == "__main__":  # only when run: pytest imports this module too (its doctests), and must not slow down
    StepRecorder.on_train_batch_end = slow_step  # type: ignore[method-assign]
    sys.exit(main())
