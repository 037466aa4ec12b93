"""The archived-reads benchmark in quick mode: it runs end to end and sets every archive figure beside Redis's."""

from __future__ import annotations

from bench import archived_reads


def test_archived_reads_are_measured_beside_the_same_reads_from_redis() -> None:
    rows = archived_reads.run(quick=True)
    *paired, opened, archived = rows
    assert [r.case.split(",")[0] for r in paired] == ["GET /jobs/{id}/metrics?after=A&limit=1000"] * 2 + [
        "GET /jobs/{id}/metrics?max_points=500"] * 2
    for row in paired:
        assert row.baseline == "the same job in Redis" and row.baseline_value and row.baseline_value > 0
        assert row.value > 0 and row.ratio == row.value / row.baseline_value and row.met is not None
    assert paired[-1].case.endswith("p99, 21 requests a side") and "<= 100 ms" in paired[-1].goal
    assert opened.value > 0 and archived.value > 0
