"""Where a step's numbers come from and where they go: the batch-loss metrics and the reporters.

Everything a step reports is computed inside the compiled train step: the batch
loss arrives in `logs` (which `fit` already copies to the host), the gradient
statistics in the optimizer's one `telemetry` vector. worker/callbacks/recorder.py turns
them into records and hands them to a `Reporter`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import IO, Protocol

from mpjobs.contract.records import EvalRecord, LayerCheck, StepRecord, Summary


class Reporter(Protocol):
    """Receives step records in batches, and the summary."""

    def steps(self, records: Sequence[StepRecord]) -> None: ...

    def layers(self, checks: Sequence[LayerCheck]) -> None:
        """Layer checks, handed over just before the batch of steps that holds their steps."""
        ...

    def evaluations(self, records: Sequence[EvalRecord]) -> None:
        """Evaluations on the held-out rows (worker/callbacks/evaluator.py), each as soon as it is done."""
        ...

    def summary(self, summary: Summary) -> None: ...


class ListReporter:
    """Keeps everything in memory: for tests and for library users."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.layer_checks: list[LayerCheck] = []
        self.evaluation_records: list[EvalRecord] = []
        self.batches: int = 0
        self.summaries: list[Summary] = []

    def steps(self, records: Sequence[StepRecord]) -> None:
        self.batches += 1
        self.records.extend(records)

    def layers(self, checks: Sequence[LayerCheck]) -> None:
        self.layer_checks.extend(checks)

    def evaluations(self, records: Sequence[EvalRecord]) -> None:
        self.evaluation_records.extend(records)

    def summary(self, summary: Summary) -> None:
        self.summaries.append(summary)


class FanOut:
    """A Reporter that hands every batch and summary to each of `reporters` in turn."""

    def __init__(self, *reporters: Reporter) -> None:
        self.reporters = reporters

    def steps(self, records: Sequence[StepRecord]) -> None:
        for reporter in self.reporters:
            reporter.steps(records)

    def layers(self, checks: Sequence[LayerCheck]) -> None:
        for reporter in self.reporters:
            reporter.layers(checks)

    def evaluations(self, records: Sequence[EvalRecord]) -> None:
        for reporter in self.reporters:
            reporter.evaluations(records)

    def summary(self, summary: Summary) -> None:
        for reporter in self.reporters:
            reporter.summary(summary)


class JsonLinesReporter:
    """Prints one JSON line per step record, a `{"layers": ...}` line per layer check and an `{"evaluation": ...}`
    line per evaluation (`python -m worker.train`)."""

    def __init__(self, stream: IO[str] = sys.stdout) -> None:
        self.stream = stream

    def steps(self, records: Sequence[StepRecord]) -> None:
        self.stream.write("".join(r.model_dump_json() + "\n" for r in records))
        self.stream.flush()

    def layers(self, checks: Sequence[LayerCheck]) -> None:
        self.stream.write("".join(json.dumps({"layers": c.model_dump(mode="json")}) + "\n" for c in checks))
        self.stream.flush()

    def evaluations(self, records: Sequence[EvalRecord]) -> None:
        self.stream.write("".join(json.dumps({"evaluation": r.model_dump(mode="json")}) + "\n" for r in records))
        self.stream.flush()

    def summary(self, summary: Summary) -> None:
        """The engine's summary is printed once, by `main`, with the run's status."""
