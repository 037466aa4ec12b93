"""Run one job spec locally: `python -m worker.train SPEC.json [--out DIR]`.

Prints one JSON line per step record, a `{"layers": ...}` line per layer check
(before the steps it rides with), then one `{"summary": ...}` line, and
writes TensorBoard event files under `DIR/tensorboard`. A
failure prints `{"error": {"reason", "message"}}` and exits 1; a bad spec
prints the field errors and exits 2. Rerunning with the same `--out` resumes
from its checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from app.core.errors import JobFailed
from mpjobs.contract.spec import JobSpec
from worker.telemetry.reporters import JsonLinesReporter

EXIT_FAILED = 1
EXIT_BAD_SPEC = 2


def _error_line(reason: str, message: str, **extra: object) -> str:
    return json.dumps({"error": {"reason": reason, "message": message, **extra}})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.train", description=__doc__.split("\n")[0])
    parser.add_argument("spec", type=Path, help="job spec JSON file")
    parser.add_argument("--out", type=Path, help="checkpoint and model folder (default: a new temp folder)")
    args = parser.parse_args(argv)
    try:
        spec = JobSpec.model_validate_json(args.spec.read_bytes())
    except OSError as exc:
        print(_error_line("invalid_spec", f"cannot read {args.spec}: {exc.strerror}"))
        return EXIT_BAD_SPEC
    except ValidationError as exc:
        errors = [{"field": ".".join(map(str, e["loc"])), "message": e["msg"]} for e in exc.errors()]
        print(_error_line("invalid_spec", "the job spec is invalid", errors=errors))
        return EXIT_BAD_SPEC
    out = args.out or Path(tempfile.mkdtemp(prefix="mpjobs-run-"))
    print(f"mpjobs: checkpoints, model and TensorBoard events in {out}", file=sys.stderr)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from worker.engine import checkpoint
    from worker.engine.training import run_job  # Imports the ML backend: after the cheap checks.
    from worker.telemetry.reporters import FanOut
    from worker.telemetry.tensorboard import LOGDIR, TensorBoardReporter

    board = TensorBoardReporter(out / LOGDIR, resume_step=checkpoint.saved_step(out))
    try:
        result = run_job(spec, reporter=FanOut(JsonLinesReporter(), board), checkpoint_dir=out)
    except JobFailed as exc:
        print(_error_line(exc.reason.value, exc.message))
        return EXIT_FAILED
    finally:
        board.close()
    print(json.dumps({
        "summary": result.summary.model_dump(mode="json"),
        "status": result.status,
        "model_path": str(result.model_path) if result.model_path else None,
        "device": result.device.describe(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
