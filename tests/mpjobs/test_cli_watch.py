"""The command's `watch` and `cancel --wait` against an API served in-process (`httpx.MockTransport`): what they
print, on which stream, and their exit codes, with no server running."""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import httpx
import pytest

import mpjobs
from mpjobs.cli.commands import cmd_cancel, cmd_watch
from mpjobs.cli.exit_codes import CliError, Exit
from tests.mpjobs.test_client_compat import JOB, record

ID = JOB["id"]
STEPS = 3


def job(state: str, step: int, **fields: Any) -> dict[str, Any]:
    """The test job (3 steps) in `state` at `step`; `summary` None unless given."""
    answer = copy.deepcopy(JOB)
    answer.update({"state": state, "progress": {"step": step, "total_steps": STEPS}, "summary": None, **fields})
    return answer


def sse(*events: tuple[str, Any, int | None]) -> str:
    """An SSE body: (kind, data, id) per event."""
    return "".join((f"id: {i}\n" if i is not None else "") + f"event: {kind}\ndata: {json.dumps(data)}\n\n"
                   for kind, data, i in events)


SUCCEEDED = {"state": "succeeded", "at": "2026-12-01T10:00:09Z", "message": f"finished {STEPS} steps"}
RUNS_TO_THE_END = sse(("state", {"state": "running", "at": "2026-12-01T10:00:01Z", "message": "started"}, None),
                      *(("metrics", record(s), s) for s in range(1, STEPS + 1)), ("state", SUCCEEDED, None),
                      ("end", {"state": "succeeded"}, None))


def serving(before: dict[str, Any], after: dict[str, Any], stream: str, seen: list[httpx.Request]) -> mpjobs.Client:
    """An API whose job reads as `before` until its stream (`stream`) has been served, then as `after`."""
    served = False

    def answer(request: httpx.Request) -> httpx.Response:
        nonlocal served
        seen.append(request)
        if request.url.path == f"/jobs/{ID}/metrics/stream":
            served = True
            return httpx.Response(200, text=stream, headers={"Content-Type": "text/event-stream"})
        return httpx.Response(200, json=after if served else before)

    return mpjobs.Client("http://api.test", api_key="", transport=httpx.MockTransport(answer))


def test_watch_draws_each_step_from_the_stream_then_prints_how_the_job_ended(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[httpx.Request] = []
    ended = job("succeeded", STEPS, summary=JOB["summary"])
    client = serving(job("running", 2), ended, RUNS_TO_THE_END, seen)
    assert cmd_watch(client, argparse.Namespace(job_id=ID, interval=0.0)) == Exit.OK
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "state: running (started)",
        # Step 1, before the stream's Last-Event-ID, is not drawn though the server sends it.
        "step 2/3  67%  loss 0.5  scale 32768  grad norm 0.5  ETA -",
        "step 3/3 100%  loss 0.3333  scale 32768  grad norm 0.5  ETA 0:00",
        "state: succeeded (finished 3 steps)",
    ]
    assert out.splitlines()[0] == f"job {ID} succeeded after 3 of 3 steps"
    assert out.splitlines()[-2:] == ["  diagnoses        overflow_skips",
                                     "    - 2 steps skipped (overflow_skips, from step 1)"]
    stream = [r for r in seen if r.url.path.endswith("/metrics/stream")]
    assert len(stream) == 1 and stream[0].headers["Last-Event-ID"] == "1"  # from the step before the last stored


def test_watch_of_a_queued_job_says_why_it_waits_and_exits_3_once_canceled(
    capsys: pytest.CaptureFixture[str],
) -> None:
    canceled = {"state": "canceled", "at": "2026-12-01T10:00:05Z", "message": "Canceled before it started."}
    stream = sse(("state", canceled, None), ("end", {"state": "canceled"}, None))
    client = serving(job("queued", 0, waiting_reason="no worker listens on queue gpu"),
                     job("canceled", 0, error={"reason": "canceled", "message": "Canceled before it started."}),
                     stream, [])
    assert cmd_watch(client, argparse.Namespace(job_id=ID, interval=5.0)) == Exit.CANCELED
    out, err = capsys.readouterr()
    assert err == "waiting: no worker listens on queue gpu\nstate: canceled (Canceled before it started.)\n"
    assert out.splitlines()[:2] == [f"job {ID} canceled after 0 of 3 steps",
                                    "  error            canceled: Canceled before it started."]


def test_watch_of_an_ended_job_prints_only_how_it_ended(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[httpx.Request] = []
    failed = job("failed", 1, error={"reason": "diverged", "message": "loss is NaN"})
    assert cmd_watch(serving(failed, failed, "", seen), argparse.Namespace(job_id=ID, interval=5.0)) == Exit.FAILED
    out, err = capsys.readouterr()
    assert err == "" and out.splitlines()[:2] == [f"job {ID} failed after 1 of 3 steps",
                                                  "  error            diverged: loss is NaN"]
    assert not any(r.url.path.endswith("/metrics/stream") for r in seen)


def test_ctrl_c_stops_watching_and_names_the_command_that_cancels() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/metrics/stream"):
            raise KeyboardInterrupt
        return httpx.Response(200, json=job("running", 2))

    client = mpjobs.Client("http://api.test", api_key="", transport=httpx.MockTransport(answer))
    with pytest.raises(CliError) as stopped:
        cmd_watch(client, argparse.Namespace(job_id=ID, interval=5.0))
    assert stopped.value.code == Exit.INTERRUPTED
    assert stopped.value.message == f"stopped watching; job {ID} keeps running. Cancel it with: mpjobs cancel {ID}"


def test_cancel_wait_prints_the_request_then_the_end_and_exits_with_it(capsys: pytest.CaptureFixture[str]) -> None:
    reads = 0

    def answer(request: httpx.Request) -> httpx.Response:
        nonlocal reads
        reads += request.method == "GET"
        return httpx.Response(200, json=job("running" if reads < 3 else "canceled", 2))

    client = mpjobs.Client("http://api.test", api_key="", transport=httpx.MockTransport(answer))
    assert cmd_cancel(client, argparse.Namespace(job_id=ID, wait=True)) == Exit.CANCELED
    assert capsys.readouterr().out == (f"{ID}: running; cancel requested, it stops after its current step\n"
                                       f"{ID}: canceled\n")
