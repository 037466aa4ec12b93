"""Jobs, summaries, layer checks, tables and comparison reports in plain words, for a terminal."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from mpjobs import member
from mpjobs.contract.comparisons import HeldOut, held_out_words
from mpjobs.contract.formats import num, number, percent, rate, ratio, ratio_range, scale_num, speed_words
from mpjobs.contract.jobs import JobState


def power_of_two(value: float) -> str:
    """A loss scale as people write it: 1024 or 32768, and 2^32 where %g would write 4.29497e+09."""
    exponent = math.log2(value) if value > 0 else 0.5
    return f"2^{exponent:g}" if exponent.is_integer() and value >= 2**17 else f"{value:g}"


def loss_scale_words(scale: dict[str, Any] | None) -> str:
    if not scale or scale.get("mode") == "none":
        return "no loss scaling"
    if scale["mode"] == "fixed":
        return f"fixed loss scale {power_of_two(scale['scale'])}"
    return (f"dynamic loss scale from {power_of_two(scale['initial_scale'])}, doubling after "
            f"{scale['growth_steps']} finite steps")


def _interval(ps: dict[str, Any]) -> tuple[float, float]:
    """A PrecisionSpeed's 95% interval; a record from before they existed has only its median."""
    return (ps["slowdown"] if ps.get("low") is None else ps["low"],
            ps["slowdown"] if ps.get("high") is None else ps["high"])


def precision_speed_words(ps: dict[str, Any]) -> str:
    """A speed check (summary.precision_speed, or a comparison variant's speed) against float32, in words."""
    low, high = _interval(ps)
    rounds = f", 95% interval of {ps['rounds']} rounds" if ps.get("rounds") else ""
    noise = (f"; float32 against itself {ratio_range(ps['noise_low'], ps['noise_high'])}"
             if ps.get("noise_low") is not None and ps.get("noise_high") is not None else "")
    return (f"{speed_words(ps['slowdown'], low, high, ps.get('difference', 'none'))} "
            f"({number(ps['policy_ms'], 3)} ms against {number(ps['float32_ms'], 3)} ms per step{rounds}{noise})")


def spec_words(spec: dict[str, Any]) -> str:
    """The spec in a line; layers in another policy follow the policy ("dense_1 in float32").

    >>> spec_words({"model": {"name": "mlp"}, "precision_policy": "mixed_float16", "layer_policies": {"dense_1":
    ...     "float32"}, "training": {"steps": 5, "batch_size": 8, "optimizer": "sgd", "learning_rate": 0.1},
    ...     "device": "cpu", "loss_scale": {"mode": "none"}})
    'mlp, mixed_float16 (dense_1 in float32) with no loss scaling, 5 steps of batch 8, sgd lr 0.1, device cpu'
    """
    model = spec["model"].get("name", "keras_json model")
    t = spec["training"]
    pins = ", ".join(f"{name} in {policy}" for name, policy in (spec.get("layer_policies") or {}).items())
    policy = f"{spec['precision_policy']} ({pins})" if pins else spec["precision_policy"]
    return (f"{model}, {policy} with {loss_scale_words(spec.get('loss_scale'))}, "
            f"{t['steps']} steps of batch {t['batch_size']}, {t['optimizer']} lr {t['learning_rate']:g}, "
            f"device {spec['device']}")


def summary_lines(job: dict[str, Any]) -> list[str]:
    """How the job ended (or stands), its summary and diagnoses, in plain words."""
    p = job["progress"]
    lines = [f"job {job['id']} {job['state']} after {p['step']} of {p['total_steps']} steps"]
    if job.get("error"):
        lines.append(f"  error            {job['error']['reason']}: {job['error']['message']}")
    s = job.get("summary")
    if not s:
        return [*lines, "  summary          " + ("none: no step finished" if member(JobState, job["state"]).terminal
                                                    else "none yet")]
    peak = s["peak_zero_grad_fraction"]
    speed = s["mean_examples_per_sec"]
    lines += [
        f"  final loss       {num(s['final_loss'])} (mean batch loss of the last steps)",
        f"  skipped steps    {s['skipped_steps']}",
        f"  loss scale       min {scale_num(s['loss_scale_min'])}, max {scale_num(s['loss_scale_max'])}, "
        f"final {scale_num(s['loss_scale_final'])}",
        f"  peak zero grads  {_or_dash(peak, percent, 'n/a')} of gradient elements exactly zero",
        *([f"  vs float32       on {s['float32_checks']} checked steps, at most "
           f"{_or_dash(s['peak_excess_zero_fraction'], percent)} of values zero only here, gradient error "
           f"{_or_dash(s.get('peak_grad_rel_error'), lambda e: number(e, 2))}"] if s.get("float32_checks") else []),
        *([f"  float32 check    {s['float32_check_error']}"] if s.get("float32_check_error") else []),
        *([f"  underflow from   {s['underflow_layer']} (step {s['underflow_step']}; mpjobs layers {job['id']})"]
          if s.get("underflow_layer") else []),
        *([f"  overflow risk    {s['overflow_layer']} (step {s['overflow_step']})"] if s.get("overflow_layer") else []),
        *([f"  fp8              {fp8_summary_words(s['fp8'])}"] if s.get("fp8") else []),
        f"  throughput       {_or_dash(speed, rate, 'n/a')} examples/s"
        + (f", up to {s['steps_per_call']} steps per call" if s.get("steps_per_call") else ""),
        *([f"  validation       {_eval_words(s['validation'])} (mpjobs evaluations {job['id']})"]
          if s.get("validation") else []),
        *([f"  data             {_data_words(s['data'])}"] if s.get("data") and s.get("validation") else []),
    ]
    if s.get("precision_speed"):
        lines.append(f"  precision speed  {precision_speed_words(s['precision_speed'])}")
    diagnoses = s.get("diagnoses") or []
    lines.append("  diagnoses        " + (", ".join(d["code"] for d in diagnoses) or "none"))
    for d in diagnoses:
        since = f", from step {d['first_step']}" if d.get("first_step") is not None else ""
        lines.append(f"    - {d['message']} ({d['code']}{since})")
    return lines


