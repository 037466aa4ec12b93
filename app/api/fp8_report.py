"""A comparison's FP8 variants: when FP8 lost a variant's values, and the clause of the verdict that says so."""

from __future__ import annotations

from mpjobs.contract.comparisons import VariantResult
from mpjobs.contract.formats import percent
from mpjobs.contract.records import DiagnosisCode

FP8_LOSS = frozenset({DiagnosisCode.FP8_UNDERFLOW, DiagnosisCode.FP8_SCALE_ZERO})
"""The FP8 diagnoses that mean values were lost, not just clipped a little: a variant with one is flagged
(never recommended), as one whose gradients underflow is."""
FP8_RISK = 3
"""Added to a variant's numeric risk (app/api/reports.py `_risk`): FP8 keeps 3 or 2 mantissa bits and a
scale that lags the data by two steps, so among variants equally fast, one without FP8 is preferred."""


def fp8_lost(r: VariantResult) -> bool:
    return r.fp8 is not None and any(d.code in FP8_LOSS for d in r.diagnoses)


def fp8_phrase(r: VariantResult) -> str:
    """`mixed_bfloat16 + fp8: FP8 lost values (fp8_underflow in hidden's inputs), and its loss ends +0.4% ...`."""
    where = sorted({f"{d.code.value} in {d.layer}" if d.layer else d.code.value for d in r.diagnoses
                    if d.code in FP8_LOSS})
    end = f", and its loss ends {percent(r.loss_gap, sign=True)} from float32's" if r.loss_gap is not None else ""
    return f"{r.label}: FP8 lost values ({', '.join(where)}; its diagnoses say where and for how long){end}"
