"""A Functional model config's inputs and outputs, read from its JSON without Keras (the API never loads it)."""

from __future__ import annotations

from typing import Any


def endpoint_names(spec: Any) -> list[str] | None:
    """The layer names of a Functional config's `input_layers` or `output_layers`, as `model.to_json()` writes them:
    one node (`["x", 0, 0]`), a list of nodes, or a dict of them; None for a shape this does not know.

    >>> endpoint_names(["x", 0, 0]), endpoint_names([["a", 0, 0], ["b", 0, 0]]), endpoint_names({"k": ["a", 0, 0]})
    (['x'], ['a', 'b'], ['a'])
    """
    if isinstance(spec, list) and spec and isinstance(spec[0], str):
        return [spec[0]]
    nodes = list(spec.values()) if isinstance(spec, dict) else spec if isinstance(spec, list) else None
    if nodes is None or not all(isinstance(n, list) and n and isinstance(n[0], str) for n in nodes):
        return None
    return [n[0] for n in nodes]


def check_one_input_and_output(config: dict[str, Any]) -> None:
    """Refuse a top-level Functional of several inputs or outputs, in the worker's words
    (worker/engine/models.py), so that
    such a job is refused at submission instead of failing once a worker takes it."""
    inner = config.get("config")
    if config.get("class_name") != "Functional" or not isinstance(inner, dict):
        return
    inputs, outputs = endpoint_names(inner.get("input_layers")), endpoint_names(inner.get("output_layers"))
    if inputs is None or outputs is None or (len(inputs) == 1 and len(outputs) == 1):
        return  # a shape this does not know is left to Keras and the worker's own check
    raise ValueError(not_one_input_and_output("model.keras_json", inputs, outputs))


def not_one_input_and_output(source: str, inputs: list[str], outputs: list[str]) -> str:
    """Why a model of several inputs or outputs is refused, naming them: the API's words and the worker's."""
    def counted(kind: str, names: list[str]) -> str:
        return f"{len(names)} {kind}{'' if len(names) == 1 else 's'} ({', '.join(map(repr, names))})"

    return (f"{source} must have exactly one input and one output: mpjobs feeds each step one array x (generated, "
            f"or the .npz's x) and compares the output with one y. Received: {counted('input', inputs)} and "
            f"{counted('output', outputs)}.")
