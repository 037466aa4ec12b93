"""The argparse parser: global options, the job-spec flags and one subparser per command."""

from __future__ import annotations

import argparse
import os
from typing import Any

from mpjobs import DEFAULT_TIMEOUT_S, DEFAULT_URL
from mpjobs.cli.commands import (
    cmd_cancel,
    cmd_compare,
    cmd_delete,
    cmd_download,
    cmd_evaluations,
    cmd_layers,
    cmd_list,
    cmd_metrics,
    cmd_show,
    cmd_submit,
    cmd_watch,
)
from mpjobs.cli.dataset_commands import cmd_datasets, cmd_upload
from mpjobs.cli.plan_commands import cmd_plan
from mpjobs.cli.spec_flags import variant
from mpjobs.contract.jobs import JobState
from mpjobs.contract.spec import LossScaleMode, PrecisionPolicy

MODELS = ("mlp", "cnn", "conv3d_unet", "transformer")

EXIT_CODES = """exit codes:
  0    done; with a watched job (watch, submit --watch, cancel --wait): it succeeded
  1    the job failed (compare: a variant failed)
  2    usage or validation error: a bad flag, an unreadable SPEC.json, the API's 422 (each field printed);
       delete: the job has not ended, or belongs to a comparison (409; nothing was deleted)
  3    the job was canceled (compare: a variant was)
  4    no such job or comparison
  5    cannot reach the API, credentials refused (401), or a server error (the API's detail is printed)
  130  interrupted with Ctrl-C; the job keeps running (mpjobs cancel ID stops it)
"""


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1. Received: {value}")
    return value


