"""An older client reads a newer server: the Python client (`mpjobs`) parses answers that carry fields and enum
values it does not know, at any depth, with the known fields intact; the API's own models stay strict.

The answers are served by `httpx.MockTransport`, the client's HTTP layer: each is a real answer's JSON (the API's
own model, dumped as the API sends it) with a field added to every object in it, as a newer server might."""

from __future__ import annotations

import argparse
import copy
import json
import re
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

import mpjobs
from mpjobs._reading import read
from mpjobs.cli.commands import cmd_cancel
from mpjobs.cli.exit_codes import Exit, exit_for
from mpjobs.cli.words import summary_lines
from mpjobs.contract.comparisons import ComparisonReport as ComparisonResource
from mpjobs.contract.jobs import JobRecord as JobResource
from mpjobs.contract.jobs import JobState, MetricsPage
from mpjobs.contract.records import Diagnosis, DiagnosisCode, StepRecord
from mpjobs.contract.spec import ComparisonSpec, JobSpec
from scripts.stack import ROOT

NEW = "added_by_a_newer_server"


def record(step: int) -> dict[str, Any]:
    return {"step": step, "loss": 1.0 / step, "loss_scale": 32768.0, "grad_norm": 0.5, "grads_finite": True,
            "skipped": False, "zero_grad_fraction": 0.01, "regularization_loss": None,
            "excess_zero_fraction": 0.002 if step == 2 else None, "grad_rel_error": 0.001 if step == 2 else None,
            "fp8": None, "learning_rate": 0.001, "examples_per_sec": 900.0 + step, "step_time_ms": 35.5,
            "time": 1.7e9 + step}


SPEED = {"policy_ms": 40.0, "float32_ms": 30.0, "slowdown": 1.33, "steps": 24, "low": 1.3, "high": 1.4,
         "noise_low": 0.97, "noise_high": 1.03, "rounds": 8, "difference": "slower"}
DIAGNOSIS = {"code": "overflow_skips", "message": "2 steps skipped", "first_step": 1, "layer": "dense_1"}
SPEC = JobSpec.model_validate({"model": {"name": "mlp"}, "precision_policy": "mixed_float16",
                               "training": {"steps": 3}}).model_dump(mode="json")
JOB = JobResource.model_validate({
    "id": "a" * 32, "name": "compat", "state": "succeeded", "queue": "cpu", "spec": SPEC,
    "created_at": "2026-12-01T10:00:00Z", "started_at": "2026-12-01T10:00:01Z",
    "finished_at": "2026-12-01T10:00:09Z",
    "transitions": [{"state": "queued", "at": "2026-12-01T10:00:00Z", "message": ""},
                    {"state": "succeeded", "at": "2026-12-01T10:00:09Z", "message": "finished 3 steps"}],
    "progress": {"step": 3, "total_steps": 3},
    "summary": {"steps_done": 3, "final_loss": 0.6, "skipped_steps": 0, "loss_scale_min": 32768.0,
                "loss_scale_max": 32768.0, "loss_scale_final": 32768.0, "peak_zero_grad_fraction": 0.01,
                "mean_examples_per_sec": 902.0, "precision_speed": SPEED,
                "variant_speeds": [{"label": "mixed_float16", "speed": SPEED}], "diagnoses": [DIAGNOSIS]},
    "error": None, "attempt": 1, "worker": {"host": "h", "pid": 7, "device": {"kind": "cpu"}, "gpus": []},
    "notes": ["a note"], "phase": None,
}).model_dump(mode="json")
VARIANT = {"label": "mixed_float16 + dynamic", "precision_policy": "mixed_float16",
           "loss_scale": {"mode": "dynamic", "initial_scale": 32768.0, "growth_steps": 2000}, "baseline": False,
           "job_id": "b" * 32, "state": "succeeded", "progress": {"step": 3, "total_steps": 3}, "final_loss": 0.6,
           "loss_gap": 0.01, "examples_per_sec": 900.0, "speed": SPEED, "skipped_steps": 0,
           "peak_zero_grad_fraction": 0.01, "diagnoses": [DIAGNOSIS], "error": None, "device": "cpu"}
