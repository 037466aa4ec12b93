"""The subcommands: one `cmd_*` function each, taking the client (mpjobs.Client) and the parsed arguments."""

from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, TypeVar

from mpjobs import Client
from mpjobs.cli.exit_codes import CliError, Exit, exit_for
from mpjobs.cli.fp8_words import fp8_section
from mpjobs.cli.spec_flags import build_spec, file_spec
from mpjobs.cli.watch import watch, watch_comparison
from mpjobs.cli.words import comparison_report, evaluations_table, layers_report, spec_words, summary_lines, table
from mpjobs.contract.jobs import JobState, MetricsPage
from mpjobs.contract.records import LayerNumerics

LAYERS_PAGE_LIMIT = 100
"""Layer checks per request: each holds every layer's numerics, so a page of them is far larger than a step's."""
LAYER_CSV_FIELDS = ["step", "compute_dtype", "loss_scale", *LayerNumerics.model_fields]
"""One CSV row per (step, layer): the check's step, compute dtype and loss scale, then the layer's numerics."""
SCALED = 1
"""Where the default variants' scaled mixed_float16 variant is: the one a fixed or dynamic loss scale sets."""


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    job = client.submit(build_spec(args), idempotency_key=args.idempotency_key).resource
    print(job.id)
    print(f"{job.state.value}: {spec_words(job.spec.model_dump(mode='json'))}", flush=True)
    for note in job.notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    return watch(client, job.id, args.interval) if args.watch else Exit.OK


def cmd_list(client: Client, args: argparse.Namespace) -> int:
    jobs: list[dict[str, Any]] = []
    cursor = None
    while len(jobs) < args.limit:
        page = client.jobs(state=args.state, limit=min(200, args.limit - len(jobs)), cursor=cursor)
        jobs += [job.model_dump(mode="json") for job in page.jobs]
        cursor = page.next_cursor
        if cursor is None:
            break
    rows = [[j["id"], j["state"], j["spec"]["precision_policy"], (j["spec"].get("loss_scale") or {}).get("mode", "-"),
             f"{j['progress']['step']}/{j['progress']['total_steps']}",
             ",".join(d["code"] for d in (j.get("summary") or {}).get("diagnoses", [])) or "-", j.get("name") or ""]
            for j in jobs]
    print(table(["ID", "STATE", "POLICY", "LOSS SCALE", "STEP", "DIAGNOSES", "NAME"], rows) if rows else "no jobs")
    return Exit.OK


def cmd_show(client: Client, args: argparse.Namespace) -> int:
    job = client.job(args.job_id).resource.model_dump(mode="json")
    if args.json:
        print(json.dumps(job, indent=2))
        return Exit.OK
    spec, worker = job["spec"], job.get("worker")
    gpus = f", GPU {','.join(worker['gpus'])}" if worker and worker.get("gpus") else ""
    where = f" on {worker['host']} pid {worker['pid']} ({worker['device'].get('kind', '?')}{gpus})" if worker else ""
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


def cmd_watch(client: Client, args: argparse.Namespace) -> int:
    return watch(client, args.job_id, args.interval)


def _cell(value: Any) -> Any:
    """A CSV cell: booleans as true/false, null (a non-finite value in the API) as an empty cell."""
    return "" if value is None else str(value).lower() if isinstance(value, bool) else value


def _output(args: argparse.Namespace) -> contextlib.AbstractContextManager[TextIO]:
    return open(args.output, "w", newline="") if args.output else contextlib.nullcontext(sys.stdout)


def metric_pages(client: Client, job_id: str) -> Iterator[MetricsPage]:
    """Every page of the job's step records, in step order; no request is made before the first is asked for."""
    yield from client.job(job_id).pages()


T = TypeVar("T")


def _started(items: Iterator[T]) -> Iterator[T]:
    """`items` with its first request made now, before any output opens: a missing job writes nothing at all."""
    first = next(items, None)
    return iter(()) if first is None else itertools.chain([first], items)


def cmd_metrics(client: Client, args: argparse.Namespace) -> int:
    if args.csv:
        return _metrics_csv(client, args)
    pages = _started(metric_pages(client, args.job_id))
    with _output(args) as out:
        for page in pages:
            _warn_missing(page.missing_steps)
            for point in page.points:
                out.write(json.dumps(point.model_dump(mode="json")) + "\n")
    return Exit.OK


def _warn_missing(ranges: Iterable[tuple[int, int]]) -> None:
    for first_missing, last_missing in ranges:
        print(f"warning: steps {first_missing}-{last_missing} are missing (lost on the server)", file=sys.stderr)


