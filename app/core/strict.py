"""The base of every spec and record: unknown fields, NaN and Infinity refused; frozen once validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)
