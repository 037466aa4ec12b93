"""Jobs that would hold a worker: a model that takes minutes to load is canceled, or times out, while it loads.

Issue 17's report: a keras_json Sequential of many `Dense(4)` layers (Keras loads a Sequential
in time that grows with the square of its layers) held a worker for minutes; a DELETE answered
202, yet the job ran on. Cancel and the time limit were checked only between steps.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mpjobs.contract.model_specs import MAX_SEQUENTIAL_LAYERS
from scripts.stack import Stack, private_stack, wait_until

LAYERS = MAX_SEQUENTIAL_LAYERS - 1
"""Dense(4) layers after the InputLayer: the most a Sequential may have."""
NESTED = 4
"""Sequentials of LAYERS in one: Keras takes about 50 s to load it here (one alone takes 10-17 s), so even a
processor several times faster is still loading when the cancel or the time limit comes; the phase is seen
within a second."""
SMALL = {"model": {"name": "mlp", "input_dim": 16, "hidden_units": 8}, "training": {"steps": 5}}
"""The next job, which the freed worker trains within seconds (and within TIME_LIMIT_S on a busy machine)."""
TIME_LIMIT_S = 6
SPEC_LIMIT_S = 2


def slow_to_load() -> dict[str, Any]:
    """A Sequential of NESTED Sequentials of LAYERS Dense(4), as model.to_json() writes it (built here, without
    Keras)."""
    def input_layer(name: str) -> dict[str, Any]:
        return {"module": "keras.layers", "class_name": "InputLayer", "registered_name": None,
                "config": {"batch_shape": [None, 4], "dtype": "float32", "name": name}}

    def sequential(name: str, layers: list[dict[str, Any]]) -> dict[str, Any]:
        return {"module": "keras", "class_name": "Sequential", "registered_name": None,
                "config": {"name": name, "trainable": True, "dtype": "float32", "layers": layers}}

    def deep(n: int) -> dict[str, Any]:
        dense = [{"module": "keras.layers", "class_name": "Dense", "registered_name": None,
                  "config": {"name": f"dense_{n}_{i}", "trainable": True, "dtype": "float32", "units": 4,
                             "activation": "linear", "use_bias": True}} for i in range(LAYERS)]
        return sequential(f"deep_{n}", [input_layer(f"input_{n}"), *dense])

    config = sequential("deeper", [input_layer("input"), *[deep(n) for n in range(NESTED)]])
    return {"model": {"keras_json": json.dumps(config), "loss": "mse"}, "training": {"steps": 5}}


def building(client: httpx.Client, job_id: str, or_ended: bool = False) -> dict[str, Any]:
    """Waits until the job's attempt is loading its model, as its `phase` says (`or_ended`: or has ended, as a
    job with a time limit of seconds may have before a stalled test looks)."""
    def check() -> dict[str, Any] | None:
        job = client.get(f"/jobs/{job_id}").json()
        if or_ended and job["state"] in {"failed", "canceled", "succeeded"}:
            return job
        assert job["state"] in {"queued", "running"}, job
        return job if job["phase"] == "building the model" else None
    return wait_until(check, 60, f"job {job_id} to be building its model", interval=0.05)  # type: ignore[no-any-return]


def test_a_cancel_while_the_model_loads_ends_the_job_within_five_seconds(stack: Stack, client: httpx.Client) -> None:
    response = client.post("/jobs", json=slow_to_load())
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    building(client, job_id)
    asked = time.monotonic()
    assert client.delete(f"/jobs/{job_id}").status_code == 202
    done = stack.wait_for_state(client, job_id, {"canceled", "failed", "succeeded"}, timeout=30)
    assert time.monotonic() - asked <= 5.0
    assert done["state"] == "canceled", done
    assert done["error"] == {"reason": "canceled", "message": "Canceled while building the model."}
    assert done["phase"] is None and done["progress"]["step"] == 0
    # The worker is free and whole: the next job trains.
    next_id = client.post("/jobs", json=SMALL).json()["id"]
    assert stack.wait_for_state(client, next_id, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A deployment whose attempts may run TIME_LIMIT_S seconds."""
    with private_stack(tmp_path_factory.mktemp("limited"), MAX_JOB_SECONDS=str(TIME_LIMIT_S)) as s:
        yield s


def test_the_time_limit_ends_a_job_that_is_still_loading(limited: Stack) -> None:
    spec = slow_to_load()
    spec["training"]["max_seconds"] = SPEC_LIMIT_S  # under the deployment's TIME_LIMIT_S: the spec's own holds
    with limited.client() as client:
        job_id = client.post("/jobs", json=spec).json()["id"]
        started = time.monotonic()
        building(client, job_id, or_ended=True)  # the message below says where the limit ran out
        done = limited.wait_for_state(client, job_id, {"canceled", "failed", "succeeded"}, timeout=30)
        assert time.monotonic() - started <= SPEC_LIMIT_S + 3
        assert done["state"] == "failed" and done["error"]["reason"] == "timeout", done
        assert done["error"]["message"] == (f"The time limit ran out while building the model: "
                                            f"training.max_seconds={SPEC_LIMIT_S} s per attempt.")
        next_id = client.post("/jobs", json=SMALL).json()["id"]
        assert limited.wait_for_state(client, next_id, {"succeeded", "failed"}, timeout=60)["state"] == "succeeded"


def test_a_spec_without_max_seconds_gets_the_deployment_limit(limited: Stack, tmp_path: Path) -> None:
    with limited.client() as client:
        spec = {"model": {"name": "mlp"}, "training": {"steps": 1_000_000, "checkpoint_every": 10}}
        job_id = client.post("/jobs", json=spec).json()["id"]
        done = limited.wait_for_state(client, job_id, {"canceled", "failed", "succeeded"}, timeout=60)
        assert done["state"] == "failed" and done["error"]["reason"] == "timeout", done
        steps = done["progress"]["step"]
        assert 0 < steps < 1_000_000
        assert done["error"]["message"].startswith(
            f"The time limit ran out at step {steps} of 1000000: MAX_JOB_SECONDS={TIME_LIMIT_S} s per attempt.")
        assert "checkpoint of that step is kept" in done["error"]["message"]