def _metrics_csv(client: Client, args: argparse.Namespace) -> int:
    """The server's streamed CSV, written as it comes; steps missing inside it, or after its last row on an
    ended job, are warned about on stderr as the paged JSON's `missing_steps` are."""
    job = client.job(args.job_id)
    chunks = _started(job.csv())
    expected, partial = 1, ""
    with _output(args) as out:
        for chunk in chunks:
            out.write(chunk)
            *lines, partial = (partial + chunk).split("\n")
            for line in lines:
                head = line.partition(",")[0]
                if head.isdigit():  # a row, not the header
                    step = int(head)
                    _warn_missing([(expected, step - 1)] if step > expected else [])
                    expected = step + 1
    summary = job.refresh().summary
    if job.done and summary is not None and summary.steps_done >= expected:
        _warn_missing([(expected, summary.steps_done)])
    return Exit.OK


def layer_checks(client: Client, job_id: str) -> Iterator[dict[str, Any]]:
    """Every layer check of the job, in step order, page by page."""
    job = client.job(job_id)
    after: int | None = 0
    while after is not None:
        page = job.layer_checks(after=after, limit=LAYERS_PAGE_LIMIT)
        yield from (check.model_dump(mode="json") for check in page.checks)
        after = page.next_after


def cmd_layers(client: Client, args: argparse.Namespace) -> int:
    if args.csv:
        checks = _started(layer_checks(client, args.job_id))
        with _output(args) as out:
            writer = csv.DictWriter(out, LAYER_CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
            writer.writeheader()
            for check in checks:
                at = {"step": check["step"], "compute_dtype": check["compute_dtype"], "loss_scale": check["loss_scale"]}
                writer.writerows({k: _cell(v) for k, v in {**layer, **at}.items()} for layer in check["layers"])
        return Exit.OK
    latest, count = None, 0
    for check in layer_checks(client, args.job_id):  # one page at a time: only the last check is kept
        latest, count = check, count + 1
    fp8 = fp8_section(client, args.job_id)
    with _output(args) as out:
        out.write((layers_report(args.job_id, latest, count) if latest else
                   f"job {args.job_id}: no layer checks yet (under float32 there are none unless "
                   "training.layer_check_every is set)") + "\n" + ("" if fp8 is None else f"\n{fp8}\n"))
    return Exit.OK


def write_evaluations_csv(records: list[dict[str, Any]], out: TextIO) -> None:
    """One CSV row per evaluation: step, loss, a column per metric (sorted), examples, seconds, time."""
    names = sorted({name for r in records for name in r["metrics"]})
    writer = csv.DictWriter(out, ["step", "loss", *names, "examples", "seconds", "time"], lineterminator="\n")
    writer.writeheader()
    writer.writerows({**{k: _cell(v) for k, v in r.items() if k != "metrics"},
                      **{n: _cell(r["metrics"].get(n)) for n in names}} for r in records)


def cmd_evaluations(client: Client, args: argparse.Namespace) -> int:
    records = [r.model_dump(mode="json") for r in client.job(args.job_id).evaluations()]
    with _output(args) as out:
        if args.csv:
            write_evaluations_csv(records, out)
        elif args.json:
            out.writelines(json.dumps(r) + "\n" for r in records)
        else:
            out.write((evaluations_table(records) if records else f"job {args.job_id}: no evaluations yet (a job "
                       "is evaluated only when its spec has `validation`)") + "\n")
    return Exit.OK


def cmd_download(client: Client, args: argparse.Namespace) -> int:
    """The trained model.keras, to `-o PATH` (default `./<id>.keras`): it loads with plain `keras.models.load_model`."""
    path = client.job(args.job_id).download_model(args.output or f"{args.job_id}.keras")
    print(path)
    return Exit.OK


def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    job = client.job(args.job_id)
    if not job.done:  # an ended job's DELETE is a 409: nothing to cancel
        job.cancel()
    state = job.state  # a state this client does not know is shown as sent, and is no end
    if state is JobState.RUNNING:
        print(f"{job.id}: running; cancel requested, it stops after its current step")
    elif state is JobState.CANCELED:
        print(f"{job.id}: canceled")
    else:
        print(f"{job.id}: {state.value}" + ("; nothing to cancel" if state.terminal else ""))
    if not args.wait:
        return Exit.OK
    job.wait(progress=False)
    if job.state != state:
        print(f"{job.id}: {job.state.value}")
    return exit_for(job.state)


def cmd_delete(client: Client, args: argparse.Namespace) -> int:
    """`DELETE ...?purge=true`: the ended job (or comparison, with all its jobs) and every trace of it."""
    (client.delete_comparison if args.comparison else client.delete_job)(args.id)
    print(f"{args.id}: deleted" + (" with all its jobs" if args.comparison else ""))
    return Exit.OK


def comparison_exit(c: dict[str, Any]) -> int:
    """While it runs: 0. Once done: 0 if every variant succeeded, else the highest variant exit code."""
    if c["state"] != "done":
        return Exit.OK
    return max((exit_for(v["state"]) for v in c["variants"]), default=Exit.OK)


def _loss_scale_flags(args: argparse.Namespace) -> str:
    """The loss-scale flags given, as typed ("--loss-scale fixed --scale 1024"), or ""."""
    given = (("--loss-scale", args.loss_scale), ("--scale", args.scale), ("--initial-scale", args.initial_scale),
             ("--growth-steps", args.growth_steps))
    return " ".join(f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
                    for flag, value in given if value is not None)


def compare_variants(args: argparse.Namespace, spec: dict[str, Any]) -> list[Any] | None:
    """`--variant`s as given; else the server's default four (None), with a fixed or dynamic loss scale
    from the flags or SPEC.json on the scaled mixed_float16 variant (index SCALED).

    Loss-scale flags with --variant are refused (no variant would run them); SPEC.json's settings that no
    variant runs are named by `unused_settings`.
    """
    flags = _loss_scale_flags(args)
    if args.variant:
        if flags:
            raise CliError(Exit.USAGE, "with --variant, each variant sets its own loss scale "
                                       "(mixed_float16:dynamic, mixed_float16:fixed=1024); the loss-scale flags "
                                       f"only set the default variants' scaled one. Received: {flags}")
        return list(args.variant)
    scaled = spec.get("loss_scale")
    scaled = {"mode": scaled} if isinstance(scaled, str) else scaled
    if not isinstance(scaled, dict) or scaled.get("mode") not in ("fixed", "dynamic"):
        return None
    variants: list[Any] = [{"precision_policy": "float32"}, {"precision_policy": "mixed_float16", "loss_scale": "none"},
                           {"precision_policy": "mixed_bfloat16"}]
    variants.insert(SCALED, {"precision_policy": "mixed_float16", "loss_scale": scaled})
    return variants


def unused_settings(args: argparse.Namespace, file: dict[str, Any], scaled_sent: bool,
                    labels: list[str]) -> str | None:
    """SPEC.json's precision_policy, loss_scale and speed_check that compare replaces, for stderr; None if none.

    `scaled_sent`: the spec's loss scale went on the scaled variant, `labels[SCALED]`.
    """
    unused = []
    if file.get("precision_policy") is not None:
        unused.append(f"precision_policy {file['precision_policy']!r}")
    scale = file.get("loss_scale")
    if scale is not None and not scaled_sent:
        shown = scale.get("mode") if isinstance(scale, dict) and set(scale) == {"mode"} else scale
        unused.append(f"loss_scale {shown!r}" if isinstance(shown, str) else f"loss_scale {json.dumps(shown)}")
    timing = (" Its speed_check is not used either: the float32 variant times every other one in turns."
              if file.get("speed_check") is not None else "")
    source = "stdin" if args.spec == "-" else args.spec
    if not unused:
        return f"warning: {source}'s speed_check is not used by compare: the float32 variant times every other " \
               "one in turns." if timing else None
    overridden = bool(_loss_scale_flags(args))  # flags win over the file, as in submit
    where = f"; its loss_scale goes on {labels[SCALED]}" if scale is not None and scaled_sent and not overridden else ""
    return (f"warning: {source}'s {' and '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used by compare: "
            f"each variant sets its own ({', '.join(labels)}){where}.{timing}")


def cmd_compare(client: Client, args: argparse.Namespace) -> int:
    if args.show:
        c = client.comparison(args.show).resource.model_dump(mode="json")
    else:
        file = file_spec(args)
        spec = build_spec(args, file)
        variants = compare_variants(args, spec)
        c = client.compare(spec, variants, name=args.name, tolerance=args.tolerance,
                           plan=args.plan).resource.model_dump(mode="json")
        notice = unused_settings(args, file, variants is not None and not args.variant,
                                 [v["label"] for v in c["variants"]])
        if notice:
            print(notice, file=sys.stderr)
        print(c["id"], flush=True)
    if args.watch and c["state"] != "done":
        c = watch_comparison(client, c["id"])
    print(comparison_report(c))
    return comparison_exit(c)
