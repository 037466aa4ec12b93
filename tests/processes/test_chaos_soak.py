"""Issue 31: a bounded chaos soak. Short jobs and comparisons through the real stack while a worker is
SIGKILLed every 10 s and Redis restarts every 20 s: every job ends, every succeeded job holds each of its
steps once, the API answers nothing 5xx but 503, and every comparison whose runs succeeded has its speeds."""

from __future__ import annotations

import pytest

from bench.chaos import Faults, run, summary

JOBS, COMPARISONS = 14, 3


@pytest.mark.slow
def test_a_bounded_chaos_soak(tmp_path_factory: pytest.TempPathFactory) -> None:
    soak = run(tmp_path_factory.mktemp("chaos"), jobs=JOBS, comparisons=COMPARISONS, duration_s=20, steps=(30, 90),
               speed_checks=False, faults=Faults(kill_every_s=10, redis_every_s=20), workers=2, timeout_s=170)
    report = summary(soak)
    assert len(soak.jobs) == JOBS + 2 * COMPARISONS and soak.lost == [], report
    assert all(job["state"] in {"succeeded", "failed", "canceled"} for job in soak.jobs.values()), report
    assert soak.kills and sum(soak.redis_restarts.values()) >= 1, report  # the faults happened
    assert soak.incomplete == {}, report
    assert soak.server_errors() == {}, report
    assert soak.unmeasured == [], report
    failed = [job["error"]["reason"] for job in soak.jobs.values() if job["state"] == "failed"]
    assert set(failed) <= {"worker_lost"}, report
