"""Uploads: `POST /datasets` of an `.npz` against a plain copy of the same bytes to the same disk.

    python -m bench.upload [--quick] [--repeats N]

A private redis-server and API (no worker). Each repeat streams the file with httpx from disk to
`POST /datasets` (the API hashes it, writes it, fsyncs it, checks every value, renames it and records it),
then deletes it; and copies the same file with `shutil.copyfile` plus an fsync into the same datasets folder.
The floor of any upload through the same server stack is measured too: the same bytes POSTed to a bare
FastAPI route that reads the body as a stream and drops it (`bench/baseline_app.py` `/sink`, under uvicorn
with the API's options). The figures are medians over repeats; the ratio is the median of per-repeat ratios.
Goal: an upload within 2x of a plain copy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

from app.core.npz import inspect_npz
from bench.loadgen import redis_server, serve
from bench.report import Row, cli, median
from scripts.stack import private_stack

MIB = 2**20


def make_npz(folder: Path, mib: int) -> Path:
    """An .npz of about `mib` MiB: float32 x of 256 features, int32 class ids y, written a slice at a time."""
    rows = mib * MIB // (256 * 4 + 4)
    x = np.lib.format.open_memmap(folder / "x.npy", mode="w+", dtype=np.float32, shape=(rows, 256))
    rng = np.random.default_rng(0)
    for start in range(0, rows, 16_384):
        x[start:start + 16_384] = rng.standard_normal((min(16_384, rows - start), 256), dtype=np.float32)
    x.flush()
    del x
    np.save(folder / "y.npy", (np.arange(rows) % 10).astype(np.int32))
    path = folder / "data.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        archive.write(folder / "x.npy", "x.npy")
        archive.write(folder / "y.npy", "y.npy")
    return path


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as file:
        while chunk := file.read(MIB):
            yield chunk


def _copy(source: Path, target: Path) -> float:
    started = time.perf_counter()
    shutil.copyfile(source, target)
    with open(target, "rb+") as file:
        os.fsync(file.fileno())
    elapsed = time.perf_counter() - started
    target.unlink()
    return elapsed


def _sink(client: httpx.Client, path: Path) -> float:
    size = path.stat().st_size
    started = time.perf_counter()
    answer = client.post("/sink", content=_chunks(path), timeout=600,
                         headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})
    elapsed = time.perf_counter() - started
    assert answer.json() == {"bytes": size}, answer.text
    return elapsed


def _upload(client: httpx.Client, path: Path) -> float:
    size = path.stat().st_size
    started = time.perf_counter()
    answer = client.post("/datasets", content=_chunks(path), timeout=600,
                         headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})
    elapsed = time.perf_counter() - started
    assert answer.status_code == 201, answer.text
    client.delete(f"/datasets/{answer.json()['id']}").raise_for_status()
    return elapsed


def run(quick: bool = False, repeats: int | None = None) -> list[Row]:
    """Quick: a 16 MiB file, 3 repeats (the smoke test's size); else 256 MiB, 5 repeats."""
    mib, repeats = (16, repeats or 3) if quick else (256, repeats or 5)
    with tempfile.TemporaryDirectory() as tmp, private_stack(Path(tmp) / "stack", workers=0) as stack:
        path = make_npz(Path(tmp), mib)
        size_mb = path.stat().st_size / 1e6
        folder = stack.artifacts / "datasets"
        folder.mkdir(parents=True, exist_ok=True)
        uploads, copies = [], []
        with stack.client() as client:
            _upload(client, path)  # warm: the API's first request and the folder made
            for i in range(repeats):  # in turns, so both sides see the same disk and load
                if i % 2:
                    copies.append(_copy(path, folder / "copy.npz"))
                    uploads.append(_upload(client, path))
                else:
                    uploads.append(_upload(client, path))
                    copies.append(_copy(path, folder / "copy.npz"))
        with redis_server() as (_, env), serve("bench.baseline_app:app", {**env, "ARTIFACTS_DIR": tmp},
                                               Path(tmp) / "sink.log") as bare, \
                httpx.Client(base_url=bare.url) as client:
            _sink(client, path)
            sinks = [_sink(client, path) for _ in range(repeats)]
        checks = []
        for _ in range(repeats):
            started = time.perf_counter()
            inspect_npz(path)
            checks.append(time.perf_counter() - started)
    ratio = median(u / c for u, c in zip(uploads, copies, strict=True))
    floor = median(s / c for s, c in zip(sinks, copies, strict=True))
    upload_mbs, copy_mbs = size_mb / median(uploads), size_mb / median(copies)
    case = f"POST /datasets of a {size_mb:,.0f} MB .npz, {repeats} repeats"
    return [Row("upload", case, "shutil.copyfile + fsync, same disk", copy_mbs, upload_mbs, "MB/s", 1 / ratio),
            Row("upload", f"{case}: time against the copy's", "plain copy", median(copies), median(uploads), "s",
                ratio, goal="<= 2x a plain copy", met=ratio <= 2),
            Row("upload", "the same bytes POSTed to a bare route that drops them (the HTTP floor)", "plain copy",
                median(copies), median(sinks), "s", floor),
            Row("upload", "the check of every value alone (app/core/npz.py, the file in the page cache)", "plain copy",
                median(copies), median(checks), "s", median(k / c for k, c in zip(checks, copies, strict=True)))]

if __name__ == "__main__":
    cli("upload", __doc__ or "", run)
