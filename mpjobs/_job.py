"""A handle on one training job: its state and summary, its steps live or page by page, and its history as a frame."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from mpjobs._exceptions import Conflict, WaitTimeout, mapped, raise_for
from mpjobs._frames import pandas, step_frame
from mpjobs._progress import progress_view
from mpjobs._reading import read, read_json
from mpjobs._stream import follow
from mpjobs.contract.jobs import EvaluationsPage, JobError, JobState, LayersPage, MetricsBuckets, MetricsPage
from mpjobs.contract.jobs import JobRecord as JobResource
from mpjobs.contract.plan import PlanView
from mpjobs.contract.records import Diagnosis, EvalRecord, StepRecord, Summary

if TYPE_CHECKING:
    from mpjobs._client import Client

PAGE_LIMIT = 10_000
"""Steps per metrics request when every page is read: the API's own cap."""
POLL_INTERVAL_S = 0.5
"""How often `wait(progress=False)` reads the job's state."""


class Job:
    """A job of the mpjobs API, as last read (`refresh()` reads it again).

    `resource` is the API's own `Job` (mpjobs/contract/jobs.py); the common fields are properties here.

    >>> job = client.submit(model, policy="mixed_float16", steps=200)  # doctest: +SKIP
    >>> job.wait().summary.final_loss                                   # doctest: +SKIP
    0.4127
    """

    def __init__(self, client: Client, resource: JobResource) -> None:
        self.client = client
        self.resource = resource

    def __repr__(self) -> str:
        p = self.resource.progress
        return f"<Job {self.id} {self.state.value} {p.step}/{p.total_steps}>"

    @property
    def id(self) -> str:
        return self.resource.id

    @property
    def state(self) -> JobState:
        return self.resource.state

    @property
    def done(self) -> bool:
        return self.state.terminal

    @property
    def summary(self) -> Summary | None:
        """How the run went (final loss, loss scales, skipped steps, zero gradients...); None before a step ends."""
        return self.resource.summary

    @property
    def diagnoses(self) -> list[Diagnosis]:
        """What the run's numerics showed (`gradient_underflow`, `overflow_skips`...): docs/numerics.md."""
        return self.summary.diagnoses if self.summary else []

    @property
    def error(self) -> JobError | None:
        return self.resource.error

    def refresh(self) -> Job:
        self.resource = self.client.job(self.id).resource
        return self

    def cancel(self) -> Job:
        """Ask the job to stop: a queued one is canceled at once, a running one after its current step (see
        `wait()`). An ended job is left as it is."""
        try:
            self.resource = read(JobResource, self.client.request("DELETE", f"/jobs/{self.id}"))
        except Conflict:  # it has already ended: nothing to cancel
            self.refresh()
        return self

    def wait(self, progress: bool = True, timeout: float | None = None, *, interval: float = 5.0) -> Job:
        """Block until the job has ended, then return it, read again. `progress`: a bar on a terminal, an
        updating output in Jupyter, plain lines in a log, one every `interval` seconds (0: every step).
        `timeout` (seconds): raise `WaitTimeout` after it (the job goes on). In a log, a line a minute:

        >>> job.wait(interval=60)   # doctest: +SKIP
        <Job 3f2a... succeeded 300/300>
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.refresh().done:
            return self
        if not progress:
            while not self.refresh().done:
                if deadline is not None and time.monotonic() >= deadline:
                    raise WaitTimeout(f"job {self.id} had not ended after {timeout:g} s")
                time.sleep(POLL_INTERVAL_S)
            return self
        view = progress_view(self.resource.progress.total_steps,
                             phase_of=lambda: self.client.job(self.id).resource.phase, interval=interval)
        try:  # from the step before the last one stored: the bar starts with a rate to show
            for event in follow(self.client.http, self.id, max(0, self.resource.progress.step - 1), deadline):
                if event.kind == "metrics":
                    view.step(event.json())
                elif event.kind == "state":
                    payload = event.json()
                    view.state(payload["state"], payload.get("message", ""))
        finally:
            view.close()
        return self.refresh()

    def stream(self, after: int = 0) -> Iterator[StepRecord]:
        """Each step record after step `after` as the job reports it, until the job ends: every step once
        and in order, across dropped connections and API restarts (resumed with `Last-Event-ID`)."""
        for event in follow(self.client.http, self.id, after):
            if event.kind == "metrics":
                yield read_json(StepRecord, event.data)

    def metrics(self, after: int = 0, limit: int = 1000, max_points: int | None = None
                ) -> MetricsPage | MetricsBuckets:
        """One page of step records after step `after` (`next_after` is where the next one starts); or, with
        `max_points`, the whole run in at most that many min/mean/max buckets."""
        if max_points is not None:
            body = self.client.request("GET", f"/jobs/{self.id}/metrics", params={"max_points": max_points})
            return read(MetricsBuckets, body)
        body = self.client.request("GET", f"/jobs/{self.id}/metrics", params={"after": after, "limit": limit})
        return read(MetricsPage, body)

    def pages(self, after: int = 0) -> Iterator[MetricsPage]:
        """Every page of step records after step `after`, in step order, each step once."""
        next_after: int | None = after
        while next_after is not None:
            page = self.metrics(after=next_after, limit=PAGE_LIMIT)
            assert isinstance(page, MetricsPage)
            yield page
            next_after = page.next_after

    def csv(self) -> Iterator[str]:
        """The whole stored history as CSV text, streamed in one response (`GET /jobs/{id}/metrics.csv`): a
        header row of the step record's fields, then a row per step in step order; null is an empty cell."""
        try:
            with self.client.http.stream("GET", f"/jobs/{self.id}/metrics.csv") as response:
                if response.status_code >= 400:
                    response.read()
                    raise_for(response)
                yield from response.iter_text()
        except httpx.HTTPError as exc:
            raise mapped(exc, self.client.url, self.client.timeout) from exc

    def download_model(self, path: str | os.PathLike[str]) -> Path:
        """Save the trained model (`GET /jobs/{id}/artifacts/model.keras`) to `path`, and return it.

        It loads with plain Keras, compiled: `keras.models.load_model(path)` (docs/client.md). Written to a
        temp file beside `path`, then renamed over it: `path` is never left half written. A job with no
        model yet (not ended, failed before one was saved) raises `NotFound` with the API's message.
        """
        target = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", suffix=".part", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f, self.client.http.stream(
                    "GET", f"/jobs/{self.id}/artifacts/model.keras") as response:
                if response.status_code >= 400:
                    response.read()
                    raise_for(response)
                for chunk in response.iter_bytes():
                    f.write(chunk)
            os.replace(tmp, target)
        except httpx.HTTPError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise mapped(exc, self.client.url, self.client.timeout) from exc
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target

    def layer_checks(self, after: int = 0, limit: int = 100) -> LayersPage:
        """One page of layer checks (every layer's gradient and activation numerics at a step) after step `after`."""
        return read(LayersPage, self.client.request("GET", f"/jobs/{self.id}/layers",
                                                    params={"after": after, "limit": limit}))

    def plan(self) -> PlanView:
        """The precision plan (`GET /jobs/{id}/plan`): layers to keep in float32 and a loss scale, its search,
        a spec fragment and lines of Keras. `NotFound` says why a job has none."""
        return read(PlanView, self.client.request("GET", f"/jobs/{self.id}/plan"))

    def evaluations(self) -> list[EvalRecord]:
        """Every evaluation on the held-out rows so far, in step order (`GET /jobs/{id}/evaluations`, every page):
        the loss and each of `validation.metrics` at a step. Empty for a job without `validation`."""
        found: list[EvalRecord] = []
        after: int | None = 0
        while after is not None:
            page = read(EvaluationsPage, self.client.request("GET", f"/jobs/{self.id}/evaluations",
                                                             params={"after": after, "limit": PAGE_LIMIT}))
            found, after = found + page.evaluations, page.next_after
        return found

    def to_pandas(self) -> Any:
        """Every step so far as a pandas DataFrame: one row per step, a column per step-record field (`step`,
        `loss`, `loss_scale`, `grad_norm`, `skipped`, ...). Steps lost on the server (a Redis crash) are
        listed in `frame.attrs["missing_steps"]`. Needs pandas."""
        pandas()  # before any request: without pandas, say so at once
        missing: list[tuple[int, int]] = []
        points: list[StepRecord] = []
        for page in self.pages():
            points += page.points
            missing += page.missing_steps
        frame = step_frame(points)
        frame.attrs["missing_steps"] = missing
        return frame
