"""The API-throughput and scaling benchmarks, in quick mode: they run end to end and report
every case with positive figures. Needs Debian's `wrk` (`apt-get install -y wrk`)."""

from __future__ import annotations

import shutil

import pytest

from bench import api_throughput, loadgen, scaling

WRK_OK = """\
Running 1s test @ http://127.0.0.1:18765/
  1 threads and 2 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.63ms    2.70ms  16.91ms   83.84%
    Req/Sec     0.93k   328.13     1.40k    70.00%
  Latency Distribution
     50%  817.00us
     75%    3.94ms
     90%    6.41ms
     99%    1.26s
  929 requests in 1.01s, 3.28MB read
Requests/sec:    920.19
Transfer/sec:      3.25MB
"""

WRK_ERRORS = """\
Running 1s test @ http://127.0.0.1:18765/missing
  1 threads and 2 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.29ms    2.94ms  22.91ms   90.78%
    Req/Sec     1.20k   472.48     1.79k    70.00%
  Latency Distribution
     50%    1.27ms
     75%    2.48ms
     90%    4.90ms
     99%   16.53ms
  1198 requests in 1.04s, 608.36KB read
  Socket errors: connect 0, read 3, write 0, timeout 2
  Non-2xx or 3xx responses: 1198
Requests/sec:   1152.06
Transfer/sec:    585.03KB
"""


def test_parse_wrk_reads_rate_percentiles_and_errors() -> None:
    ok = loadgen.parse_wrk(WRK_OK)
    assert (ok.requests_per_s, ok.p50_ms, ok.p99_ms, ok.requests, ok.errors) == (920.19, 0.817, 1260.0, 929, 0)
    bad = loadgen.parse_wrk(WRK_ERRORS)
    assert (bad.requests_per_s, bad.p99_ms, bad.requests, bad.errors) == (1152.06, 16.53, 1198, 1198 + 5)
    with pytest.raises(ValueError, match="Expected wrk --latency output"):
        loadgen.parse_wrk("unable to connect to 127.0.0.1:1 Connection refused")


def test_api_throughput_quick() -> None:
    assert shutil.which("wrk"), f"the benchmark needs wrk: {loadgen.WRK_INSTALL}"
    rows = api_throughput.run(quick=True)
    cases = {row.case for row in rows}
    pages = [f"GET /jobs/{{id}}/metrics?limit=1000, 10k-step job {where}" for where in ("in Redis", "archived")]
    for endpoint in ["GET /jobs/{id}, succeeded", "GET /jobs/{id}, queued, no worker", *pages,
                     "GET /jobs/{id}/metrics?max_points=500, 10k-step job running "
                     "(recomputed at most once a second)",
                     "GET /jobs/{id}/metrics?max_points=500, 10k-step job ended (cached)",
                     "sync variant of the baseline (threadpool)"]:
        assert {f"{endpoint}: req/s", f"{endpoint}: p99", f"{endpoint}: server CPU/request"} <= cases
    for kind in ("running (recomputed at most once a second)", "ended (cached)"):
        assert f"GET /jobs/{{id}}/metrics?max_points=500, 10k-step job {kind}, 1 connection: p99" in cases
    for row in rows:
        assert row.value > 0, row
        assert row.baseline_value is None or (row.baseline_value > 0 and row.ratio is not None and row.ratio > 0), row
    by_case = {row.case: row for row in rows}
    for endpoint in ("GET /jobs/{id}, succeeded", "GET /jobs/{id}, queued, no worker"):
        row = by_case[f"{endpoint}: req/s"]
        assert row.baseline.endswith("(redis.asyncio)") and row.goal == ">= 0.70x" and row.met is not None
    for endpoint in pages:
        speed, cpu = by_case[f"{endpoint}: req/s"], by_case[f"{endpoint}: server CPU/request"]
        assert speed.baseline.startswith("the page validated") and speed.goal == ">= 5.00x", speed
        assert cpu.goal == "<= 2,500 µs" and cpu.met == (cpu.value <= 2500)
    for where in ("in Redis", "archived"):
        export = by_case[f"CSV export of 10,000 steps, {where}: GET /jobs/{{id}}/metrics.csv"]
        assert export.unit == "s" and export.baseline_value and export.baseline_value > 0


def test_scaling_quick() -> None:
    rows = scaling.run(quick=True)
    by_case = {row.case: row for row in rows}
    for steps in ("1,000", "10,000"):
        assert f"metrics, all pages (limit 10,000), {steps} steps" in by_case
        assert f"metrics, all pages, {steps} steps: per step" in by_case
        assert f"metrics?max_points=500, {steps} steps" in by_case
    assert by_case["metrics, all pages, 10,000 steps: per step"].ratio is not None
    two = by_case["job throughput, 2 workers, 4 float32 mlp jobs of 20 steps (2 cores: expect < 2x)"]
    one = by_case["job throughput, 1 worker, 4 float32 mlp jobs of 20 steps"]
    assert one.value > 0 and two.baseline_value == one.value and two.ratio is not None and two.ratio > 0
    assert all(row.value > 0 for row in rows)
