"""Jobs on uploaded datasets: checked against the model at submission, kept while in use, trained end to end."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from mpjobs import Client, InvalidSpec
from scripts.stack import Stack
from tests.processes.test_datasets_http import OCTET, npz_bytes, refusal


def upload(client: httpx.Client, x: np.ndarray, y: np.ndarray) -> str:
    answer = client.post("/datasets", content=npz_bytes(x=x, y=y), headers=OCTET)
    assert answer.status_code in (200, 201), answer.text
    return str(answer.json()["id"])


def mlp_job(dataset_id: str, steps: int = 2, **model: Any) -> dict[str, Any]:
    return {"model": {"name": "mlp", "input_dim": 6, "hidden_units": 8, "classes": 4, **model},
            "dataset": {"kind": "uploaded", "id": dataset_id}, "training": {"steps": steps, "batch_size": 4}}


def dense_json(inputs: int, outputs: int) -> str:
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(outputs, activation="softmax")])
    return str(model.to_json())


def test_shapes_and_labels_that_do_not_fit_the_model_are_422_and_write_nothing(
        stack: Stack, client: httpx.Client) -> None:
    rng = np.random.default_rng(0)
    dataset_id = upload(client, rng.standard_normal((12, 6)).astype(np.float32), np.arange(12) % 9)
    before = stack.writes()
    message = refusal(client.post("/jobs", json=mlp_job(dataset_id, input_dim=5, classes=10)), 422)
    assert "dataset', 'id'" in message and "(5,)" in message and "(12, 6)" in message
    message = refusal(client.post("/jobs", json=mlp_job(dataset_id, classes=4)), 422)
    assert "from 0 to 3" in message and "values from 0 to 8" in message
    keras_model = {"keras_json": dense_json(6, 3), "loss": "categorical_crossentropy"}
    job = {**mlp_job(dataset_id), "model": keras_model}
    message = refusal(client.post("/jobs", json=job), 422)
    assert "width 3" in message and "(12,)" in message
    message = refusal(client.post("/comparisons", json={"spec": mlp_job(dataset_id, input_dim=7)}), 422)
    assert "'spec', 'dataset', 'id'" in message
    tokens = upload(client, (np.arange(72) % 50).reshape(12, 6), np.arange(12) % 4)
    transformer = {**mlp_job(tokens), "model": {"name": "transformer", "seq_len": 6, "vocab_size": 20,
                                                "d_model": 8, "heads": 1, "layers": 1, "ffn_dim": 8, "classes": 4}}
    assert "from 0 to 19 in x" in refusal(client.post("/jobs", json=transformer), 422)
    missing = mlp_job("0" * 64)
    assert "names none of yours" in refusal(client.post("/jobs", json=missing), 422)
    npz = {**mlp_job(dataset_id), "dataset": {"kind": "npz", "path": "nowhere.npz"}}
    message = refusal(client.post("/jobs", json=npz), 422)
    assert "'dataset', 'path'" in message and "nowhere.npz" in message
    assert stack.writes() == before


def test_a_dataset_in_use_by_a_queued_or_running_job_is_not_deleted(stack: Stack, client: httpx.Client) -> None:
    rng = np.random.default_rng(1)
    dataset_id = upload(client, rng.standard_normal((16, 6)).astype(np.float32), np.arange(16) % 4)
    job = client.post("/jobs", json=mlp_job(dataset_id, steps=1_000_000)).json()
    answer = client.delete(f"/datasets/{dataset_id}")
    assert answer.status_code == 409, answer.text
    assert job["id"] in answer.json()["detail"] and "Nothing was deleted" in answer.json()["detail"]
    assert client.get(f"/datasets/{dataset_id}").json()["jobs"] == [job["id"]]
    assert (stack.artifacts / "datasets" / f"{dataset_id}.npz").exists()
    client.delete(f"/jobs/{job['id']}")
    stack.wait_for_state(client, job["id"], {"canceled"})
    assert client.delete(f"/datasets/{dataset_id}").status_code == 204
    assert not (stack.artifacts / "datasets" / f"{dataset_id}.npz").exists()


def test_scikit_learns_digits_uploaded_by_the_client_train_a_keras_json_mlp(stack: Stack) -> None:
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = (digits.images.reshape(len(digits.images), 64) / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    spec = {"model": {"keras_json": dense_json(64, 10), "loss": "sparse_categorical_crossentropy"},
            "training": {"steps": 5, "batch_size": 32}}
    with Client(stack.base_url) as client:
        job = client.submit(spec, data=(x, y))
        record = client.dataset(job.resource.spec.dataset.id)  # type: ignore[union-attr]
        assert record.x.shape == [1797, 64] and record.y.shape == [1797]
        assert (record.y.low, record.y.high) == (0, 9)
        assert record.id in {d.id for d in client.datasets()}
        job.wait(timeout=300, progress=False)
        assert job.state.value == "succeeded", job.resource.error
        assert job.resource.progress.step == 5
        five = {"keras_json": dense_json(64, 5), "loss": "sparse_categorical_crossentropy"}
        with pytest.raises(InvalidSpec) as refused:  # the same bytes: found by their hash, not sent again
            client.submit({**spec, "model": five}, data=(x, y))
        assert refused.value.errors == [("dataset.id", refused.value.errors[0][1])]
        assert "from 0 to 4" in refused.value.errors[0][1] and "values from 0 to 9" in refused.value.errors[0][1]


def test_the_cli_uploads_a_file_once_prints_its_id_and_lists_it(stack: Stack, tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    path.write_bytes(npz_bytes(x=np.full((5, 3), 0.5), y=np.arange(5)))
    expected = hashlib.sha256(path.read_bytes()).hexdigest()

    def mpjobs(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "mpjobs.cli", "--url", stack.base_url, *args],
                              capture_output=True, text=True, timeout=60)

    first, again = mpjobs("upload", str(path)), mpjobs("upload", str(path))
    assert first.returncode == again.returncode == 0, first.stderr
    assert first.stdout.strip() == again.stdout.strip() == expected
    listed = mpjobs("datasets")
    row = next(line for line in listed.stdout.splitlines() if line.startswith(expected))
    assert "5x3" in row and "<f8" in row and f"{path.stat().st_size:,}" in row
    (tmp_path / "text.npz").write_text("x,y\n1,2\n")
    refused = mpjobs("upload", str(tmp_path / "text.npz"))
    assert refused.returncode == 2 and "not an .npz" in refused.stderr
