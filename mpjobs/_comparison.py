"""A handle on one precision comparison: its variants' results against float32, its verdict, their steps as a frame."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

from mpjobs._exceptions import WaitTimeout
from mpjobs._frames import pandas, step_frame
from mpjobs._job import Job
from mpjobs._reading import read
from mpjobs.contract.comparisons import ComparisonReport as ComparisonResource
from mpjobs.contract.comparisons import VariantResult

if TYPE_CHECKING:
    from mpjobs._client import Client

POLL_INTERVAL_S = 1.0
"""How often `wait()` reads the comparison."""


class Comparison:
    """A comparison of the mpjobs API, as last read (`refresh()` reads it again); `resource` is the API's own.

    >>> c = client.compare(model, variants=["float32", "mixed_float16"]).wait()   # doctest: +SKIP
    >>> print(c.verdict)                                                            # doctest: +SKIP
    """

    def __init__(self, client: Client, resource: ComparisonResource) -> None:
        self.client = client
        self.resource = resource

    def __repr__(self) -> str:
        return f"<Comparison {self.id} {self.state} {[v.label for v in self.variants]}>"

    @property
    def id(self) -> str:
        return self.resource.id

    @property
    def state(self) -> str:
        """`running` until every variant's job has ended, then `done`."""
        return self.resource.state

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def verdict(self) -> str:
        """The result in one paragraph of plain words (final once `done`)."""
        return self.resource.verdict

    @property
    def variants(self) -> list[VariantResult]:
        """Per variant: final loss and its gap to float32, speed against float32, skips, zero gradients,
        diagnoses."""
        return self.resource.variants

    def refresh(self) -> Comparison:
        self.resource = self.client.comparison(self.id).resource
        return self

    def jobs(self) -> dict[str, Job]:
        """Each variant's job by its label ("float32", "mixed_float16 + dynamic", ...)."""
        return {v.label: self.client.job(v.job_id) for v in self.variants}

    def cancel(self) -> Comparison:
        """Cancel every job of the comparison that has not ended."""
        self.resource = read(ComparisonResource, self.client.request("DELETE", f"/comparisons/{self.id}"))
        return self

    def wait(self, progress: bool = True, timeout: float | None = None) -> Comparison:
        """Block until every variant has ended; `progress` prints each variant's state as it changes (to
        stderr); `timeout` (seconds): raise `WaitTimeout` after it (the jobs go on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        shown: dict[str, str] = {}
        while True:
            self.refresh()
            for v in self.variants if progress else ():
                if shown.get(v.label) != v.state.value:
                    shown[v.label] = v.state.value
                    print(f"{v.label}: {v.state.value}", file=sys.stderr, flush=True)
            if self.done:
                return self
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"comparison {self.id} had not ended after {timeout:g} s")
            time.sleep(POLL_INTERVAL_S)

    def to_pandas(self) -> Any:
        """Every variant's steps in one DataFrame: a row per variant and step, the columns `variant` (its label)
        and `job_id`, then the step record's fields. For one curve per variant:
        `frame.pivot(index="step", columns="variant", values="loss")`. Needs pandas."""
        pd = pandas()
        frames = [step_frame([p for page in self.client.job(v.job_id).pages() for p in page.points],
                             first={"variant": v.label, "job_id": v.job_id}) for v in self.variants]
        return pd.concat(frames, ignore_index=True)
