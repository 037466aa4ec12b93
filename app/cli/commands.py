"""The subcommands: one `cmd_*` function each, taking the API and the parsed arguments."""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import sys
import time
from typing import Any

from app.cli.api import Api
from app.cli.errors import CliError, Exit, exit_for
from app.cli.spec import build_spec
from app.cli.watch import POLL_INTERVAL_S, watch, watch_comparison
from app.cli.words import comparison_report, spec_words, summary_lines, table
from app.resources import JobState
from app.schemas import StepRecord

PAGE_LIMIT = 10_000
"""Steps per metrics request: the API's own cap."""


def cmd_submit(api: Api, args: argparse.Namespace) -> int:
    headers = {"Idempotency-Key": args.idempotency_key} if args.idempotency_key else {}
    job = api.call("POST", "/jobs", json=build_spec(args), headers=headers)
    print(job["id"])
    print(f"{job['state']}: {spec_words(job['spec'])}", flush=True)
    return watch(api, job["id"], args.interval) if args.watch else Exit.OK


def cmd_list(api: Api, args: argparse.Namespace) -> int:
    jobs: list[dict[str, Any]] = []
    cursor = None
    while len(jobs) < args.limit:
        params = {"limit": min(200, args.limit - len(jobs)), "state": args.state, "cursor": cursor}
        page = api.call("GET", "/jobs", params={k: v for k, v in params.items() if v is not None})
        jobs += page["jobs"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    rows = [[j["id"], j["state"], j["spec"]["precision_policy"], (j["spec"].get("loss_scale") or {}).get("mode", "-"),
             f"{j['progress']['step']}/{j['progress']['total_steps']}",
             ",".join(d["code"] for d in (j.get("summary") or {}).get("diagnoses", [])) or "-", j.get("name") or ""]
            for j in jobs]
    print(table(["ID", "STATE", "POLICY", "LOSS SCALE", "STEP", "DIAGNOSES", "NAME"], rows) if rows else "no jobs")
    return Exit.OK


def cmd_show(api: Api, args: argparse.Namespace) -> int:
    job = api.call("GET", f"/jobs/{args.job_id}")
    if args.json:
        print(json.dumps(job, indent=2))
        return Exit.OK
    spec, worker = job["spec"], job.get("worker")
    where = f" on {worker['host']} pid {worker['pid']} ({worker['device'].get('kind', '?')})" if worker else ""
    lines = [f"job {job['id']}" + (f"  {job['name']!r}" if job.get("name") else ""),
             f"  state            {job['state']}, attempt {job['attempt']}{where}",
             f"  spec             {spec_words(spec)}",
             f"  data             {json.dumps(spec['dataset'])}",
             f"  created          {job['created_at']}; started {job.get('started_at') or '-'}; "
             f"finished {job.get('finished_at') or '-'}"]
    if job.get("waiting_reason"):
        lines.append(f"  waiting          {job['waiting_reason']}")
    print("\n".join([*lines, *summary_lines(job)]))
    return Exit.OK


def cmd_watch(api: Api, args: argparse.Namespace) -> int:
    return watch(api, args.job_id, args.interval)


def cmd_metrics(api: Api, args: argparse.Namespace) -> int:
    fields = list(StepRecord.model_fields)
    with open(args.output, "w", newline="") if args.output else contextlib.nullcontext(sys.stdout) as out:
        writer = csv.DictWriter(out, fields, extrasaction="ignore", lineterminator="\n")
        if args.csv:
            writer.writeheader()
        after: int | None = 0
        while after is not None:
            page = api.call("GET", f"/jobs/{args.job_id}/metrics", params={"after": after, "limit": PAGE_LIMIT})
            for first, last in page.get("missing_steps") or []:
                print(f"warning: steps {first}-{last} are missing (lost on the server)", file=sys.stderr)
            for point in page["points"]:
                if args.csv:
                    writer.writerow({k: ("" if v is None else str(v).lower() if isinstance(v, bool) else v)
                                     for k, v in point.items()})
                else:
                    out.write(json.dumps(point) + "\n")
            after = page["next_after"]
    return Exit.OK


def cmd_cancel(api: Api, args: argparse.Namespace) -> int:
    job = api.call("DELETE", f"/jobs/{args.job_id}")
    state = JobState(job["state"])
    if state is JobState.RUNNING:
        print(f"{job['id']}: running; cancel requested, it stops after its current step")
    elif state is JobState.CANCELED:
        print(f"{job['id']}: canceled")
    else:
        print(f"{job['id']}: {state.value}" + ("; nothing to cancel" if state.terminal else ""))
    if not args.wait:
        return Exit.OK
    while not JobState(job["state"]).terminal:
        time.sleep(POLL_INTERVAL_S)
        job = api.call("GET", f"/jobs/{args.job_id}")
    if state is not JobState(job["state"]):
        print(f"{job['id']}: {job['state']}")
    return exit_for(job["state"])


def comparison_exit(c: dict[str, Any]) -> int:
    """While it runs: 0. Once done: 0 if every variant succeeded, else the highest variant exit code."""
    if c["state"] != "done":
        return Exit.OK
    return max((exit_for(v["state"]) for v in c["variants"]), default=Exit.OK)


def compare_variants(args: argparse.Namespace) -> list[Any] | None:
    """`--variant`s as given; else the server's default four, with `--loss-scale` settings (if any)
    on the scaled mixed_float16 variant. `--policy` would be replaced by every variant's: refused."""
    if getattr(args, "policy", None):
        raise CliError(Exit.USAGE, "compare runs each variant's own policy: use --variant POLICY[:MODE] "
                                   "instead of --policy.")
    if args.variant:
        return list(args.variant)
    spec = build_spec(args)
    scaled = spec.get("loss_scale")
    if not isinstance(scaled, dict) or scaled.get("mode") not in ("fixed", "dynamic"):
        return None
    return [{"precision_policy": "float32"}, {"precision_policy": "mixed_float16", "loss_scale": scaled},
            {"precision_policy": "mixed_float16", "loss_scale": "none"}, {"precision_policy": "mixed_bfloat16"}]


def cmd_compare(api: Api, args: argparse.Namespace) -> int:
    if args.show:
        c = api.call("GET", f"/comparisons/{args.show}")
    else:
        body: dict[str, Any] = {"name": args.name, "spec": build_spec(args), "variants": compare_variants(args)}
        if args.tolerance is not None:
            body["tolerance"] = args.tolerance
        c = api.call("POST", "/comparisons", json=body)
        print(c["id"], flush=True)
    if args.watch and c["state"] != "done":
        c = watch_comparison(api, c["id"])
    print(comparison_report(c))
    return comparison_exit(c)
