"""An `.npz` of arrays `x` and `y` checked a chunk at a time: shapes, dtypes, finite values, label range.

The API checks an uploaded dataset (and a DATA_ROOT one at submission) with this, never holding an array
whole: each `.npy` member's header is read for its shape and dtype, then its data is read CHUNK_BYTES at a
time. `numpy.load(..., allow_pickle=False)` opens the archive, so what NumPy would refuse is refused here.
"""

from __future__ import annotations

import math
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

ARRAYS = ("x", "y")
"""The arrays a dataset holds: inputs `x`, labels `y`, one row per sample in both."""
NUMERIC_KINDS = "biuf"
"""NumPy dtype kinds a model can train on: bool, signed and unsigned integers, floats."""
CHUNK_BYTES = 8 * 2**20
"""Most bytes of one array read at once while it is checked."""
_KIND_WORDS = {"U": "text", "S": "bytes", "c": "complex numbers", "M": "dates", "m": "time spans",
               "V": "raw records", "O": "Python objects (pickled)"}


_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
"""A zip member's local file header (30 bytes); its last two fields are the name's and the extra field's length."""
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


class NotAnNpz(ValueError):
    """The bytes are not an `.npz` archive at all (HTTP 415)."""


class BadArray(ValueError):
    """An `.npz` whose arrays cannot train a model (HTTP 422); `field` names the array (`x`, `y`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ArrayInfo:
    """One array's shape, dtype and value range (None when it holds no finite numbers, or is boolean)."""

    shape: tuple[int, ...]
    dtype: str
    low: float | None
    high: float | None


@dataclass(frozen=True)
class NpzInfo:
    x: ArrayInfo
    y: ArrayInfo