COMPARISON = ComparisonResource.model_validate({
    "id": "c" * 32, "name": None, "created_at": "2026-12-01T10:00:00Z", "state": "done",
    "spec": ComparisonSpec.model_validate({"spec": {"model": {"name": "mlp"}}, "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "mixed_float16", "loss_scale": "dynamic"}]}
    ).model_dump(mode="json"),
    "variants": [{**VARIANT, "label": "float32", "precision_policy": "float32", "loss_scale": {"mode": "none"},
                  "baseline": True, "job_id": "a" * 32, "loss_gap": 0.0, "speed": None}, VARIANT],
    "verdict": "mixed_float16 + dynamic matches float32 within 1%.",
}).model_dump(mode="json")
CHECK = {"step": 2, "compute_dtype": "float16", "loss_scale": 32768.0, "time": 1.7e9, "recovery": "recovered",
         "layers": [{"name": "dense", "kind": "Dense", "values": 10, "zero_fraction": 0.1}]}
BUCKETS = {"job_id": "a" * 32, "total_steps": 3, "buckets": [{
    "first_step": 1, "last_step": 3, "steps": 3, "skipped": 0, "loss": {"min": 0.3, "mean": 0.6, "max": 1.0},
    "grad_norm": {"min": 0.5, "mean": 0.5, "max": 0.5}, "loss_scale": {"min": 32768.0, "mean": 32768.0,
                                                                       "max": 32768.0}}]}


def newer(value: Any) -> Any:
    """`value` as a newer server might send it: a field this client does not know added to every object in it,
    at any depth (but not inside the worker's free-form `device` nor a spec's `layer_policies`, where any key
    is a value: a layer's name)."""
    if isinstance(value, dict):
        return {**{k: v if k in ("device", "layer_policies") else newer(v) for k, v in value.items()},
                NEW: {"nested": [1, "x"]}}
    if isinstance(value, list):
        return [newer(v) for v in value]
    return value


def serving(answers: dict[str, Any], sse: str = "") -> mpjobs.Client:
    """A client whose API answers each `METHOD /path` of `answers` with its JSON, and the stream with `sse`."""
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/metrics/stream"):
            return httpx.Response(200, text=sse, headers={"Content-Type": "text/event-stream"})
        key = f"{request.method} {request.url.path}"
        max_points = request.url.params.get("max_points")
        body = answers.get(f"{key}?max_points" if max_points else key)
        return httpx.Response(200, json=body) if body is not None else httpx.Response(404, json={"detail": key})
    return mpjobs.Client("http://api.test", api_key="", transport=httpx.MockTransport(answer))


def test_a_job_and_its_pages_with_unknown_fields_at_every_depth_are_read_with_the_known_fields_intact() -> None:
    page = {"job_id": JOB["id"], "points": [record(1), record(2)], "next_after": None, "missing_steps": [[3, 3]]}
    layers = {"job_id": JOB["id"], "checks": [CHECK], "next_after": None}
    path = f"/jobs/{JOB['id']}"
    client = serving({f"GET {path}": newer(JOB), "POST /jobs": newer(JOB), f"DELETE {path}": newer(JOB),
                      "GET /jobs": newer({"jobs": [JOB], "next_cursor": "x"}), f"GET {path}/metrics": newer(page),
                      f"GET {path}/metrics?max_points": newer(BUCKETS), f"GET {path}/layers": newer(layers)})
    for resource in (client.job(JOB["id"]).resource, client.submit({"model": {"name": "mlp"}}).resource,
                     client.job(JOB["id"]).cancel().resource, client.jobs().jobs[0]):
        assert resource.model_dump(mode="json") == JOB
        assert NEW not in resource.model_dump() and not resource.model_extra
    assert client.jobs().model_dump(mode="json") == {"jobs": [JOB], "next_cursor": "x"}
    job = client.job(JOB["id"])
    assert job.done and job.state is JobState.SUCCEEDED and job.diagnoses[0].code is DiagnosisCode.OVERFLOW_SKIPS
    assert job.summary is not None and job.summary.precision_speed is not None
    assert job.summary.precision_speed.difference == "slower" and job.resource.spec.training.steps == 3
    metrics = job.metrics()
    assert isinstance(metrics, MetricsPage) and metrics.model_dump(mode="json") == page
    assert job.metrics(max_points=10).model_dump(mode="json") == BUCKETS
    assert job.layer_checks().model_dump(mode="json", exclude_defaults=True) == layers
    pandas = pytest.importorskip("pandas")
    frame = job.to_pandas()
    assert list(frame.columns) == list(record(1)) and isinstance(frame, pandas.DataFrame)
    assert frame["examples_per_sec"].tolist() == [901.0, 902.0]


def test_the_stream_reads_step_records_with_unknown_fields() -> None:
    events = [f"id: {r['step']}\nevent: metrics\ndata: {json.dumps(newer(r))}\n\n" for r in (record(1), record(2))]
    state = json.dumps(newer({"state": "succeeded", "at": "2026-12-01T10:00:09Z", "message": "done"}))
    sse = "".join(events) + f"event: state\ndata: {state}\n\n" + 'event: end\ndata: {"state": "succeeded"}\n\n'
    client = serving({f"GET /jobs/{JOB['id']}": newer(JOB)}, sse)
    streamed = list(client.job(JOB["id"]).stream())
    assert [r.model_dump(mode="json") for r in streamed] == [record(1), record(2)]
    assert all(isinstance(r, StepRecord) for r in streamed)  # an FP8 row's tensor, a Literal, is read leniently


def test_a_comparison_with_unknown_fields_at_every_depth_is_read_with_the_known_fields_intact() -> None:
    path = f"/comparisons/{COMPARISON['id']}"
    client = serving({f"GET {path}": newer(COMPARISON), "POST /comparisons": newer(COMPARISON),
                      f"DELETE {path}": newer(COMPARISON),
                      "GET /comparisons": newer({"comparisons": [COMPARISON], "next_cursor": None})})
    for resource in (client.comparison(COMPARISON["id"]).resource, client.compare({"model": {"name": "mlp"}}).resource,
                     client.comparison(COMPARISON["id"]).cancel().resource, client.comparisons().comparisons[0]):
        assert resource.model_dump(mode="json") == COMPARISON
    c = client.comparison(COMPARISON["id"])
    assert c.done and [v.label for v in c.variants] == ["float32", "mixed_float16 + dynamic"]
    assert c.variants[1].speed is not None and c.variants[1].speed.slowdown == 1.33


def test_unknown_enum_values_are_kept_as_their_strings_by_the_client_and_refused_by_the_api() -> None:
    job = copy.deepcopy(JOB)
    job["state"] = job["transitions"][-1]["state"] = "paused"
    job["spec"]["training"]["optimizer"] = "lion"
    job["summary"]["diagnoses"][0]["code"] = "new_diagnosis"
    job["summary"]["precision_speed"]["difference"] = "much_slower"
    comparison = copy.deepcopy(COMPARISON)
    comparison["variants"][1]["state"] = "paused"
    client = serving({f"GET /jobs/{JOB['id']}": newer(job), f"GET /comparisons/{COMPARISON['id']}": comparison})

    read_job = client.job(JOB["id"])
    assert read_job.resource.model_dump(mode="json") == job  # each unknown value as it was sent
    assert read_job.state == "paused" and read_job.state.value == "paused" and isinstance(read_job.state, JobState)
    assert read_job.state not in set(JobState) and not read_job.done  # not a state this client knows to be an end
    assert read_job.diagnoses[0].code == "new_diagnosis" and str(read_job.resource.spec.training.optimizer) == "lion"
    assert repr(read_job) == f"<Job {JOB['id']} paused 3/3>"
    c = client.comparison(COMPARISON["id"])
    assert c.variants[1].state.value == "paused" and c.resource.model_dump(mode="json") == comparison

    # The API's own models, and the enums themselves, are as strict as before (the client registered nothing).
    with pytest.raises(ValueError, match="'paused' is not a valid JobState"):
        JobState("paused")
    with pytest.raises(ValidationError) as refused:
        JobResource.model_validate(job)
    assert {e["loc"] for e in refused.value.errors()} >= {("state",), ("transitions", 1, "state"),
                                                           ("summary", "diagnoses", 0, "code")}
    with pytest.raises(ValidationError, match=NEW):
        Diagnosis.model_validate({**DIAGNOSIS, NEW: 1})
    with pytest.raises(ValidationError, match="optimizer"):
        JobSpec.model_validate({**SPEC, "training": {**SPEC["training"], "optimizer": "lion"}})


def test_an_answer_the_client_cannot_represent_is_a_bad_response_naming_the_field() -> None:
    job = {**JOB, "spec": {**SPEC, "model": {"name": "resnet", "depth": 50}}}  # a model kind a newer server has
    unreadable = r"not a JobRecord this client can read: spec\.model: .*upgrading mpjobs"
    with pytest.raises(mpjobs.BadResponse, match=unreadable):
        serving({f"GET /jobs/{JOB['id']}": job}).job(JOB["id"])
    with pytest.raises(mpjobs.BadResponse, match="progress: Field required"):
        read(JobResource, {k: v for k, v in JOB.items() if k != "progress"})


def test_every_answer_the_client_parses_goes_through_the_lenient_reader() -> None:
    """A new call site that parsed with the API's strict models directly would bring the defect back."""
    for path in sorted((ROOT / "mpjobs").glob("*.py")):
        if path.name != "_reading.py":
            assert not re.search(r"\.model_validate(_json)?\(", path.read_text()), f"{path.name}: use mpjobs._reading"


def test_the_cli_shows_a_state_it_does_not_know_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI reads raw answers: a newer server's job state is shown as sent, is no end, and exits 0."""
    job = copy.deepcopy(JOB)
    job["state"] = job["transitions"][-1]["state"] = "paused"
    job["summary"] = None
    client = serving({f"GET /jobs/{JOB['id']}": newer(job), f"DELETE /jobs/{JOB['id']}": newer(job)})
    assert cmd_cancel(client, argparse.Namespace(job_id=JOB["id"], wait=False)) == Exit.OK
    assert capsys.readouterr().out == f"{JOB['id']}: paused\n"
    assert exit_for("paused") is Exit.OK and exit_for("failed") is not Exit.OK
    assert summary_lines(job) == [f"job {JOB['id']} paused after 3 of 3 steps", "  summary          none yet"]
