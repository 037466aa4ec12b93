"""The Python client (`mpjobs`) against the real API, worker and Redis: a keras.Model submitted and read back
as a DataFrame, its steps streamed across an API restart, a comparison; and an import that loads no TensorFlow."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import mpjobs
from app.store.keys import job_key
from mpjobs._specs import job_spec
from mpjobs.contract.jobs import MetricsPage
from scripts.stack import ROOT, Stack, freeze_mid_run

SMALL = {"model": {"name": "mlp", "input_dim": 16, "hidden_units": 16}, "dataset": {"samples": 256}}
"""A spec whose steps take about a millisecond."""


@pytest.fixture
def mp(stack: Stack) -> Iterator[mpjobs.Client]:
    with mpjobs.Client(stack.base_url, api_key="") as c:
        yield c


def rows(frame: Any) -> list[dict[str, Any]]:
    """A frame's rows as plain dicts, NaN (pandas' null in a float column) as None, as the API writes null."""
    return [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
            for row in frame.to_dict("records")]


def test_a_keras_model_is_submitted_waited_for_and_its_frame_is_the_apis_metrics(
    mp: mpjobs.Client, client: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="Expected a compiled model"):
        job_spec(model)
    model.compile(optimizer="adam", loss=keras.losses.MeanSquaredError())

    job = mp.submit(model, policy="float32", steps=12, batch_size=16, name="client")
    assert job.state.value in {"queued", "running"} and job.resource.spec.training.steps == 12
    assert job.wait(timeout=180) is job and job.state.value == "succeeded", job.error
    assert capsys.readouterr().err.rstrip().endswith("state: succeeded (finished 12 steps)")  # the progress lines

    raw = client.get(f"/jobs/{job.id}").json()
    assert raw["spec"]["model"] == {"keras_json": model.to_json(), "loss": "mean_squared_error"}
    assert job.summary is not None and job.summary.model_dump(mode="json") == raw["summary"]
    assert [d.code.value for d in job.diagnoses] == [d["code"] for d in raw["summary"]["diagnoses"]]
    points = client.get(f"/jobs/{job.id}/metrics", params={"limit": 1000}).json()["points"]
    frame = job.to_pandas()
    assert list(frame.columns) == list(points[0]) and len(points) == 12
    assert rows(frame) == points  # field for field, the step column included
    page = job.metrics(after=10, limit=5)
    assert isinstance(page, MetricsPage) and [p.step for p in page.points] == [11, 12]


def test_stream_resumes_after_the_api_restarts_with_no_step_lost_or_repeated(
    stack: Stack, mp: mpjobs.Client, client: httpx.Client
) -> None:
    spec = {**SMALL, "training": {"steps": 200}}
    job_id, pid, spec = freeze_mid_run(stack, client, spec, past_step=3)  # its worker stopped mid-run
    steps = spec["training"]["steps"]
    try:
        frozen_at = int(stack.redis.client().hget(job_key(job_id), "step") or 0)
        stream = mp.job(job_id).stream()
        before = [next(stream).step for _ in range(frozen_at)]
        assert stack.api is not None
        stack.api.kill()  # the stream drops mid-run, as in a crash
        stack.api.wait(10)
        os.killpg(pid, signal.SIGCONT)  # the job trains on while the API is down
        stack.start_api()
        after = [record.step for record in stream]
    finally:
        os.killpg(pid, signal.SIGCONT)
    assert before == list(range(1, frozen_at + 1)) and frozen_at < steps
    assert before + after == list(range(1, steps + 1)), "each step once, in order, across the restart"
    assert client.get(f"/jobs/{job_id}").json()["state"] == "succeeded"


def test_a_comparisons_frame_holds_each_variants_steps_and_its_verdict_is_the_apis(
    mp: mpjobs.Client, client: httpx.Client
) -> None:
    c = mp.compare(SMALL, ["float32", "mixed_float16:dynamic"], steps=4, name="client compare")
    assert [v.label for v in c.variants] == ["float32", "mixed_float16 + dynamic"]
    assert c.wait(progress=False, timeout=240).done
    raw = client.get(f"/comparisons/{c.id}").json()
    assert c.verdict == raw["verdict"] and "mixed_float16 + dynamic" in c.verdict
    frame = c.to_pandas()
    expected = [{"variant": v["label"], "job_id": v["job_id"], **point} for v in raw["variants"]
                for point in client.get(f"/jobs/{v['job_id']}/metrics").json()["points"]]
    assert len(expected) == 8 and rows(frame) == expected


def test_errors_are_the_apis_answers_as_one_tree_and_a_wait_can_run_out(
    mp: mpjobs.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(mpjobs.NotFound) as missing:
        mp.job("f" * 32)
    assert (missing.value.status, str(missing.value)) == (404, f"No job with id {'f' * 32!r}.")
    with pytest.raises(mpjobs.InvalidSpec) as invalid:
        mp.submit({"model": {"name": "mlp"}}, steps=0, policy="float64")
    assert isinstance(invalid.value, mpjobs.ApiError) and invalid.value.status == 422
    assert {field for field, _ in invalid.value.errors} == {"precision_policy", "training.steps"}
    down = mpjobs.Client("http://127.0.0.1:9", api_key="")  # nothing listens on the discard port
    with pytest.raises(mpjobs.Unreachable, match="cannot reach the API at http://127.0.0.1:9"):
        down.jobs()
    queued = mp.submit(SMALL, steps=5, device="gpu")  # no GPU worker runs in the tests: it stays queued
    for progress in (False, True):
        with pytest.raises(mpjobs.WaitTimeout):
            queued.wait(progress=progress, timeout=0.5)
    assert queued.cancel().state.value == "canceled" and queued.cancel().state.value == "canceled"  # then a 409
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install pandas"):
        mp.submit(SMALL, steps=1).to_pandas()


def test_importing_the_client_loads_no_tensorflow_keras_or_server_code() -> None:
    probe = ("import sys, mpjobs; mpjobs.Client('http://127.0.0.1:9').close(); print(sorted({m.split('.')[0] "
             "for m in sys.modules} & {'tensorflow', 'keras', 'jax', 'worker', 'redis', 'fastapi', 'pandas'}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"


def test_the_api_still_refuses_unknown_fields_in_a_request_at_any_depth(
    mp: mpjobs.Client, client: httpx.Client
) -> None:
    """The client ignores a newer server's fields in answers (tests/mpjobs/test_client_compat.py); the server
    goes on refusing fields it does not know in a body, naming each, and queues nothing."""
    before = {j["id"] for j in client.get("/jobs", params={"limit": 200}).json()["jobs"]}
    for body, field in (({**SMALL, "trainng": {}}, "trainng"),
                        ({**SMALL, "training": {"steps": 2, "warmup": 1}}, "training.warmup"),
                        ({**SMALL, "model": {"name": "mlp", "width": 3}}, "model.mlp.width")):
        with pytest.raises(mpjobs.InvalidSpec) as refused:
            mp.submit(body)
        assert [f for f, _ in refused.value.errors] == [field]
        assert "Extra inputs are not permitted" in refused.value.errors[0][1]
    variants = [{"precision_policy": "float32"}, {"precision_policy": "mixed_float16", "new": 2}]
    answer = client.post("/comparisons", json={"spec": SMALL, "variants": variants, "new": 1})
    assert answer.status_code == 422, answer.text
    assert sorted(e["loc"] for e in answer.json()["detail"]) == [["body", "new"], ["body", "variants", 1, "new"]]
    assert {j["id"] for j in client.get("/jobs", params={"limit": 200}).json()["jobs"]} == before  # none queued