def inspect_npz(path: Path, check_values: bool = True) -> NpzInfo:
    """Check the `.npz` at `path` and describe its arrays.

    Args:
        check_values: read every value (finite, and the range of each array); False reads the headers only.

    Raises:
        NotAnNpz: not a zip archive of `.npy` files.
        BadArray: `x` or `y` missing, not numeric (object arrays included), of different lengths, or holding
            NaN or infinity (the message names the first bad row).
    """
    with open(path, "rb") as file:
        if file.read(4) != b"PK\x03\x04":
            raise NotAnNpz("The body is not an .npz file: an .npz is a zip archive of .npy arrays, as "
                           "numpy.savez(file, x=..., y=...) writes, and starts with b'PK\\x03\\x04'.")
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise NotAnNpz(f"The body is not a readable .npz file: {exc}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise NotAnNpz("The body is not an .npz archive of arrays.")
    with archive:
        names = set(archive.files)
        for name in ARRAYS:
            if name not in names:
                raise BadArray(name, f"Expected an .npz holding arrays 'x' and 'y'. Array {name!r} is missing; "
                                     f"received arrays: {sorted(names) or 'none'}.")
        zip_file = archive.zip
        assert zip_file is not None  # open until the `with` ends
        infos = {name: _inspect_member(zip_file, path, name, check_values) for name in ARRAYS}
    x, y = infos["x"], infos["y"]
    if not x.shape or not y.shape or x.shape[0] != y.shape[0]:
        raise BadArray("y", f"Expected 'x' and 'y' to have the same first dimension (one row per sample). "
                            f"Received: x.shape={x.shape}, y.shape={y.shape}.")
    return NpzInfo(x, y)


def _inspect_member(zip_file: zipfile.ZipFile, path: Path, name: str, check_values: bool) -> ArrayInfo:
    try:
        info = zip_file.getinfo(f"{name}.npy")
        member = _open_stored(path, info) if info.compress_type == zipfile.ZIP_STORED else zip_file.open(info)
    except KeyError:
        raise BadArray(name, f"Array {name!r} must be stored as {name}.npy in the .npz.") from None
    except (zipfile.BadZipFile, NotImplementedError, RuntimeError) as exc:
        raise NotAnNpz(f"Array {name!r} cannot be read from the .npz: {exc}") from None
    with member:
        start = member.tell()
        try:
            version = np.lib.format.read_magic(member)
            if version not in _HEADER_READERS:
                raise ValueError(f"its .npy format version {version} is not 1.0 or 2.0")
            shape, fortran, dtype = _HEADER_READERS[version](member)
        except (ValueError, OSError, zipfile.BadZipFile) as exc:
            raise BadArray(name, f"Array {name!r} is not a readable .npy array: {exc}") from None
        if dtype.hasobject or dtype.kind not in NUMERIC_KINDS:
            words = _KIND_WORDS.get(dtype.kind, dtype.name)
            raise BadArray(name, f"Array {name!r} holds {words}: models train on numbers, so {name!r} must be an "
                                 f"array of floats, integers or booleans. Received: dtype={dtype.str!r}.")
        data_bytes = math.prod(shape) * dtype.itemsize
        if member.tell() - start + data_bytes > info.file_size:
            raise BadArray(name, f"Array {name!r} is truncated: its header promises shape {tuple(shape)} "
                                 f"({data_bytes} bytes), more than its {info.file_size} bytes in the .npz hold.")
        low, high = _scan(member, name, tuple(shape), bool(fortran), dtype) if check_values else (None, None)
    return ArrayInfo(tuple(int(n) for n in shape), dtype.str, low, high)


def _open_stored(path: Path, info: zipfile.ZipInfo) -> IO[bytes]:
    """An uncompressed member read straight from the file, at its data's offset: no zip layer, no CRC pass (the
    bytes are checked as they are parsed, and their SHA-256 names them)."""
    file = open(path, "rb")  # noqa: SIM115  closed by the caller's `with`
    file.seek(info.header_offset)
    head = file.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size or not head.startswith(b"PK\x03\x04"):
        file.close()
        raise zipfile.BadZipFile(f"no local header for {info.filename!r} at offset {info.header_offset}")
    name_length, extra_length = _LOCAL_HEADER.unpack(head)[-2:]
    file.seek(info.header_offset + _LOCAL_HEADER.size + name_length + extra_length)
    return file


def _scan(member: IO[bytes], name: str, shape: tuple[int, ...], fortran: bool, dtype: np.dtype
          ) -> tuple[float | None, float | None]:
    """Read the array's data a chunk at a time: its range, and the first row holding NaN or infinity."""
    total = math.prod(shape)
    per_chunk = max(1, CHUNK_BYTES // max(dtype.itemsize, 1))
    per_row = math.prod(shape[1:]) if shape else 1
    low = high = None
    first_bad: int | None = None
    done = 0
    while done < total:
        count = min(per_chunk, total - done)
        raw = member.read(count * dtype.itemsize)
        if len(raw) != count * dtype.itemsize:
            raise BadArray(name, f"Array {name!r} is truncated: its header promises shape {shape}, "
                                 f"but its data ends after {done + len(raw) // max(dtype.itemsize, 1)} values.")
        values = np.frombuffer(raw, dtype=dtype)
        if dtype.kind == "b" or not values.size:
            done += count
            continue
        chunk_low, chunk_high = float(values.min()), float(values.max())  # NaN if any is; -inf, inf if any is
        if dtype.kind == "f" and not (math.isfinite(chunk_low) and math.isfinite(chunk_high)):
            bad = np.flatnonzero(~np.isfinite(values))
            rows = (bad + done) % shape[0] if fortran else (bad + done) // per_row
            first_bad = int(rows.min()) if first_bad is None else min(first_bad, int(rows.min()))
            if not fortran:
                break
        low = chunk_low if low is None else min(low, chunk_low)
        high = chunk_high if high is None else max(high, chunk_high)
        done += count
    if first_bad is not None:
        raise BadArray(name, f"Expected finite values: array {name!r} holds NaN or infinity in row {first_bad} "
                             f"(counting from 0). Remove or fix that row, and any after it.")
    return low, high
