"""How a job scales its loss: none, a fixed scale, or Keras's dynamic scale; and the bare-mode shorthand."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field

from mpjobs.contract.strict import Integer, Number, Strict


class LossScaleMode(StrEnum):
    NONE = "none"
    FIXED = "fixed"
    DYNAMIC = "dynamic"


class NoLossScale(Strict):
    mode: Literal["none"] = "none"


class FixedLossScale(Strict):
    mode: Literal["fixed"] = "fixed"
    scale: Number = Field(1024.0, ge=1.0, le=2.0**64)


class DynamicLossScale(Strict):
    mode: Literal["dynamic"] = "dynamic"
    initial_scale: Number = Field(32768.0, ge=1.0, le=2.0**64)
    growth_steps: Integer = Field(2000, ge=1, le=1_000_000)


LossScale = Annotated[
    NoLossScale | FixedLossScale | DynamicLossScale, Field(discriminator="mode")
]



def loss_scale_from_mode(value: Any) -> Any:
    """Accept a bare mode string ("dynamic") for a loss scale with default parameters."""
    if isinstance(value, str):
        if value not in {m.value for m in LossScaleMode}:
            raise ValueError(
                "loss_scale must be one of 'none', 'fixed', 'dynamic'. "
                f"Received: loss_scale={value!r}"
            )
        return {"mode": value}
    return value
