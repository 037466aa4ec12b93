"""Following jobs live: the client's resumable stream drawn by its progress view, and comparison polling."""

from __future__ import annotations

import sys
import time
from typing import Any

from mpjobs import Client
from mpjobs._progress import ProgressView
from mpjobs._stream import follow
from mpjobs.cli.exit_codes import CliError, Exit, exit_for
from mpjobs.cli.words import summary_lines

__all__ = ["POLL_INTERVAL_S", "ProgressView", "watch", "watch_comparison"]

POLL_INTERVAL_S = 1.0
"""How often `compare --watch` and `cancel --wait` read the state."""


def watch(client: Client, job_id: str, interval: float) -> int:
    job = client.job(job_id).resource
    view = ProgressView(sys.stderr, job.progress.total_steps, interval,
                        phase_of=lambda: client.job(job_id).resource.phase)
    if job.waiting_reason:
        print(f"waiting: {job.waiting_reason}", file=sys.stderr)
    try:
        if not job.state.terminal:
            # From the step before the last one stored: the bar starts with a rate to show.
            for event in follow(client.http, job_id, max(0, job.progress.step - 1)):
                if event.kind == "metrics":
                    view.step(event.json())
                elif event.kind == "state":
                    payload = event.json()
                    view.state(payload["state"], payload.get("message", ""))
            job = client.job(job_id).resource
    except KeyboardInterrupt:
        raise CliError(Exit.INTERRUPTED, f"stopped watching; job {job_id} keeps running. "
                                         f"Cancel it with: mpjobs cancel {job_id}") from None
    finally:
        view.close()
    print("\n".join(summary_lines(job.model_dump(mode="json"))))
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
