"""Hostile inputs the API must answer without a 500: bodies, path ids and integers no schema can express.

Shared by tests/processes/test_hostile_inputs.py, which sends each one and checks the exact answer, and
tests/processes/fuzz_hooks.py, which mixes them into schemathesis's run.
"""

from __future__ import annotations

import json

MLP = '{"name": "mlp"}'


def _sequential_of_dense(layers: int) -> str:
    dense = {"module": "keras.layers", "class_name": "Dense", "config": {"units": 4}}
    return json.dumps({"module": "keras", "class_name": "Sequential",
                       "config": {"name": "s", "layers": [dense] * layers}})


BODIES: dict[str, tuple[bytes, tuple[str | int, ...]]] = {
    # name: (a job spec as raw JSON bytes, the loc of the one error it gets)
    "nan": (b'{"model": %b, "training": {"learning_rate": NaN}}', ("training", "learning_rate")),
    "infinity": (b'{"model": %b, "training": {"learning_rate": Infinity}}', ("training", "learning_rate")),
    "minus-infinity": (b'{"model": %b, "dataset": {"samples": -Infinity}}', ("dataset", "synthetic", "samples")),
    "1e400": (b'{"model": %b, "training": {"learning_rate": 1e400}}', ("training", "learning_rate")),
    "nan-for-a-string": (b'{"model": %b, "name": NaN}', ("name",)),
    "surrogate-in-an-enum": (b'{"model": %b, "precision_policy": "\\ud800"}', ("precision_policy",)),
    "surrogate-in-a-name": (b'{"model": %b, "name": "a\\ud800"}', ("name",)),
    "surrogate-as-raw-bytes": (b'{"model": %b, "name": "\xed\xa0\x80"}', ("name",)),
    # pydantic cannot read a key it cannot encode: its error is about the whole object.
    "surrogate-as-a-key": (b'{"model": %b, "\\udfff": 1}', ()),
    "surrogate-in-keras-json": (
        b'{"model": {"keras_json": "{\\"class_name\\": \\"Sequential\\", \\"config\\": {\\"name\\": \\"\\ud800\\", '
        b'\\"layers\\": []}}", "loss": "mse"}}', ("model", "keras_json", "keras_json")),
    "steps-as-a-string": (b'{"model": %b, "training": {"steps": "10"}}', ("training", "steps")),
    "steps-as-true": (b'{"model": %b, "training": {"steps": true}}', ("training", "steps")),
    "learning-rate-as-false": (b'{"model": %b, "training": {"learning_rate": false}}', ("training", "learning_rate")),
    "module-kerasevil": (
        b'{"model": {"keras_json": "{\\"class_name\\": \\"Sequential\\", \\"config\\": {\\"layers\\": [{\\"module\\": '
        b'\\"kerasevil.layers\\", \\"class_name\\": \\"Dense\\", \\"config\\": {}}]}}", "loss": "mse"}}',
        ("model", "keras_json", "keras_json")),
    "class-name-as-an-object": (  # a dict does not hash: looked up in a set, it raised TypeError
        b'{"model": {"keras_json": "{\\"class_name\\": {}, \\"config\\": {\\"layers\\": []}}", "loss": "mse"}}',
        ("model", "keras_json", "keras_json")),
    "sequential-of-1500-dense": (
        b'{"model": {"keras_json": %b, "loss": "mse"}}' % json.dumps(_sequential_of_dense(1500)).encode(),
        ("model", "keras_json", "keras_json")),
}
"""`%b` stands for `MLP`, the model; as a comparison, each body is the `spec` of `{"spec": ...}`."""


def job_body(name: str) -> bytes:
    body = BODIES[name][0]
    return body % MLP.encode() if b"%b" in body else body


def comparison_body(name: str) -> bytes:
    return b'{"spec": %b}' % job_body(name)


WELL_FORMED_ID = "0123456789abcdef" * 2
"""An id of no job, in the form of one: the fuzz run builds its malformed ids on it."""


def malformed_ids(real: str) -> list[str]:
    """Ids that are not a uuid4 hex, several of them Redis keys of `real`'s other records."""
    return [f"{real}:events", f"{real}:metrics", f"{real}:layers", f"{real}:lease", real.upper(), real + "0",
            real[:-1], "x" * 300, "²" * 32, "*", "%"]


MAX_STEP = 10_000_000
"""The most steps a job has (TrainingSpec.steps): a step parameter (`after`, Last-Event-ID) goes up to it."""
MAX_INT64 = 2**63 - 1
"""Redis integers (a creation sequence: `cursor`) and page sizes (`limit`) go up to it."""

INTEGERS: list[tuple[str, str, str]] = [
    # (route, parameter, a value out of its range or not an integer)
    *[("/jobs/{id}/metrics", "after", value) for value in
      (str(10**30), str(MAX_STEP + 1), "9" * 5000, "²", "١", "-1", "1e3", "")],
    ("/jobs/{id}/metrics", "limit", str(MAX_INT64 + 1)),
    ("/jobs/{id}/metrics", "limit", "0"),
    ("/jobs/{id}/metrics", "limit", "9" * 5000),
    ("/jobs/{id}/metrics", "max_points", str(10**30)),
    ("/jobs/{id}/layers", "after", str(10**30)),
    ("/jobs/{id}/layers", "after", "²"),
    ("/jobs/{id}/layers", "limit", str(10**30)),
    ("/jobs/{id}/metrics/stream", "after", str(10**30)),
    ("/jobs/{id}/metrics/stream", "after", str(MAX_STEP + 1)),
    ("/jobs", "cursor", str(10**30)),
    ("/jobs", "cursor", str(MAX_INT64 + 1)),
    ("/jobs", "cursor", "9" * 5000),
    ("/jobs", "limit", str(10**30)),
    ("/comparisons", "cursor", str(10**30)),
    ("/comparisons", "limit", "²"),
]
LAST_EVENT_IDS: list[bytes] = [str(10**25).encode(), str(MAX_STEP + 1).encode(), b"9" * 5000, b"\xb2",
                               "²".encode(), b"-1", b"abc", b"4-0"]
"""Last-Event-ID values that are not a step: a header is Latin-1, so b"\\xb2" arrives as '²', which
str.isdigit() calls a digit and int() refuses."""
