"""Exact min/mean/max aggregates of step records, mergeable.

The worker writes one rollup per `ROLLUP_STEPS` steps beside the raw series, so
the API can draw a 100k-step run as 500 buckets by reading ~1,600 rollups
instead of 100,000 points. Merging is exact: mins, maxes, sums and counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mpjobs.contract.jobs import Bucket, Stat

ROLLUP_STEPS = 64
"""Steps per stored rollup."""

SERIES = ("loss", "grad_norm", "loss_scale")
"""The StepRecord fields a rollup aggregates."""


@dataclass
class Series:
    n: int = 0
    total: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf

    def add(self, value: float | None) -> None:
        if value is None or not math.isfinite(value):
            return
        self.n += 1
        self.total += value
        self.lo, self.hi = min(self.lo, value), max(self.hi, value)

    def stat(self) -> Stat:
        if not self.n:
            return Stat(min=None, mean=None, max=None)
        return Stat(min=self.lo, mean=self.total / self.n, max=self.hi)


@dataclass
class Rollup:
    first_step: int = 0
    last_step: int = 0
    steps: int = 0
    skipped: int = 0
    series: dict[str, Series] = field(default_factory=lambda: {name: Series() for name in SERIES})

    def add(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        self.first_step = self.first_step or step
        self.last_step = step
        self.steps += 1
        self.skipped += bool(record["skipped"])
        for name in SERIES:
            self.series[name].add(record[name])

    def bucket(self) -> Bucket:
        s = self.series
        return Bucket(first_step=self.first_step, last_step=self.last_step, steps=self.steps,
                      loss=s["loss"].stat(), grad_norm=s["grad_norm"].stat(),
                      loss_scale=s["loss_scale"].stat(), skipped=self.skipped)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for values in data["series"].values():  # JSON has no infinity
            if not values["n"]:
                values["lo"] = values["hi"] = None
        return data


def bucketize_json(rollups: list[dict[str, Any]], per_bucket: int) -> list[Bucket]:
    """Merge consecutive rollups in their JSON form (`Rollup.to_json`), `per_bucket` at a time.

    No `Rollup` object is built per stored rollup: the 100k-step view merges ~1,600 of them.
    """
    buckets = []
    for start in range(0, len(rollups), per_bucket):
        chunk = rollups[start:start + per_bucket]
        stats = {}
        for name in SERIES:
            parts = [r["series"][name] for r in chunk]
            n = sum(p["n"] for p in parts)
            if not n:
                stats[name] = Stat(min=None, mean=None, max=None)
                continue
            stats[name] = Stat(min=min(p["lo"] for p in parts if p["n"]), mean=sum(p["total"] for p in parts) / n,
                               max=max(p["hi"] for p in parts if p["n"]))
        buckets.append(Bucket(first_step=chunk[0]["first_step"], last_step=chunk[-1]["last_step"],
                              steps=sum(r["steps"] for r in chunk), skipped=sum(r["skipped"] for r in chunk),
                              loss=stats["loss"], grad_norm=stats["grad_norm"], loss_scale=stats["loss_scale"]))
    return buckets


def raw_buckets(records: Sequence[dict[str, Any]], max_points: int) -> list[Bucket]:
    """Buckets cut from the raw series (StepRecords as dicts), at most `max_points`: each record is
    folded straight into its bucket's rollup, one pass, no per-record rollups."""
    per_point = max(1, math.ceil(len(records) / max_points))
    buckets: list[Bucket] = []
    for start in range(0, len(records), per_point):
        merged = Rollup()
        for record in records[start:start + per_point]:
            merged.add(record)
        buckets.append(merged.bucket())
    return buckets


def rollup_buckets(stored: list[dict[str, Any]], tail: Iterable[dict[str, Any]], max_points: int) -> list[Bucket]:
    """Buckets cut from the stored rollups (`Rollup.to_json` form) and the records after the last one
    (`tail`), grouping whole rollups so that no more than `max_points` buckets come back."""
    partial = Rollup()
    for record in tail:
        partial.add(record)
    parts = stored + ([partial.to_json()] if partial.steps else [])
    groups = math.ceil(len(parts) / max_points)
    per_bucket = math.ceil(len(parts) / math.ceil(len(parts) / groups))
    return bucketize_json(parts, per_bucket)
