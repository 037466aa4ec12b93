"""One row format for every benchmark, so `make bench` prints one table.

Each row is a figure next to its baseline from the same run on the same
machine, and their ratio. These machines are shared and noisy: values are
medians over repeats, and `ratio` is the median of per-repeat ratios where a
benchmark repeats (else value / baseline).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime


@dataclass(frozen=True)
class Row:
    benchmark: str
    case: str
    baseline: str
    """What the figure is compared with, e.g. "bare model.fit"."""
    baseline_value: float | None
    value: float
    unit: str
    ratio: float | None
    """value / baseline_value (or the median of per-repeat ratios)."""
    goal: str = ""
    met: bool | None = None
    """None when the row has no goal."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def machine() -> str:
    return (f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}")


def _num(value: float | None) -> str:
    if value is None:
        return "—"
    if value == 0 or abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def table(rows: Sequence[Row]) -> str:
    """A Markdown table, baselines side by side with the figures."""
    lines = ["| benchmark | case | baseline | baseline value | value | unit | ratio | goal | met |",
             "|---|---|---|---:|---:|---|---:|---|---|"]
    for r in rows:
        met = "" if r.met is None else ("yes" if r.met else "**NO**")
        lines.append(f"| {r.benchmark} | {r.case} | {r.baseline} | {_num(r.baseline_value)} | {_num(r.value)} "
                     f"| {r.unit} | {'—' if r.ratio is None else f'{r.ratio:.3f}'} | {r.goal} | {met} |")
    return "\n".join(lines)


def cli(title: str, doc: str, run: Callable[..., list[Row]]) -> None:
    """`python -m bench.NAME [--quick] [--repeats N]`: one benchmark, its table."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--repeats", type=int, help="repeats per measurement (default: the benchmark's)")
    parser.add_argument("--quick", action="store_true", help="smaller runs, for a smoke check")
    args = parser.parse_args()
    print(f"# {title} — {machine()}")
    print(table(run(quick=args.quick, **({"repeats": args.repeats} if args.repeats else {}))))
