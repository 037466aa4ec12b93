"""`POST /jobs` says when loss scaling will have no effect, and the job keeps saying it."""

from __future__ import annotations

import httpx

from scripts.stack import Stack
from tests.processes.test_cli import mpjobs


def test_float32_with_dynamic_scaling_is_accepted_with_a_note(client: httpx.Client) -> None:
    created = client.post("/jobs", json={"model": {"name": "mlp"}, "precision_policy": "float32",
                                         "loss_scale": "dynamic", "training": {"steps": 2}})
    assert created.status_code == 201, created.text
    [note] = created.json()["notes"]
    assert note.startswith("Loss scaling has no effect under float32: ")
    assert client.get(f"/jobs/{created.json()['id']}").json()["notes"] == [note]
    plain = client.post("/jobs", json={"model": {"name": "mlp"}, "training": {"steps": 2}}).json()
    assert plain["notes"] == []


def test_the_cli_prints_the_note_on_submit(stack: Stack, client: httpx.Client) -> None:
    scaled = mpjobs(stack, "submit", "--model", "mlp", "--policy", "float32", "--loss-scale", "dynamic",
                    "--steps", "1", "--samples", "64")
    assert scaled.returncode == 0, scaled.stderr
    [note] = client.get(f"/jobs/{scaled.stdout.splitlines()[0]}").json()["notes"]
    assert note.startswith("Loss scaling has no effect under float32: ")
    assert scaled.stderr == f"note: {note}\n"  # the job's note, whole, on stderr
    plain = mpjobs(stack, "submit", "--model", "mlp", "--policy", "float32", "--steps", "1", "--samples", "64")
    assert plain.returncode == 0 and plain.stderr == "", plain.stderr
