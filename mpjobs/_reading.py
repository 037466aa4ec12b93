"""How the client reads the API's answers: a newer server's additions are tolerated, the API's own models untouched.

The API's models (mpjobs/contract/) are strict so that the server refuses what it does not know in a request.
Read by an older client, the same strictness would refuse a newer server's answers. So every answer the
client parses goes through `read` (or `read_json`), which
- ignores fields the client does not know, at any depth (pydantic's validation-time `extra="ignore"`), and
- keeps a value it does not know of an enum or of a string `Literal` of two or more values (a newer
  server's job state, diagnosis code, optimizer...) as the string it is: an enum gets a pseudo-member
  (`JobState("paused")`-like: `.value` is the string, it equals it, and it is no member the enum lists).
The second is done by response variants of the models, derived once per model (`lenient`): subclasses
whose enum and Literal fields fall back to the string. The API's own models and enums are not changed,
so the server goes on refusing unknown fields and values in requests. A one-value Literal (`"mode":
"dynamic"`) is a union's tag, not an open set: a variant of a union the client does not know (a new
model kind) is not readable, and `read` raises `BadResponse` naming the field.

>>> from mpjobs.contract.jobs import JobState, Transition
>>> t = read(Transition, {"state": "paused", "at": "2026-01-01T00:00:00Z", "message": "", "new": 1})
>>> t.state == "paused", t.state.value, t.state in set(JobState), isinstance(t, Transition)
(True, 'paused', False, True)
"""

from __future__ import annotations

import types
from enum import Enum
from functools import cache, partial
from typing import Annotated, Any, Literal, TypeVar, Union, cast, get_args, get_origin

from pydantic import BaseModel, ValidationError, ValidatorFunctionWrapHandler, WrapValidator, create_model

from mpjobs._exceptions import BadResponse

M = TypeVar("M", bound=BaseModel)


def read(model: type[M], data: Any) -> M:
    """`data` (an answer's JSON, decoded) as `model`, unknown fields ignored and unknown enum values kept."""
    try:
        return lenient(model).model_validate(data, extra="ignore")
    except ValidationError as exc:
        raise _unreadable(model, exc) from exc


def read_json(model: type[M], text: str | bytes) -> M:
    """As `read`, from JSON text (an SSE event's data)."""
    try:
        return lenient(model).model_validate_json(text, extra="ignore")
    except ValidationError as exc:
        raise _unreadable(model, exc) from exc


def lenient(model: type[M]) -> type[M]:
    """`model`, or where it has an enum or an open Literal field at any depth, a subclass of it (same name,
    fields, defaults, constraints and validators) whose such fields also take a value they do not list."""
    return cast("type[M]", _derived(model))


@cache
def _derived(model: type[BaseModel]) -> type[BaseModel]:
    fields = {}
    for name, field in model.model_fields.items():
        opened = _open(field.annotation)
        if opened is not field.annotation:
            copied = field._copy()
            copied.annotation = opened
            fields[name] = (opened, copied)
    if not fields:
        return model
    derived: type[BaseModel] = create_model(model.__name__, __base__=model, __module__=model.__module__,
                                            __doc__=model.__doc__, **fields)  # type: ignore[call-overload]
    return derived


def _open(tp: Any) -> Any:
    """`tp` with every enum, open Literal and model in it replaced by its lenient form; `tp` itself if none."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return lenient(tp)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return Annotated[tp, WrapValidator(partial(_enum_or_pseudo, tp))] if issubclass(tp, str) else tp
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        open_set = len(args) > 1 and all(isinstance(a, str) for a in args)
        return Annotated[tp, WrapValidator(_literal_or_text)] if open_set else tp
    if origin is None or not args:
        return tp
    opened = tuple(_open(a) if a is not Ellipsis else a for a in (args[:1] if origin is Annotated else args))
    if all(o is a for o, a in zip(opened, args, strict=False)):
        return tp
    if origin is Annotated:
        return Annotated[(opened[0], *args[1:])]
    if origin in (Union, types.UnionType):
        return Union[opened]  # noqa: UP007  rebuilt from its arguments
    return origin[opened]


E = TypeVar("E", bound=Enum)


def member(cls: type[E], value: str) -> E:
    """`value` as a member of the string enum `cls`, or as a pseudo-member if `cls` does not list it (a newer
    server's job state, say: not terminal, and no member the enum lists), as the client reads its answers. For a
    value read raw: from a `model_dump()`, or the API's JSON by other means.

    >>> from mpjobs import member
    >>> from mpjobs.contract.jobs import JobState
    >>> member(JobState, "failed") is JobState.FAILED, member(JobState, "paused").terminal
    (True, False)
    """
    try:
        return cls(value)
    except ValueError:
        return cast("E", _pseudo(cls, value))


def _enum_or_pseudo(cls: type[str], value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        if not isinstance(value, str):
            raise
    return _pseudo(cls, value)


def _pseudo(cls: type, value: str) -> Any:
    # A pseudo-member, made the way the enum makes its own (its mixin's __new__), never registered with the
    # enum: the server's validation of the same enum in this process stays as strict as before.
    pseudo: Any = str.__new__(cls, value)
    pseudo._name_ = value.upper()
    pseudo._value_ = value
    return pseudo


def _literal_or_text(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        if isinstance(value, str):
            return value
        raise


def _unreadable(model: type[BaseModel], exc: ValidationError) -> BadResponse:
    problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(the whole answer)'}: {e['msg']}"
                         for e in exc.errors(include_url=False)[:5])
    more = f" (and {exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    return BadResponse(f"The API's answer is not a {model.__name__} this client can read: {problems}{more}. "
                       "If the server is newer than this mpjobs, upgrading mpjobs may read it.")
