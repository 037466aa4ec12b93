"""`POST /datasets`: an `.npz` streamed to disk while hashed, checked, then renamed to its SHA-256's name.

The body is never held whole: each chunk is hashed and written to a temporary file in the datasets folder
as it arrives. Once it is complete it is fsynced and its arrays are checked (app/core/npz.py), both at once;
only then is it renamed (atomically, in the same folder) to `<sha256>.npz` and recorded. A body past DATASET_MAX_BYTES,
a client that goes away, or a refused `.npz` leave nothing behind: the temporary file is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from app.core.config import Settings
from app.core.errors import DatasetRefused, DatasetTooLarge, NotAnNpzBody
from app.core.npz import ArrayInfo, BadArray, NotAnNpz, NpzInfo, inspect_npz
from app.store import JobStore
from mpjobs.contract.datasets import ArrayShape, DatasetRecord

BATCH_BYTES = 4 * 2**20
"""Bytes of the body hashed and written at once, on a thread, while the next batch is received."""
TEMP_PREFIX = ".upload-"
"""Uploads in progress: `.upload-*.part` in the datasets folder, never a dataset's name."""


def dataset_path(settings: Settings, dataset_id: str) -> Path:
    """Where an uploaded dataset's bytes are: `<ARTIFACTS_DIR>/datasets/<sha256>.npz`."""
    return settings.datasets_dir() / f"{dataset_id}.npz"


async def receive(request: Request, store: JobStore, settings: Settings, tenant: str) -> tuple[DatasetRecord, bool]:
    """Stream the body to disk, check it and record it for `tenant`. Returns (record, created).

    Raises:
        DatasetTooLarge: longer than DATASET_MAX_BYTES (declared, or counted as it arrives).
        NotAnNpzBody, DatasetRefused: not an `.npz`, or arrays that cannot train a model.
    """
    limit = settings.dataset_max_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise DatasetTooLarge(limit)
    folder = settings.datasets_dir()
    folder.mkdir(parents=True, exist_ok=True)
    handle, temp_name = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX, suffix=".part")
    temp = Path(temp_name)
    try:
        digest, size = await _write(request, handle, limit)
        # The disk flush and the check of every value (from the page cache) at once: both before the rename.
        info, _ = await asyncio.gather(run_in_threadpool(_inspect, temp), run_in_threadpool(_fsync, temp))
        await run_in_threadpool(_publish, temp, dataset_path(settings, digest))
        return await run_in_threadpool(store.datasets.create, tenant, digest, size, _shape(info.x), _shape(info.y))
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()


async def _write(request: Request, handle: int, limit: int) -> tuple[str, int]:
    """Write the body to `handle`, hashing it. Returns (sha256 hex, bytes).

    Chunks are gathered into batches of BATCH_BYTES; each batch is hashed and written on a thread (hashlib and
    file writes let go of the GIL) while the next one is received, one batch in flight at a time: at most
    about 2 x BATCH_BYTES of the body are held at once.
    """
    sha, size = hashlib.sha256(), 0
    loop = asyncio.get_running_loop()
    in_flight: asyncio.Future[None] | None = None
    batch = bytearray()
    with os.fdopen(handle, "wb") as file:

        def put(data: bytearray) -> None:
            sha.update(data)
            file.write(data)

        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise DatasetTooLarge(limit)
                batch += chunk
                if len(batch) >= BATCH_BYTES:
                    if in_flight is not None:
                        await in_flight
                    in_flight, batch = loop.run_in_executor(None, put, batch), bytearray()
        finally:
            if in_flight is not None:  # never close the file under a write still running
                await in_flight
        put(batch)
    return sha.hexdigest(), size


def _fsync(path: Path) -> None:
    """Flush the file's data to the disk (fsync flushes the file, whichever descriptor names it)."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _inspect(path: Path) -> NpzInfo:
    try:
        return inspect_npz(path)
    except NotAnNpz as exc:
        raise NotAnNpzBody(str(exc)) from None
    except BadArray as exc:
        raise DatasetRefused((exc.field,), str(exc)) from None


def _publish(temp: Path, final: Path) -> None:
    """Rename the checked file to its name, and make the rename durable. Identical bytes may already be
    there (another upload of them): the rename replaces them with the same bytes, atomically."""
    os.replace(temp, final)
    folder = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def _shape(info: ArrayInfo) -> ArrayShape:
    return ArrayShape(shape=list(info.shape), dtype=info.dtype, low=info.low, high=info.high)

