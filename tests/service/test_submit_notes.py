"""`POST /jobs` says when loss scaling will have no effect, and the job keeps saying it."""

from __future__ import annotations

import httpx


def test_float32_with_dynamic_scaling_is_accepted_with_a_note(client: httpx.Client) -> None:
    created = client.post("/jobs", json={"model": {"name": "mlp"}, "precision_policy": "float32",
                                         "loss_scale": "dynamic", "training": {"steps": 2}})
    assert created.status_code == 201, created.text
    [note] = created.json()["notes"]
    assert note.startswith("Loss scaling has no effect under float32: ")
    assert client.get(f"/jobs/{created.json()['id']}").json()["notes"] == [note]
    plain = client.post("/jobs", json={"model": {"name": "mlp"}, "training": {"steps": 2}}).json()
    assert plain["notes"] == []
