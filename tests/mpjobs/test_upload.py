"""The client's uploads: fixed bytes for the same arrays, the hash asked first, nothing sent when it is there."""

from __future__ import annotations

import hashlib
import io
import json
import time
from typing import Any

import httpx
import numpy as np
import pytest

from mpjobs import Client, InvalidSpec, Unavailable
from mpjobs._datasets import write_npz

X = np.arange(24, dtype=np.float32).reshape(6, 4)
Y = np.array([0, 1, 2, 0, 1, 2])


def _bytes(x: Any, y: Any) -> bytes:
    buffer = io.BytesIO()
    write_npz(x, y, buffer)
    return buffer.getvalue()


def _record(sha: str, size: int) -> dict[str, Any]:
    return {"id": sha, "sha256": sha, "bytes": size, "created_at": "2026-01-01T00:00:00Z", "jobs": [],
            "x": {"shape": [6, 4], "dtype": "<f4"}, "y": {"shape": [6], "dtype": "<i8"}}


class Server:
    """A mock API holding some datasets, recording every request."""

    def __init__(self, held: set[str]) -> None:
        self.held, self.requests, self.bodies = held, [], []  # type: tuple[set[str], list[str], list[bytes]]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        if request.method == "GET" and request.url.path.startswith("/datasets/"):
            sha = request.url.path.rsplit("/", 1)[1]
            if sha in self.held:
                return httpx.Response(200, json=_record(sha, 1))
            return httpx.Response(404, json={"detail": f"No dataset with id {sha!r}."})
        if request.method == "POST" and request.url.path == "/datasets":
            body = request.read()
            self.bodies.append(body)
            sha = hashlib.sha256(body).hexdigest()
            self.held.add(sha)
            return httpx.Response(201, json=_record(sha, len(body)))
        if request.method == "POST" and request.url.path == "/jobs":
            return httpx.Response(422, json={"detail": [{"loc": ["body", "echo"], "msg": request.read().decode(),
                                                         "type": "x"}]})
        return httpx.Response(500)


def test_the_same_arrays_make_the_same_bytes_whenever_they_are_written() -> None:
    first = _bytes(X, Y)
    time.sleep(2.1)  # a zip's times have 2 s steps: numpy.savez's bytes would differ now
    assert _bytes(X.copy(), Y.copy()) == first
    with np.load(io.BytesIO(first), allow_pickle=False) as archive:
        np.testing.assert_array_equal(archive["x"], X)
        np.testing.assert_array_equal(archive["y"], Y)
    assert _bytes(X, Y + 1) != first


def test_upload_asks_for_the_hash_first_and_sends_the_bytes_only_when_the_server_lacks_them() -> None:
    expected = hashlib.sha256(_bytes(X, Y)).hexdigest()
    server = Server(set())
    with Client("http://api", transport=httpx.MockTransport(server)) as client:
        record = client.upload(X, Y)
        assert record.id == expected
        assert server.requests == [f"GET /datasets/{expected}", "POST /datasets"]
        assert server.bodies == [_bytes(X, Y)]
        again = client.upload(X, Y)
    assert again.id == expected
    assert server.requests[2:] == [f"GET /datasets/{expected}"]  # held: nothing sent
    assert len(server.bodies) == 1


def test_submit_with_data_names_the_uploaded_dataset_in_the_spec() -> None:
    expected = hashlib.sha256(_bytes(X, Y)).hexdigest()
    server = Server({expected})
    with Client("http://api", transport=httpx.MockTransport(server)) as client:
        with pytest.raises(InvalidSpec) as sent:  # the mock echoes the body it was sent
            client.submit({"model": {"name": "mlp", "input_dim": 4, "classes": 3}}, data=(X, Y))
    body = json.loads(sent.value.errors[0][1])
    assert body["dataset"] == {"kind": "uploaded", "id": expected}
    assert server.requests == [f"GET /datasets/{expected}", "POST /jobs"]


def test_object_arrays_are_refused_before_anything_is_sent() -> None:
    server = Server(set())
    with Client("http://api", transport=httpx.MockTransport(server)) as client:
        with pytest.raises(ValueError, match="Python objects"):
            client.upload(np.array([{}, None], dtype=object), Y[:2])
    assert server.requests == []


def test_compare_with_data_sets_the_dataset_of_the_spec_every_variant_runs() -> None:
    expected = hashlib.sha256(_bytes(X, Y)).hexdigest()
    sent: list[dict[str, Any]] = []

    def api(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/comparisons":
            sent.append(json.loads(request.read()))
            return httpx.Response(503, json={"detail": "stop here"})
        return Server({expected})(request)

    with Client("http://api", transport=httpx.MockTransport(api)) as client, pytest.raises(Unavailable, match="stop"):
        client.compare({"model": {"name": "mlp", "input_dim": 4, "classes": 3}}, ["float32", "mixed_bfloat16"],
                       steps=3, data=(X, Y))
    assert sent[0]["spec"]["dataset"] == {"kind": "uploaded", "id": expected}
    assert sent[0]["spec"]["training"] == {"steps": 3}