def fp8_summary_words(fp8: dict[str, Any]) -> str:
    """An FP8 job's layers (`Summary.fp8`) in a line: those trained in FP8, those that kept their policy.

    >>> fp8_summary_words({"amax_history_length": 4, "layers": ["dense", "dense_1"], "kept": []})
    'dense, dense_1 in FP8 (amax history of 4 steps); kept their policy: none'
    """
    return (f"{', '.join(fp8['layers']) or 'no layer'} in FP8 (amax history of {fp8['amax_history_length']} "
            f"steps); kept their policy: {', '.join(fp8['kept']) or 'none'}")


def _eval_words(e: dict[str, Any]) -> str:
    metrics = "".join(f", {name} {num(value)}" for name, value in e["metrics"].items())
    return f"loss {num(e['loss'])}{metrics} on {e['examples']} held-out rows at step {e['step']}"


def _data_words(d: dict[str, Any]) -> str:
    return (f"{d['rows']} rows trained on ({d['held_out_rows']} held out), {number(d['epochs'], 3)} epochs of "
            f"{d['steps_per_epoch']} steps, each reshuffled; {d['dropped_per_epoch']} rows of each epoch dropped "
            "(the partial batch)")


def evaluations_table(records: list[dict[str, Any]]) -> str:
    """One row per evaluation: step, loss, each metric, held-out rows and seconds."""
    names = list(records[0]["metrics"])
    return table(["step", "loss", *names, "examples", "seconds"],
                 [[str(r["step"]), num(r["loss"]), *(num(r["metrics"].get(n)) for n in names),
                   str(r["examples"]), number(r["seconds"], 3)] for r in records])


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [header, *rows])


def _or_dash(value: Any, show: Callable[[float], str], dash: str = "-") -> str:
    return dash if value is None else show(value)


def speed_cell(v: dict[str, Any], dash: str = "-") -> str:
    """A variant's measured step time against float32's: median (95% interval), or why there is none."""
    if v.get("baseline"):
        return "1 (baseline)"
    ps = v.get("speed")
    if not ps:
        return "not timed" if v.get("speed_error") else dash
    return f"{ratio(ps['slowdown'])} ({ratio_range(*_interval(ps), unit='')})"


def comparison_report(c: dict[str, Any]) -> str:
    rows = []
    for v in c["variants"]:
        rows.append([
            v["label"] + (" (baseline)" if v.get("baseline") else ""), v["state"],
            f"{v['progress']['step']}/{v['progress']['total_steps']}", _or_dash(v.get("final_loss"), number),
            _or_dash(v.get("loss_gap"), lambda gap: percent(gap, sign=True)),
            _or_dash(v.get("examples_per_sec"), rate), speed_cell(v),
            _or_dash(v.get("skipped_steps"), str), _or_dash(v.get("peak_zero_grad_fraction"), percent),
            _or_dash(v.get("peak_excess_zero_fraction"), percent),
            ",".join(d["code"] for d in v.get("diagnoses") or []) or "-", v["job_id"]])
    header = ["VARIANT", "STATE", "STEP", "FINAL LOSS", "VS FLOAT32", "THROUGHPUT EX/S", "STEP TIME VS FLOAT32",
              "SKIPPED",
              "ZERO GRADS", "EXCESS ZEROS", "DIAGNOSES", "JOB"]
    lines = [f"comparison {c['id']}" + (f"  {c['name']!r}" if c.get("name") else "") + f"  ({c['state']})",
             table(header, rows)]
    for v in c["variants"]:
        error = v.get("error")
        if error:
            text = f"{error['reason']}: {error['message']}" if isinstance(error, dict) else str(error)
            lines.append(f"  {v['label']} {v['state']}: {text}")
        if v.get("speed_error"):
            lines.append(f"  {v['label']} not timed: {v['speed_error']}")
        if v.get("held_out"):
            held = HeldOut.model_validate(v["held_out"])
            p_value = f", McNemar p={held.p_value:.3g}" if held.p_value is not None else ""
            lines.append(f"  {v['label']}: {held_out_words(held)}{p_value}, {held.examples} examples ({held.method})")
        if v.get("held_out_error"):
            lines.append(f"  {v['label']} no held-out verdict: {v['held_out_error']}")
    control = c.get("seed_control")
    if control:
        noise = HeldOut.model_validate(control["held_out"]) if control.get("held_out") else None
        lines.append(f"  seed noise, {control['label']} ({control['state']}, job {control['job_id']}): "
                     + (held_out_words(noise) if noise else control.get("held_out_error") or "no held-out result"))
    lines.append(f"verdict: {c['verdict']}")
    return "\n".join(lines)


