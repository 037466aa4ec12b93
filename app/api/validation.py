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


ECHO_CHARS = 500
"""An echoed input longer than this is cut: a 160 KB keras_json need not come back whole to say what is wrong."""


def _echo(value: Any) -> Any:
    if isinstance(value, str | bytes) and len(value) > ECHO_CHARS:
        text = value if isinstance(value, str) else value.decode("utf-8", "replace")
        return f"{text[:ECHO_CHARS]}… ({len(value):,} {'characters' if isinstance(value, str) else 'bytes'})"
    return value


def is_json(content_type: str | None) -> bool:
    """`application/json`, or a `+json` type such as `application/merge-patch+json`; parameters ignored.
    (FastAPI reads a body without a content type as bytes, not JSON.)"""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def validation_error(exc: RequestValidationError, content_type: str | None = None) -> JSONResponse:
    """FastAPI's 422, `{"detail": [{"type", "loc", "msg", "input", ...}]}`, made strict JSON, long inputs cut.

    A body sent as anything but JSON (curl's `-d` alone sends a form) is a 415 that says what to send,
    not a 422 that echoes the body as an invalid dictionary.
    """
    errors = exc.errors()
    on_body = any(error.get("loc", ())[:1] == ("body",) for error in errors)
    if on_body and not is_json(content_type):
        received = (content_type or "").split(";")[0].strip() or "none"
        detail = (f"Send the body as JSON, with the header 'Content-Type: application/json' (curl: "
                  f"-H 'content-type: application/json'). Received: content-type {received!r}")
        return JSONResponse({"detail": detail}, status_code=status.HTTP_415_UNSUPPORTED_MEDIA_TYPE)
    echoed = [{**error, "input": _echo(error["input"])} if "input" in error else error for error in errors]
    detail = strict_json(jsonable_encoder(echoed))
    return JSONResponse({"detail": detail}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)
