"""The chunked .npz check: shapes, dtypes and ranges as NumPy reads them; pickles, NaN rows, non-npz refused."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest

from app.core import npz
from app.core.npz import BadArray, NotAnNpz, inspect_npz


def _save(path: Path, compressed: bool = False, **arrays: object) -> Path:
    (np.savez_compressed if compressed else np.savez)(path, **arrays)  # type: ignore[arg-type]
    return path


@pytest.mark.parametrize("compressed", [False, True])
def test_shapes_dtypes_and_ranges_match_numpys_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       compressed: bool) -> None:
    monkeypatch.setattr(npz, "CHUNK_BYTES", 64)  # many chunks: the range must still be the whole array's
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((50, 3, 2)).astype(np.float32), rng.integers(0, 7, 50)
    info = inspect_npz(_save(tmp_path / "d.npz", compressed, x=x, y=y))
    assert info.x.shape == x.shape and info.x.dtype == x.dtype.str
    assert (info.x.low, info.x.high) == (float(x.min()), float(x.max()))
    assert (info.y.shape, info.y.dtype, info.y.low, info.y.high) == (y.shape, y.dtype.str, float(y.min()),
                                                                      float(y.max()))


@pytest.mark.parametrize("order", ["C", "F"])
def test_the_first_row_with_nan_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    monkeypatch.setattr(npz, "CHUNK_BYTES", 40)
    x = np.ones((30, 5), np.float64, order=order)  # type: ignore[call-overload]
    x[17, 4], x[23, 0] = np.nan, np.inf
    with pytest.raises(BadArray, match="row 17 ") as refused:
        inspect_npz(_save(tmp_path / "d.npz", x=x, y=np.zeros(30)))
    assert refused.value.field == "x"


def test_pickled_objects_missing_arrays_other_lengths_and_non_npz_are_refused(tmp_path: Path) -> None:
    objects = np.array([{"a": 1}, None], dtype=object)
    with pytest.raises(BadArray, match="Python objects") as refused:
        inspect_npz(_save(tmp_path / "o.npz", x=np.zeros((2, 1)), y=objects))
    assert refused.value.field == "y"
    with pytest.raises(BadArray, match="'y' is missing"):
        inspect_npz(_save(tmp_path / "m.npz", x=np.zeros((2, 1))))
    with pytest.raises(BadArray, match="same first dimension"):
        inspect_npz(_save(tmp_path / "l.npz", x=np.zeros((2, 1)), y=np.zeros(3)))
    with pytest.raises(BadArray, match="holds text"):
        inspect_npz(_save(tmp_path / "t.npz", x=np.array([["a"]]), y=np.zeros(1)))
    (tmp_path / "j.npz").write_text('{"x": [1]}')
    with pytest.raises(NotAnNpz):
        inspect_npz(tmp_path / "j.npz")
    np.save(tmp_path / "a.npy", np.zeros(3))
    with pytest.raises(NotAnNpz):
        inspect_npz(tmp_path / "a.npy")


def test_an_array_shorter_than_its_header_says_is_refused_as_truncated(tmp_path: Path) -> None:
    full = io.BytesIO()
    np.lib.format.write_array(full, np.ones((100, 3)))
    short = full.getvalue()[: -8 * 3 * 90]  # ten rows of the hundred its header promises
    with zipfile.ZipFile(tmp_path / "t.npz", "w") as archive:
        archive.writestr("x.npy", short)
        full = io.BytesIO()
        np.lib.format.write_array(full, np.zeros(100))
        archive.writestr("y.npy", full.getvalue())
    with pytest.raises(BadArray, match="'x' is truncated") as refused:
        inspect_npz(tmp_path / "t.npz")
    assert refused.value.field == "x"
