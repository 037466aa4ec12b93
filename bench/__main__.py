"""`make bench` (`python -m bench`): every CPU benchmark, one table.

Each row sets a figure beside its baseline from the same run on the same
machine. Benchmarks run one after another, never at the same time.

    python -m bench [--quick] [--only NAME ...] [--json FILE]

`peers` (mpjobs against TensorBoard, a hand-written scale logger and MLflow) needs the `bench` extra
(`pip install -e '.[bench]'`; `make` installs it).
GPU speedup is separate (`python -m bench.gpu_speedup`): it needs a GPU host.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

from bench.report import Row, machine, table

BENCHMARKS = ("engine_overhead", "fp8_overhead", "float32_check", "speed_check", "service_overhead", "metric_delivery",
              "api_throughput", "archived_reads", "scaling", "upload", "evaluation_cost", "peers", "fanout")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs, for a smoke check")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    header = f"# mpjobs benchmarks — {machine()}{' (quick)' if args.quick else ''}"
    print(header, flush=True)
    rows: list[Row] = []
    for name in args.only:
        start = time.monotonic()
        module = importlib.import_module(f"bench.{name}")
        found: list[Row] = module.run(quick=args.quick)
        rows += found
        print(f"\n## {name} ({time.monotonic() - start:.0f} s)\n{table(found)}", flush=True)
    print(f"\n## All\n{header}\n\n{table(rows)}")
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": [r.as_dict() for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
