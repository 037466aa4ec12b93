"""POST /datasets against a real API process: streamed (memory flat), deduplicated, atomic, limited, tenant-scoped.

Each refusal is checked to leave nothing: no file in `<ARTIFACTS_DIR>/datasets`, no record in Redis.
"""

from __future__ import annotations

import hashlib
import io
import socket
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from scripts.stack import Stack, private_stack, wait_until

OCTET = {"Content-Type": "application/octet-stream"}


def npz_bytes(**arrays: Any) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def files(stack: Stack) -> list[str]:
    folder = stack.artifacts / "datasets"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def records(stack: Stack) -> int:
    return sum(1 for _ in stack.redis.client().scan_iter("mpjobs:dataset:*"))


def refusal(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    return detail if isinstance(detail, str) else str(detail[0]["loc"]) + " " + detail[0]["msg"]


def vm_hwm_kib(pid: int) -> int:
    """The process's peak resident memory (since its start, or since `5` was written to its clear_refs)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/<pid>/status")


@pytest.fixture(scope="module")
def two_tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack of its own: two tenants' keys, a 64 KiB DATASET_MAX_BYTES, no worker."""
    with private_stack(tmp_path_factory.mktemp("datasets"), workers=0, API_KEYS="key-a:alpha,key-b:beta",
                       DATASET_MAX_BYTES=str(64 * 1024)) as stack:
        yield stack


def as_tenant(stack: Stack, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, timeout=60, headers={"Authorization": f"Bearer {key}"})


def test_a_500_mb_upload_streams_to_disk_with_flat_api_memory(stack: Stack, client: httpx.Client,
                                                             tmp_path: Path) -> None:
    rows = 500 * 2**20 // (128 * 4)
    path = tmp_path / "big.npz"
    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(rows, 128))
    for start in range(0, rows, 65_536):  # written a slice at a time: the test holds none of it whole either
        x[start:start + 65_536] = np.float32(start % 7)
    x.flush()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        archive.write(tmp_path / "x.npy", "x.npy")
        archive.writestr("y.npy", _npy(np.arange(rows, dtype=np.int32) % 10))
    del x
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(2**20):
            sha.update(chunk)
    size = path.stat().st_size
    assert stack.api is not None
    Path(f"/proc/{stack.api.pid}/clear_refs").write_text("5")  # the peak starts again from today's size
    before = vm_hwm_kib(stack.api.pid)

    def body() -> Iterator[bytes]:
        with open(path, "rb") as file:
            while chunk := file.read(2**20):
                yield chunk

    answer = client.post("/datasets", content=body(), headers={**OCTET, "Content-Length": str(size)}, timeout=600)
    assert answer.status_code == 201, answer.text
    grown_mib = (vm_hwm_kib(stack.api.pid) - before) / 1024
    record = answer.json()
    assert record["id"] == sha.hexdigest() and record["bytes"] == size > 500 * 10**6
    assert record["x"]["shape"] == [rows, 128] and record["y"]["high"] == 9
    assert grown_mib < 100, f"the API's peak memory grew {grown_mib:.0f} MiB for a {size / 2**20:.0f} MiB upload"
    assert (stack.artifacts / "datasets" / f"{record['id']}.npz").stat().st_size == size
    assert client.delete(f"/datasets/{record['id']}").status_code == 204
    assert f"{record['id']}.npz" not in files(stack)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array)
    return buffer.getvalue()


