"""The `plan` subcommand: a job's precision plan in words, its search, and how to apply it."""

from __future__ import annotations

import argparse
import json

from mpjobs import Client
from mpjobs.cli.exit_codes import Exit
from mpjobs.contract.plan import PlanView


def plan_report(view: PlanView) -> str:
    """The plan as the CLI prints it: verdict, each move of the search, the spec fragment and the Keras lines."""
    p = view.plan
    lines = [f"job {view.job_id}: precision plan at step {p.step} ({p.policy}, loss scale {p.loss_scale:g}; "
             f"{p.evaluated} candidates tried)", f"  {p.message}", "  search:"]
    for i, move in enumerate(p.moves):
        what = ("the step as it was" if i == 0 else
                ", ".join(filter(None, [f"loss scale {move.loss_scale:g}" if move.loss_scale else "",
                                        f"float32: {', '.join(move.pinned)}" if move.pinned else ""])))
        error = "not finite" if move.grad_rel_error is None else f"{move.grad_rel_error:.2%}"
        lines.append(f"    {i}. {what}: flagged {', '.join(move.flagged) or 'none'}; gradient error against "
                     f"float32 {error}")
    lines += ["  spec fragment:", f"    {json.dumps(view.spec_fragment)}", "  in Keras:",
              *(f"    {line}" for line in view.keras.splitlines())]
    return "\n".join(lines)


def cmd_plan(client: Client, args: argparse.Namespace) -> int:
    view = client.job(args.job_id).plan()
    print(view.model_dump_json(indent=2) if args.json else plan_report(view))
    return Exit.OK
