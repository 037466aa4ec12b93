"""The base of every spec and record: unknown fields, NaN and Infinity refused; frozen once validated.

And the field types a spec is made of, each strict where JSON is: `Integer` and `Number` take JSON
numbers only (`"steps": "10"` and `"steps": true` are refused, naming the field), and `Text` takes
only strings that UTF-8 can carry (no lone surrogate, `"\\ud800"`, that Redis or a response could
not encode). Per type rather than `strict=True`: FastAPI validates a body in pydantic's Python mode,
where a strict model would refuse the strings of enums and literals too (`"mixed_float16"`).

>>> from pydantic import TypeAdapter
>>> TypeAdapter(Number).validate_python(1)  # an int is a number
1.0
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationInfo


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


def _a_number(value: Any, info: ValidationInfo) -> Any:
    """Refuse what pydantic's lax mode would turn into a number: a string or a boolean."""
    if isinstance(value, bool | str | bytes | bytearray):
        kind = "a boolean" if isinstance(value, bool) else "a string"
        shown = json.dumps(value if isinstance(value, bool | str) else value.decode("latin-1"))
        raise ValueError(f"Expected {info.field_name} to be a number, not {kind}. Received: {info.field_name}={shown}")
    return value


def _utf8_text(value: Any, info: ValidationInfo) -> Any:
    """Refuse a lone surrogate (JSON's `"\\ud800"`): UTF-8 cannot encode it, so Redis and responses could not."""
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"Expected {info.field_name} to be text that UTF-8 can encode; it holds the lone "
                             f"surrogate {value[exc.start]!r} at position {exc.start}.") from None
    return value


Integer = Annotated[int, BeforeValidator(_a_number)]
"""An int field: a JSON integer, or a float with nothing after the point (`10.0`); never `"10"` or `true`."""
Number = Annotated[float, BeforeValidator(_a_number)]
"""A float field: any JSON number, integers included (`"learning_rate": 1`); never `"1"` or `true`."""
Text = Annotated[str, BeforeValidator(_utf8_text)]
"""A string field that holds only what UTF-8 can encode."""
