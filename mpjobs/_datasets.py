"""Uploading datasets: `x` and `y` as an `.npz` of fixed bytes, hashed first, sent only when the server lacks it.

The same arrays always make the same bytes (each member's zip time is fixed), so their SHA-256, which is the
dataset's id on the server, is known before anything is sent: `GET /datasets/{sha256}` answers whether it is
there, and only then is the file streamed. NumPy is imported only here, when arrays are given.
"""

from __future__ import annotations

import hashlib
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

CHUNK_BYTES = 1 * 2**20
"""Bytes read (to hash, to send) at a time: a large dataset is never held whole."""
ZIP_TIME = (1980, 1, 1, 0, 0, 0)
"""Every member's time in the zip: the earliest zip can say, so the bytes depend on the arrays alone."""


def write_npz(x: Any, y: Any, file: IO[bytes]) -> None:
    """Write `x` and `y` to `file` as an `.npz` that numpy.load reads, its bytes a function of the arrays only."""
    import numpy as np

    with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, value in (("x", x), ("y", y)):
            array = np.asanyarray(value)
            if array.dtype.hasobject:
                raise ValueError(f"Expected numeric arrays; {name!r} holds Python objects (dtype=object).")
            info = zipfile.ZipInfo(f"{name}.npy", date_time=ZIP_TIME)
            info.external_attr = 0o600 << 16
            with archive.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)


def sha256_of(file: IO[bytes]) -> tuple[str, int]:
    """(SHA-256 hex, bytes) of `file` from its start; leaves it at its start."""
    file.seek(0)
    sha, size = hashlib.sha256(), 0
    while chunk := file.read(CHUNK_BYTES):
        sha.update(chunk)
        size += len(chunk)
    file.seek(0)
    return sha.hexdigest(), size


def chunks(file: IO[bytes]) -> Iterator[bytes]:
    """The file's bytes from its start, CHUNK_BYTES at a time (an httpx streamed body)."""
    file.seek(0)
    while chunk := file.read(CHUNK_BYTES):
        yield chunk


def arrays_file(x: Any, y: Any) -> IO[bytes]:
    """A temporary file holding the `.npz` of `x` and `y` (deleted when closed)."""
    file = tempfile.TemporaryFile()
    try:
        write_npz(x, y, file)
    except BaseException:
        file.close()
        raise
    return file


def open_npz(path: str | Path) -> IO[bytes]:
    """An `.npz` file on disk, sent as it is: its bytes are its id."""
    return open(path, "rb")