class Refused(argparse.Action):
    """An option a command does not take: out of its --help, and refused with `why` (exit 2) if given."""

    def __init__(self, option_strings: list[str], dest: str, why: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.why = why

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(self.why)


def spec_options(compare: bool) -> argparse.ArgumentParser:
    """The job-spec flags. compare's variants set the precision policy, so it has no --policy."""
    spec = argparse.ArgumentParser(add_help=False)
    g = spec.add_argument_group("job spec: SPEC.json and/or flags; flags override the file" + (
        "; each variant sets its own policy and loss scale" if compare else ""))
    g.add_argument("spec", nargs="?", metavar="SPEC.json", help="a job spec as JSON; - reads stdin" + (
        "; a warning names its precision_policy and loss_scale if no variant runs them" if compare else ""))
    g.add_argument("--model", choices=MODELS)
    if compare:  # and mixed_float16 without scaling is one of its default variants already
        g.add_argument("--policy", action=Refused, why="compare runs each variant's own policy: use --variant "
                                                       "POLICY[:MODE] instead of --policy.")
        g.add_argument("--loss-scale", choices=["fixed", "dynamic"],
                       help="the scaled mixed_float16 variant's, without --variant")
    else:
        g.add_argument("--policy", choices=[p.value for p in PrecisionPolicy], help="precision policy")
        g.add_argument("--loss-scale", choices=[m.value for m in LossScaleMode])
    g.add_argument("--initial-scale", type=float, help="dynamic: the first scale")
    g.add_argument("--growth-steps", type=int, help="dynamic: finite steps before the scale doubles")
    g.add_argument("--scale", type=float, help="fixed: the scale")
    g.add_argument("--steps", type=int)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--learning-rate", type=float)
    g.add_argument("--optimizer", choices=["adam", "adamw", "sgd", "rmsprop"])
    g.add_argument("--seed", type=int)
    g.add_argument("--samples", type=int, help="synthetic dataset size")
    g.add_argument("--name", help="the comparison's name; its jobs are named NAME · VARIANT" if compare else None)
    g.add_argument("--device", choices=["any", "cpu", "gpu"])
    return spec


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpjobs", description="Mixed-precision training jobs over the mpjobs API.",
                                     epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("MPJOBS_URL", DEFAULT_URL),
                        help="the API (default: $MPJOBS_URL or %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("MPJOBS_API_KEY"),
                        help="sent as Authorization: Bearer KEY (default: $MPJOBS_API_KEY)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds per HTTP request (default: %(default)g)")
    # The same options after the command (`mpjobs show ID --url ...`); SUPPRESS keeps the defaults above.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--api-key", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--timeout", type=float, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    spec, compared = spec_options(compare=False), spec_options(compare=True)
    interval = argparse.ArgumentParser(add_help=False)
    interval.add_argument("--interval", type=float, default=5.0, help="seconds between progress lines when stderr "
                          "is not a terminal; 0: every step (default: %(default)s)")

    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Any, help: str, parents: tuple[argparse.ArgumentParser, ...] = ()
                ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help, parents=[common, *parents], epilog=EXIT_CODES,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        sub.set_defaults(run=run)
        return sub

    p = command("submit", cmd_submit, "queue a job; prints its id", (spec, interval))
    p.add_argument("--idempotency-key", help="a retry with the same key returns the first job")
    p.add_argument("--watch", action="store_true", help="then follow it to the end, as `watch` does")
    p = command("list", cmd_list, "jobs, newest first")
    p.add_argument("--state", choices=[s.value for s in JobState])
    p.add_argument("--limit", type=positive, default=20)
    p = command("show", cmd_show, "one job: state, spec, progress, summary, diagnoses, error")
    p.add_argument("job_id", metavar="ID")
    p.add_argument("--json", action="store_true", help="the raw job resource")
    p = command("watch", cmd_watch, "follow a job's steps live, then print how it ended", (interval,))
    p.add_argument("job_id", metavar="ID")
    p = command("metrics", cmd_metrics, "every step record: JSON lines, or CSV with --csv")
    p.add_argument("job_id", metavar="ID")
    p.add_argument("--csv", action="store_true", help="CSV with a header row of the step record's fields")
    p.add_argument("--output", "-o", metavar="FILE", help="write here instead of stdout")
    p = command("layers", cmd_layers, "every layer's gradient and activation numerics at the latest layer check, "
                "marking where underflow begins; every check as CSV with --csv")
    p.add_argument("job_id", metavar="ID")
    p.add_argument("--csv", action="store_true", help="every check, one row per step and layer, with a header row")
    p.add_argument("--output", "-o", metavar="FILE", help="write here instead of stdout")
    p = command("plan", cmd_plan, "the precision plan of a job: which layers to keep in float32 and what loss "
                "scale make its first flagged step match float32, the search, a spec fragment and Keras lines")
    p.add_argument("job_id", metavar="ID")
    p.add_argument("--json", action="store_true", help="the plan resource as JSON")
    p = command("evaluations", cmd_evaluations, "every evaluation on the held-out rows: step, loss, each metric, "
                "examples and seconds; JSON lines with --json")
    p.add_argument("job_id", metavar="ID")
    p.add_argument("--json", action="store_true", help="one evaluation record per line")
    p.add_argument("--csv", action="store_true", help="one CSV row per evaluation, a column per metric")
    p.add_argument("--output", "-o", metavar="FILE", help="write here instead of stdout")
    p = command("download", cmd_download, "save a job's trained model (model.keras), which loads with plain "
                "keras.models.load_model")
    p.add_argument("job_id", metavar="ID")
    p.add_argument("--output", "-o", metavar="PATH", help="where to write it (default: ./ID.keras)")
    p = command("cancel", cmd_cancel, "cancel a queued or running job", ())
    p.add_argument("job_id", metavar="ID")
    p.add_argument("--wait", action="store_true", help="wait until it has ended; exit code follows its end state")
    p = command("delete", cmd_delete, "delete an ended job for good: its record, step records, files and "
                "queue entries; a job of a comparison goes only with the comparison (--comparison)")
    p.add_argument("id", metavar="ID")
    p.add_argument("--comparison", action="store_true", help="ID is a comparison's: delete it and all its jobs, "
                   "once every one has ended")
    p = command("compare", cmd_compare, "run one spec under several precision variants and compare them",
                (compared,))
    p.add_argument("--variant", action="append", type=variant, metavar="POLICY[:MODE]",
                   help="repeatable, e.g. float32 mixed_float16:dynamic mixed_float16:fixed=1024; default: "
                        "float32, mixed_float16:dynamic, mixed_float16:none, mixed_bfloat16")
    p.add_argument("--tolerance", type=float, help="largest relative loss gap that still matches float32")
    p.add_argument("--plan", action="store_const", const="auto", help="add the first half-precision variant "
                   "trained with its precision plan (layers in float32, a loss scale), and a verdict on it")
    p.add_argument("--show", metavar="ID", help="print an existing comparison instead of starting one")
    p.add_argument("--watch", action="store_true", help="poll until every variant has ended")
    p = command("upload", cmd_upload, "upload an .npz of arrays x and y (sent only if the server lacks its bytes); "
                "prints its dataset id, for a spec's {\"kind\": \"uploaded\", \"id\": ID}")
    p.add_argument("file", metavar="FILE.npz")
    command("datasets", cmd_datasets, "your uploaded datasets: id, shapes, dtypes, bytes, jobs")
    return parser
