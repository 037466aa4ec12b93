"""The RQ task's import path before worker/service/ (`worker.tasks.run_training`): jobs queued by it still run.

RQ stores a job's function as its import path. A job an older API queued, or one in a Redis restored from
before the upgrade, names this module; new jobs name `worker.service.tasks.run_training` (app/store/queue.py).
"""

from __future__ import annotations

from worker.service.tasks import run_training

__all__ = ["run_training"]
