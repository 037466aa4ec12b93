"""`validation=` on submit and compare: a split share, uploaded held-out arrays, and a compiled model's metrics."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import httpx
import numpy as np
import pytest

from mpjobs import Client, InvalidSpec, Unavailable
from tests.mpjobs.test_upload import Server, _bytes

X = np.arange(24, dtype=np.float32).reshape(6, 4)
Y = np.array([0, 1, 2, 0, 1, 2])
X_VAL, Y_VAL = X[:3] + 0.5, Y[:3]
MLP = {"model": {"name": "mlp", "input_dim": 4, "classes": 3}}


def submitted(server: Server, spec: Any, **keywords: Any) -> dict[str, Any]:
    with Client("http://api", transport=httpx.MockTransport(server)) as client:
        with pytest.raises(InvalidSpec) as sent:  # the mock echoes the body it was sent
            client.submit(spec, **keywords)
    body: dict[str, Any] = json.loads(sent.value.errors[0][1])
    return body


def test_held_out_arrays_are_uploaded_hash_first_and_named_in_the_spec() -> None:
    train, held = hashlib.sha256(_bytes(X, Y)).hexdigest(), hashlib.sha256(_bytes(X_VAL, Y_VAL)).hexdigest()
    server = Server({train})
    body = submitted(server, MLP, data=(X, Y), validation=(X_VAL, Y_VAL))
    assert body["dataset"] == {"kind": "uploaded", "id": train}
    assert body["validation"] == {"dataset": {"kind": "uploaded", "id": held}}
    assert server.requests == [f"GET /datasets/{train}", f"GET /datasets/{held}", "POST /datasets", "POST /jobs"]
    assert server.bodies == [_bytes(X_VAL, Y_VAL)]


def test_a_share_is_a_split_with_seed_0_and_a_dict_is_sent_as_given() -> None:
    assert submitted(Server(set()), MLP, validation=0.2)["validation"] == {"split": 0.2, "seed": 0}
    given = {"split": 0.3, "seed": 4, "metrics": ["accuracy"], "eval_every": 0}
    assert submitted(Server(set()), MLP, validation=given)["validation"] == given
    with pytest.raises(TypeError, match="validation= to be a share"):
        submitted(Server(set()), MLP, validation="0.2")


def test_a_compiled_models_metrics_go_to_validation_only_when_it_is_given() -> None:
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(loss="sparse_categorical_crossentropy",
                  metrics=["accuracy", keras.metrics.SparseCategoricalAccuracy(), keras.metrics.Precision()])
    body = submitted(Server(set()), model, validation=0.25)
    assert body["validation"] == {"split": 0.25, "seed": 0, "metrics": ["accuracy", "sparse_categorical_accuracy"]}
    assert body["model"]["loss"] == "sparse_categorical_crossentropy"
    assert "validation" not in submitted(Server(set()), model)  # no held-out data: nothing to measure them on
    assert submitted(Server(set()), model, validation={"split": 0.1, "metrics": []})["validation"]["metrics"] == []


def test_compare_sets_validation_and_the_seed_control() -> None:
    held = hashlib.sha256(_bytes(X_VAL, Y_VAL)).hexdigest()
    sent: list[dict[str, Any]] = []

    def api(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/comparisons":
            sent.append(json.loads(request.read()))
            return httpx.Response(503, json={"detail": "stop here"})
        return Server({held})(request)

    with Client("http://api", transport=httpx.MockTransport(api)) as client, pytest.raises(Unavailable, match="stop"):
        client.compare(MLP, ["float32", "mixed_bfloat16"], steps=3, validation=(X_VAL, Y_VAL), float32_seeds=2)
    assert sent[0]["spec"]["validation"] == {"dataset": {"kind": "uploaded", "id": held}}
    assert sent[0]["float32_seeds"] == 2
