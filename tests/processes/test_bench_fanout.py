"""The fan-out benchmark in quick mode: every stream whole with every step once, the API's Redis connections no
more than with one viewer, and each figure a real measurement (positive, finite)."""

from __future__ import annotations

import math

from bench import fanout


def test_fanout_quick() -> None:
    rows = fanout.run(quick=True)
    viewers, jobs = fanout.QUICK[0], fanout.QUICK[1]
    cases = {row.case.split(":")[0] for row in rows}
    assert cases == {f"{viewers} viewers, 1 job", f"{viewers} viewers over {jobs} jobs"}
    for row in rows:
        assert row.baseline_value is not None and math.isfinite(row.value) and row.value > 0, row
        if row.met is not None:
            assert row.met, row
    whole = [row for row in rows if "every step once" in row.case]
    assert len(whole) == 2 and all(row.value == viewers for row in whole)
    assert sum("Redis connections" in row.case for row in rows) == 2
