"""The optimizer's per-step telemetry vector, by name: what the compiled step measures for the host."""

from __future__ import annotations

from typing import Any, NamedTuple

ZERO_COUNT_SPLIT = 2**24
CALL_STEPS_KEY = "call_steps"
"""The `logs` key that tells callbacks how many steps a call ran (1 when absent: `fit`'s calls)."""


class Telemetry(NamedTuple):
    """The optimizer's `telemetry` vector, by name: one float32 each, in this order.

    The zero count is an integer that float32 holds exactly only below 2**24, so it
    travels as two exact float32 parts (`zeros_high * 2**24 + zeros_low`) and the host
    divides in float64 (`zero_fraction`).
    """

    total_loss: Any
    loss_scale: Any
    grad_norm: Any
    grads_finite: Any
    skipped: Any
    zeros_high: Any
    zeros_low: Any
    regularization_loss: Any

    def zero_fraction(self, elements: int) -> float:
        """The share of gradient values that are exactly zero, in float64."""
        return (int(self.zeros_high) * ZERO_COUNT_SPLIT + int(self.zeros_low)) / elements if elements else 0.0


TELEMETRY_FIELDS = Telemetry._fields
GRADS_FINITE = TELEMETRY_FIELDS.index("grads_finite")


def split(vector: list[float]) -> tuple[Telemetry, tuple[float, ...]]:
    """The optimizer's vector as its named fields, and what follows them: the FP8 layers' state
    (worker/telemetry/fp8_state.py), empty without FP8 layers."""
    width = len(TELEMETRY_FIELDS)
    return Telemetry(*vector[:width]), tuple(vector[width:])