def log2_cell(log2: float) -> str:
    """A magnitude given as its base-2 logarithm, as a power of two, 3 significant digits: -24.0 -> "2^-24"."""
    return f"2^{number(log2, 3)}"


def _layer_row(layer: dict[str, Any], check: dict[str, Any]) -> list[str]:
    """A layer's cells: "-" where it has nothing to show (nothing to train, its output not read, or no
    such value: no float32 reference, no non-zero gradient), "non-finite" where inf or NaN hid it."""
    def grad(field: str, show: Callable[[Any], str], magnitude: bool = True) -> str:
        value, finite = layer.get(field), layer.get("grads_finite", True)
        if layer["values"] == 0 or (value is None and not magnitude):
            return "-"
        if magnitude and not finite:
            return "non-finite"
        return "0" if value is None and field == "grad_max_log2" else _or_dash(value, show)  # all zero

    def activation(field: str, show: Callable[[Any], str]) -> str:
        if layer.get("activation_dtype") is None:
            return "-"
        return "non-finite" if not layer.get("activation_finite", True) else _or_dash(layer.get(field), show)

    marks = [words for name, words in ((check.get("underflow_layer"), "underflow begins here"),
                                        (check.get("overflow_layer"), "near overflow")) if name == layer["name"]]
    return [layer["name"], layer["kind"], grad("zero_fraction", percent, False),
            grad("excess_zero_fraction", percent, False),
            grad("grad_norm", number), grad("grad_max_log2", log2_cell), grad("grad_min_log2", log2_cell),
            activation("activation_max", number), activation("activation_headroom_log2", lambda h: number(h, 3)),
            activation("activation_subnormal_fraction", percent), ", ".join(marks)]


RECOVERY = {
    "recovered": "the same step at loss scale {scale} keeps the gradients of {layer} ({excess} excess zeros left)",
    "overflows_first": "no loss scale keeps them: at {scale} the step's gradients overflow before those of {layer} "
                       "come back",
    "not_by_scaling": "a larger loss scale does not bring the gradients of {layer} back (tried up to {scale})",
}
"""What the same step, tried again at doubling loss scales, found (LayerCheck.recovery)."""
LAYER_HEADER = ["LAYER", "KIND", "ZERO GRADS", "EXCESS ZEROS", "GRAD NORM", "MAX |G|", "MIN |G|", "ACT MAX",
                "HEADROOM (DOUBLINGS)", "SUBNORMAL ACT", ""]


def layers_report(job_id: str, check: dict[str, Any], checks: int) -> str:
    """One layer check (the API's LayerCheck) as a table, input side first, with what it found in words.

    EXCESS ZEROS: gradient values zero under the policy but not in float32; MIN |G|: the smallest
    non-zero one; HEADROOM: doublings left before the activations overflow their dtype.
    """
    which = f"the latest of {checks}" if checks > 1 else "the only one"
    lines = [f"job {job_id}: layer check at step {check['step']} ({which}), {check['compute_dtype']} compute, "
             f"loss scale {scale_num(check['loss_scale'])}",
             table(LAYER_HEADER, [_layer_row(layer, check) for layer in check["layers"]])]
    if check.get("underflow_layer"):
        lines.append(f"gradient underflow begins at {check['underflow_layer']}: the layer nearest the output "
                     "that loses gradient values float32 keeps (backpropagation reaches it first)")
    recovery, at = check.get("recovery"), check.get("recovery_scale")
    if recovery and at is not None:
        lines.append(RECOVERY[recovery].format(layer=check["underflow_layer"], scale=scale_num(at), excess=_or_dash(
            check.get("recovery_excess_zero_fraction"), percent)))
    if check.get("overflow_layer"):
        lines.append(f"activations near overflow from {check['overflow_layer']}: within two doublings of their "
                     "dtype's largest value")
    return "\n".join(lines)
