"""The service benchmarks still run and measure something (quick mode; figures are not checked here)."""

from __future__ import annotations

from bench import metric_delivery, service_overhead


def test_service_overhead_splits_the_job_into_phases() -> None:
    rows = service_overhead.run(quick=True)
    total, *phases, start = rows
    assert start.case == "dequeue -> step 1, 50,000 steps" and start.baseline_value and start.baseline_value > 0
    assert start.value > 0 and start.met is not None
    assert total.baseline == "local run_job (warm)" and total.baseline_value and total.baseline_value > 0
    assert total.value > 0 and total.met is not None
    assert [r.case.strip() for r in phases] == list(service_overhead.PHASES)
    assert all(r.value >= 0 for r in phases if r.case.strip() != "finishing")
    assert abs(sum(r.value for r in phases) - total.value) < 0.5, "the phases cover POST -> end"


def test_metric_delivery_measures_latency_and_reporter_rate() -> None:
    p50, p95, rate = metric_delivery.run(quick=True, repeats=1)
    assert 0 < p50.value <= p95.value
    assert p95.met is not None and p95.goal == "p95 <= 120 ms (one call + 100 ms)"
    assert rate.baseline.startswith("redis-benchmark XADD") and rate.baseline_value and rate.baseline_value > 0
    assert rate.value > 1000, "the reporter must move far more records per second than any job makes"
