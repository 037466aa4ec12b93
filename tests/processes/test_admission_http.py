"""Deployment limits at the API: a spec over MAX_MODEL_BYTES or MAX_JOB_SECONDS is a 422 that writes nothing.

The stack runs with the defaults: MAX_MODEL_BYTES 16 GiB, MAX_JOB_SECONDS 86400. Parameter counts
below are worked out by hand from the layers in worker/engine/models.py.
"""

from __future__ import annotations

from typing import Any

import httpx

from scripts.stack import Stack

GIB = 2**30
LIMIT_GIB = 16
HUGE_MLP = {"name": "mlp", "input_dim": 65_536, "hidden_units": 16_384, "classes": 10_000}
HUGE_MLP_PARAMETERS = 65_536 * 16_384 + 16_384 + 16_384 * 10_000 + 10_000  # 1,237,608,208


def refusal(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert len(detail) == 1 and detail[0]["type"] == "limit_exceeded", detail
    return dict(detail[0])


def test_a_model_past_max_model_bytes_is_422_naming_its_size_and_writes_nothing(
        stack: Stack, client: httpx.Client) -> None:
    before = stack.writes()
    headers = {"Idempotency-Key": "too-big-then-fixed"}
    error = refusal(client.post("/jobs", json={"model": HUGE_MLP}, headers=headers))
    assert error["loc"] == ["body", "model"]
    # float32 with Adam: weights, gradients and two slots of 4 bytes each, 16 bytes per parameter.
    weights_gib = HUGE_MLP_PARAMETERS * 4 / GIB
    assert f"{HUGE_MLP_PARAMETERS:,} parameters" in error["msg"]
    assert f"weights {weights_gib:.1f} GiB" in error["msg"]
    assert f"optimizer slots {2 * weights_gib:.1f} GiB" in error["msg"]
    assert f"at most {LIMIT_GIB:.1f} GiB" in error["msg"] and f"MAX_MODEL_BYTES={LIMIT_GIB * GIB}" in error["msg"]
    assert stack.writes() == before
    # The refused request used no Idempotency-Key: the same key now creates a job.
    fixed = client.post("/jobs", json={"model": {"name": "mlp"}, "training": {"steps": 1}}, headers=headers)
    assert fixed.status_code == 201, fixed.text


def test_the_largest_transformer_the_schema_allows_is_refused(stack: Stack, client: httpx.Client) -> None:
    model = {"name": "transformer", "seq_len": 8192, "vocab_size": 262_144, "d_model": 8192, "heads": 128,
             "layers": 64, "ffn_dim": 65_536, "classes": 10_000}
    d, t, ffn = 8192, 8192, 65_536
    # embeddings; per layer attention, LayerNorm, Dense, Dense, LayerNorm; the head
    block = (4 * d * d + 4 * d) + 2 * d + (d * ffn + ffn) + (ffn * d + d) + 2 * d
    parameters = 262_144 * d + t * d + 64 * block + d * 10_000 + 10_000
    before = stack.writes()
    error = refusal(client.post("/jobs", json={"model": model, "training": {"batch_size": 1}}))
    assert f"{parameters:,} parameters" in error["msg"]  # 88,204,781,328
    assert f"weights {parameters * 4 / GIB:.1f} GiB" in error["msg"]
    assert stack.writes() == before


def test_a_batch_whose_activations_are_past_the_limit_names_batch_size(stack: Stack, client: httpx.Client) -> None:
    """65,541 activations per sample (input, Dense, Dense, softmax) x 65,536 rows x 4 bytes x 2: 32 GiB."""
    body = {"model": {"name": "mlp", "input_dim": 65_536, "hidden_units": 1, "classes": 2},
            "training": {"batch_size": 65_536}}
    before = stack.writes()
    error = refusal(client.post("/jobs", json=body))
    assert error["loc"] == ["body", "training", "batch_size"]
    assert f"activations {65_541 * 65_536 * 4 * 2 / GIB:.1f} GiB" in error["msg"]
    assert stack.writes() == before


def test_max_seconds_past_max_job_seconds_is_422_naming_the_limit(stack: Stack, client: httpx.Client) -> None:
    before = stack.writes()
    error = refusal(client.post("/jobs", json={"model": {"name": "mlp"}, "training": {"max_seconds": 86_401}}))
    assert error["loc"] == ["body", "training", "max_seconds"]
    assert "at most 86400" in error["msg"] and "MAX_JOB_SECONDS" in error["msg"] and "max_seconds=86401" in error["msg"]
    error = refusal(client.post("/comparisons", json={"spec": {"model": {"name": "mlp"},
                                                               "training": {"max_seconds": 30 * 24 * 3600}}}))
    assert error["loc"] == ["body", "spec", "training", "max_seconds"]
    assert stack.writes() == before
    at_limit = client.post("/jobs", json={"model": {"name": "mlp"}, "training": {"steps": 1, "max_seconds": 86_400}})
    assert at_limit.status_code == 201, at_limit.text


def test_a_comparison_is_refused_whole_when_one_variant_is_past_the_limit(stack: Stack, client: httpx.Client) -> None:
    """655,390,002 parameters: 9.8 GiB under float32 with Adam, within the limit; under mixed_float16 the
    float32 check's twin adds 16 bytes per parameter (weights, its gradient, both gradients on the host)."""
    model = {"name": "mlp", "input_dim": 65_536, "hidden_units": 10_000, "classes": 2}
    before = stack.writes()
    error = refusal(client.post("/comparisons", json={"spec": {"model": model}, "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "mixed_float16"}]}))
    assert error["loc"] == ["body", "spec", "model"]
    assert "under variant 'mixed_float16 + dynamic'" in error["msg"] and "655,390,002 parameters" in error["msg"]
    assert stack.writes() == before
