"""Issue 32, item 2 from outside: `layer_policies` in a job or comparison spec, against the real API and Redis.
A name the model does not have is a 422 that names it and lists the model's layers, and nothing is written."""

from __future__ import annotations

from typing import Any

import httpx
import keras
import pytest

import mpjobs
from mpjobs.contract.spec import PrecisionPolicy
from scripts.stack import Stack


def nested_json() -> str:
    """A Functional model with a Sequential block and a TimeDistributed wrapper inside: names at every depth."""
    inputs = keras.Input((4, 8))
    x = keras.layers.TimeDistributed(keras.layers.Dense(8, name="per_step"), name="steps")(inputs)
    x = keras.layers.Flatten(name="flat")(x)
    block = keras.Sequential([keras.layers.Dense(16, activation="relu", name="inner"),
                              keras.layers.Rescaling(0.5, name="half")], name="block")
    outputs = keras.layers.Dense(3, activation="softmax", name="out")(block(x))
    return keras.Model(inputs, outputs, name="outer").to_json()


NESTED_LAYERS = ["steps", "flat", "block", "out", "per_step", "inner", "half"]


def refused(stack: Stack, client: httpx.Client, path: str, body: dict[str, Any]) -> str:
    before = stack.writes()
    response = client.post(path, json=body)
    assert response.status_code == 422, response.text
    assert stack.writes() == before  # nothing written
    (error,) = response.json()["detail"]
    return str(error["msg"])


def test_an_unknown_layer_is_422_naming_it_and_listing_the_built_in_models_layers(
        stack: Stack, client: httpx.Client) -> None:
    message = refused(stack, client, "/jobs", {"model": {"name": "mlp"}, "precision_policy": "mixed_float16",
                                               "layer_policies": {"mid": "float32"}})
    assert "layer_policies names layer 'mid'" in message
    assert message.endswith("Its layers: dense, dense_1, probs."), message


def test_a_keras_json_model_lists_its_nested_and_wrapped_layers(stack: Stack, client: httpx.Client) -> None:
    model = {"keras_json": nested_json(), "loss": "sparse_categorical_crossentropy"}
    message = refused(stack, client, "/jobs", {"model": model,
                                               "layer_policies": {"inner": "float32", "Inner": "float32"}})
    assert "layer_policies names layer 'Inner'" in message
    assert sorted(message.split("Its layers: ")[1].rstrip(".").split(", ")) == sorted(NESTED_LAYERS)
    # Each of those names is accepted, at any depth.
    created = client.post("/jobs", json={"model": model, "precision_policy": "mixed_float16", "training": {"steps": 1},
                                         "layer_policies": dict.fromkeys(["inner", "per_step", "half"], "float32")})
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["layer_policies"] == {"inner": "float32", "per_step": "float32", "half": "float32"}


@pytest.mark.parametrize("policy", ["float8", 3, "Float32"])
def test_a_policy_outside_the_five_is_422_listing_them(stack: Stack, client: httpx.Client, policy: Any) -> None:
    message = refused(stack, client, "/jobs", {"model": {"name": "mlp"}, "layer_policies": {"dense": policy}})
    assert all(p in message for p in ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16")), message


def test_a_comparison_variant_is_checked_and_its_pins_reach_its_job(stack: Stack, client: httpx.Client) -> None:
    spec = {"model": {"name": "mlp", "input_dim": 8, "hidden_units": 8}, "training": {"steps": 1}}
    message = refused(stack, client, "/comparisons", {"spec": spec, "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "mixed_float16", "layer_policies": {"head": "float32"}}]})
    assert "variants[1].layer_policies names layer 'head'" in message and "dense, dense_1, probs" in message

    created = client.post("/comparisons", json={"spec": {**spec, "layer_policies": {"dense": "float32"}}, "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "mixed_bfloat16"},
        {"precision_policy": "mixed_float16", "loss_scale": "dynamic", "layer_policies": {"dense_1": "float32"}}]})
    assert created.status_code == 201, created.text
    variants = created.json()["variants"]
    assert [v["label"] for v in variants] == ["float32", "mixed_bfloat16",
                                              "mixed_float16 + dynamic + float32: dense_1"]
    pins = [client.get(f"/jobs/{v['job_id']}").json()["spec"]["layer_policies"] for v in variants]
    # float32 is the all-float32 baseline; a variant without its own pins takes the spec's.
    assert pins == [{}, {"dense": "float32"}, {"dense_1": "float32"}]
    client.delete(f"/comparisons/{created.json()['id']}")


def test_the_client_sends_layer_policies_and_names_the_refused_layer(stack: Stack) -> None:
    with mpjobs.Client(stack.base_url, api_key="") as c:
        job = c.submit({"model": {"name": "mlp", "input_dim": 8, "hidden_units": 8}}, policy="mixed_float16",
                       steps=1, layer_policies={"dense_1": "float32"})
        assert job.resource.spec.layer_policies == {"dense_1": PrecisionPolicy.FLOAT32}
        with pytest.raises(mpjobs.InvalidSpec, match="layer_policies names layer 'hidden'"):
            c.submit({"model": {"name": "mlp"}}, layer_policies={"hidden": "float32"})
