"""The 422 of a request that failed validation, in strict JSON whatever the input it echoes held.

FastAPI's own handler echoes each error's `input`, and fails (a 500) on what JSON's strict form
cannot carry: a NaN or an infinity (`NaN`, `Infinity`, `1e400` parse to them) and a lone surrogate
(`"\\ud800"`), which UTF-8 cannot encode. Here a non-finite number becomes the string of its JSON
token and a lone surrogate its escape as text, in values, keys and messages alike.

>>> strict_json({"input": float("nan"), "loc": ["body", "a\\ud800"], "n": [float("-inf"), 1e3]})
{'input': 'NaN', 'loc': ['body', 'a\\\\ud800'], 'n': ['-Infinity', 1000.0]}
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


def _text(value: str) -> str:
    return value if value.isascii() else value.encode("utf-8", "backslashreplace").decode("utf-8")


def strict_json(value: Any) -> Any:
    """`value` (already JSON-able) with every non-finite float and lone surrogate made strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, str):
        return _text(value)
    if isinstance(value, dict):
        return {_text(str(key)): strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(item) for item in value]
    return value


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422, `{"detail": [{"type", "loc", "msg", "input", ...}]}`, made strict JSON."""
    detail = strict_json(jsonable_encoder(exc.errors()))
    return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)