def test_the_same_bytes_twice_and_twice_at_once_are_one_file_and_one_id(stack: Stack, client: httpx.Client) -> None:
    body = npz_bytes(x=np.eye(8, dtype=np.float32), y=np.arange(8))
    expected = hashlib.sha256(body).hexdigest()
    first, again = (client.post("/datasets", content=body, headers=OCTET) for _ in range(2))
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"] == expected
    assert files(stack).count(f"{expected}.npz") == 1
    assert client.delete(f"/datasets/{expected}").status_code == 204
    answers: list[httpx.Response] = []
    start = threading.Barrier(2)

    def upload() -> None:
        with httpx.Client(base_url=stack.base_url, timeout=60) as own:
            start.wait()
            answers.append(own.post("/datasets", content=body, headers=OCTET))

    threads = [threading.Thread(target=upload) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(a.status_code for a in answers) == [200, 201]
    assert {a.json()["id"] for a in answers} == {expected}
    assert [name for name in files(stack) if name.startswith(expected[:8]) or name.endswith(".part")] == [
        f"{expected}.npz"]
    assert [d["id"] for d in client.get("/datasets").json()["datasets"]].count(expected) == 1
    client.delete(f"/datasets/{expected}")


def test_a_client_gone_mid_upload_leaves_no_file_and_no_record(stack: Stack) -> None:
    before_files, before_records = files(stack), records(stack)
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.sendall(b"POST /datasets HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                     b"Content-Length: 4000000\r\n\r\n" + npz_bytes(x=np.zeros((100, 100)), y=np.zeros(100))[:2000]
                     + b"\0" * 1_000_000)
        wait_until(lambda: any(name.endswith(".part") for name in files(stack)), 30, "the upload to begin")
    wait_until(lambda: files(stack) == before_files, 30, "the partial upload's file to go")
    assert records(stack) == before_records


def test_not_an_npz_pickled_objects_and_nan_are_refused_naming_what_and_keep_nothing(
        stack: Stack, client: httpx.Client) -> None:
    before_files, before_records = files(stack), records(stack)
    assert "not an .npz" in refusal(client.post("/datasets", content=b'{"x": [1, 2]}', headers=OCTET), 415)
    objects = npz_bytes(x=np.zeros((2, 3)), y=np.array([{"a": 1}, None], dtype=object))
    message = refusal(client.post("/datasets", content=objects, headers=OCTET), 422)
    assert "'y'" in message and "Python objects" in message
    x = np.ones((40, 3), np.float32)
    x[26, 1] = np.nan
    message = refusal(client.post("/datasets", content=npz_bytes(x=x, y=np.zeros(40)), headers=OCTET), 422)
    assert "'x'" in message and "row 26 " in message
    y = np.zeros(40)
    y[5] = np.inf
    message = refusal(client.post("/datasets", content=npz_bytes(x=np.ones((40, 3)), y=y), headers=OCTET), 422)
    assert "'y'" in message and "row 5 " in message
    message = refusal(client.post("/datasets", content=npz_bytes(x=np.ones((4, 3)), y=np.zeros(5)), headers=OCTET),
                      422)
    assert "same first dimension" in message
    assert files(stack) == before_files and records(stack) == before_records


def test_an_upload_past_the_limit_is_413_naming_it_and_keeps_nothing(two_tenants: Stack) -> None:
    big = npz_bytes(x=np.zeros((100, 100)), y=np.zeros(100))  # 80 KB > 64 KiB
    with as_tenant(two_tenants, "key-a") as alpha:
        assert str(64 * 1024) in refusal(alpha.post("/datasets", content=big, headers=OCTET), 413)

        def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
            yield big[:40_000]
            yield big[40_000:]

        assert str(64 * 1024) in refusal(alpha.post("/datasets", content=chunked(), headers=OCTET), 413)
    assert files(two_tenants) == [] and records(two_tenants) == 0


def test_another_tenants_dataset_is_a_404_and_shared_bytes_outlive_one_tenants_delete(two_tenants: Stack) -> None:
    body = npz_bytes(x=np.ones((4, 2)), y=np.arange(4))
    with as_tenant(two_tenants, "key-a") as alpha, as_tenant(two_tenants, "key-b") as beta:
        dataset_id = alpha.post("/datasets", content=body, headers=OCTET).json()["id"]
        assert beta.get(f"/datasets/{dataset_id}").status_code == 404
        assert beta.delete(f"/datasets/{dataset_id}").status_code == 404
        assert beta.get("/datasets").json()["datasets"] == []
        assert httpx.get(f"{two_tenants.base_url}/datasets").status_code == 401
        assert beta.post("/datasets", content=body, headers=OCTET).status_code == 201  # a record of its own
        assert files(two_tenants) == [f"{dataset_id}.npz"]
        assert alpha.delete(f"/datasets/{dataset_id}").status_code == 204
        assert files(two_tenants) == [f"{dataset_id}.npz"]  # beta still has it
        assert alpha.get(f"/datasets/{dataset_id}").status_code == 404
        assert beta.get(f"/datasets/{dataset_id}").json()["bytes"] == len(body)
        assert beta.delete(f"/datasets/{dataset_id}").status_code == 204
        assert files(two_tenants) == []
