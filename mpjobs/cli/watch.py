"""Following a job live (the client's `Job.wait`, its progress on stderr) and a comparison, by polling."""

from __future__ import annotations

import sys
import time
from typing import Any

from mpjobs import Client
from mpjobs.cli.exit_codes import CliError, Exit, exit_for
from mpjobs.cli.words import summary_lines

__all__ = ["POLL_INTERVAL_S", "watch", "watch_comparison"]

POLL_INTERVAL_S = 1.0
"""How often `compare --watch` reads the comparison."""


def watch(client: Client, job_id: str, interval: float) -> int:
    """Follow the job to its end with `Job.wait` (a bar on a terminal, else a line every `interval` s, on
    stderr), then print how it ended on stdout; the exit code is its end state's."""
    job = client.job(job_id)
    if job.resource.waiting_reason:
        print(f"waiting: {job.resource.waiting_reason}", file=sys.stderr)
    try:
        job.wait(interval=interval)
    except KeyboardInterrupt:
        raise CliError(Exit.INTERRUPTED, f"stopped watching; job {job_id} keeps running. "
                                         f"Cancel it with: mpjobs cancel {job_id}") from None
    print("\n".join(summary_lines(job.resource.model_dump(mode="json"))))
    return exit_for(job.state)


def watch_comparison(client: Client, comparison_id: str) -> dict[str, Any]:
    states: dict[str, str] = {}
    tty = sys.stderr.isatty()
    try:
        while True:
            c = client.comparison(comparison_id).resource.model_dump(mode="json")
            if tty:
                sys.stderr.write("\r\x1b[K")
            for v in c["variants"]:
                if states.get(v["label"]) != v["state"]:
                    states[v["label"]] = v["state"]
                    sys.stderr.write(f"{v['label']}: {v['state']}\n")
            if c["state"] == "done":
                return c
            if tty:
                sys.stderr.write("  ".join(f"{v['label']} {v['progress']['step']}/{v['progress']['total_steps']}"
                                           for v in c["variants"]))
            sys.stderr.flush()
            time.sleep(POLL_INTERVAL_S)
    except KeyboardInterrupt:
        raise CliError(Exit.INTERRUPTED, f"stopped watching; comparison {comparison_id} keeps running. See it "
                                         f"with: mpjobs compare --show {comparison_id}; cancel a variant with: "
                                         "mpjobs cancel JOB") from None
