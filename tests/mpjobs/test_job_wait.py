"""`Job.wait` against an API served in-process (`httpx.MockTransport`): the stream it follows, the progress it
draws off a terminal (a line every `interval` seconds, 5 by default), and the job it returns."""

from __future__ import annotations

import httpx
import pytest

import mpjobs
from mpjobs.contract.jobs import JobState
from tests.mpjobs.test_cli_watch import ID, job, sse
from tests.mpjobs.test_client_compat import record

STEPS = 10
SUCCEEDED = {"state": "succeeded", "at": "2026-12-01T10:00:09Z", "message": f"finished {STEPS} steps"}
STREAM = sse(*(("metrics", record(s), s) for s in range(1, STEPS + 1)), ("state", SUCCEEDED, None),
             ("end", {"state": "succeeded"}, None))


def line(step: int, eta: str) -> str:
    """A progress line off a terminal; the records are a second apart."""
    return f"step {step}/{STEPS} {step / STEPS:4.0%}  loss {1 / step:.4g}  scale 32768  grad norm 0.5  ETA {eta}"


def serving(seen: list[httpx.Request]) -> mpjobs.Client:
    """A job at step 1 of 10 whose stream sends every step, then its end; read again, it has succeeded."""
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == f"/jobs/{ID}/metrics/stream":
            return httpx.Response(200, text=STREAM, headers={"Content-Type": "text/event-stream"})
        streamed = any(r.url.path.endswith("/metrics/stream") for r in seen)
        answer = job("succeeded", STEPS) if streamed else job("running", 1)
        answer["progress"]["total_steps"] = STEPS
        return httpx.Response(200, json=answer)

    return mpjobs.Client("http://api.test", api_key="", transport=httpx.MockTransport(answer))


def test_wait_with_interval_0_draws_every_step_and_returns_the_job_read_again(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[httpx.Request] = []
    handle = serving(seen).job(ID)
    before = handle.state
    assert handle.wait(interval=0) is handle
    assert (before, handle.state) == (JobState.RUNNING, JobState.SUCCEEDED)
    assert capsys.readouterr().err.splitlines() == [
        line(1, "-"), *(line(s, f"0:{STEPS - s:02}") for s in range(2, STEPS + 1)),
        "state: succeeded (finished 10 steps)"]
    assert [(r.method, r.url.path, r.headers.get("Last-Event-ID")) for r in seen] == [
        ("GET", f"/jobs/{ID}", None), ("GET", f"/jobs/{ID}", None),  # client.job, then wait's own read
        ("GET", f"/jobs/{ID}/metrics/stream", "0"), ("GET", f"/jobs/{ID}", None)]


def test_wait_by_default_draws_a_line_every_5_s_and_the_last_step(capsys: pytest.CaptureFixture[str]) -> None:
    handle = serving([]).job(ID)
    assert handle.wait().state is JobState.SUCCEEDED
    assert capsys.readouterr().err.splitlines() == [line(1, "-"), line(STEPS, "0:00"),
                                                    "state: succeeded (finished 10 steps)"]


def test_wait_of_an_ended_job_reads_it_once_and_draws_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=job("canceled", 0))

    handle = mpjobs.Client("http://api.test", transport=httpx.MockTransport(answer)).job(ID)
    assert handle.wait(interval=0).state is JobState.CANCELED
    assert capsys.readouterr().err == "" and len(seen) == 2
