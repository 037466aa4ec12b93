"""Job specs from SPEC.json and flags, and the precision variants `compare` takes."""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

from mpjobs.cli.exit_codes import CliError, Exit
from mpjobs.contract.spec import LossScaleMode, PrecisionPolicy


def read_spec(path: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        spec = json.loads(text)
    except OSError as exc:
        raise CliError(Exit.USAGE, f"cannot read {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise CliError(Exit.USAGE, f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(spec, dict):
        raise CliError(Exit.USAGE, f"{path} must hold a JSON object (a job spec)")
    return spec


def _merge(spec: dict[str, Any], key: str, values: dict[str, Any]) -> None:
    values = {k: v for k, v in values.items() if v is not None}
    if values:
        current = spec.get(key)
        spec[key] = {**current, **values} if isinstance(current, dict) else values


def file_spec(args: argparse.Namespace) -> dict[str, Any]:
    """SPEC.json as given (stdin for -), or {} without one."""
    return read_spec(args.spec) if args.spec else {}


def build_spec(args: argparse.Namespace, file: dict[str, Any] | None = None) -> dict[str, Any]:
    """SPEC.json (if given; `file` when already read) with the flags on top; flags win."""
    spec = copy.deepcopy(file) if file is not None else file_spec(args)
    if args.model and not (isinstance(spec.get("model"), dict) and spec["model"].get("name") == args.model):
        spec["model"] = {"name": args.model}
    if "model" not in spec:
        raise CliError(Exit.USAGE, "give a SPEC.json or --model")
    mode = args.loss_scale
    if args.scale is not None:
        mode = mode or "fixed"
    if args.initial_scale is not None or args.growth_steps is not None:
        mode = mode or "dynamic"
    if (args.scale is not None and mode != "fixed") or (
            mode != "dynamic" and (args.initial_scale is not None or args.growth_steps is not None)):
        raise CliError(Exit.USAGE, "--scale goes with --loss-scale fixed; --initial-scale and --growth-steps "
                                   f"go with --loss-scale dynamic. Received: --loss-scale {mode}")
    if mode:
        current = spec.get("loss_scale")
        current = {"mode": current} if isinstance(current, str) else current
        # The file's settings for the same mode stay; another mode starts from its defaults.
        spec["loss_scale"] = current if isinstance(current, dict) and current.get("mode") == mode else {"mode": mode}
        _merge(spec, "loss_scale", {"scale": args.scale, "initial_scale": args.initial_scale,
                                    "growth_steps": args.growth_steps})
    _merge(spec, "training", {"steps": args.steps, "batch_size": args.batch_size, "learning_rate":
                              args.learning_rate, "seed": args.seed, "optimizer": args.optimizer})
    _merge(spec, "dataset", {"samples": args.samples})
    policy = getattr(args, "policy", None)  # compare takes none: its variants bring theirs
    for key, value in (("precision_policy", policy), ("name", args.name), ("device", args.device)):
        if value is not None:
            spec[key] = value
    return spec


def variant(text: str) -> dict[str, Any]:
    """`POLICY[:MODE]`, MODE one of none, fixed[=SCALE], dynamic; no MODE: the policy's default."""
    policy, _, mode = text.partition(":")
    mode, _, scale = mode.partition("=")
    policies, modes = [p.value for p in PrecisionPolicy], [m.value for m in LossScaleMode]
    if policy not in policies or (mode and mode not in modes) or (scale and mode != "fixed"):
        raise argparse.ArgumentTypeError(f"expected POLICY[:MODE] with POLICY one of {policies} and MODE one of "
                                         f"{modes} (fixed=SCALE for a scale). Received: {text!r}")
    try:
        loss_scale = {"mode": mode, **({"scale": float(scale)} if scale else {})} if mode else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"SCALE must be a number. Received: {scale!r}") from None
    return {"precision_policy": policy, "loss_scale": loss_scale}
