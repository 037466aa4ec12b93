"""The worker reads an uploaded dataset by id from the shared datasets folder, or fails naming the folder."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest

from app.core.errors import InvalidDataset
from mpjobs.contract.spec import JobSpec
from worker.engine.data import load_dataset


def _spec(dataset_id: str) -> JobSpec:
    return JobSpec.model_validate({"model": {"name": "mlp", "input_dim": 3, "classes": 2},
                                   "dataset": {"kind": "uploaded", "id": dataset_id},
                                   "training": {"batch_size": 2}})


def test_an_uploaded_dataset_is_read_by_its_id(tmp_path: Path) -> None:
    x, y = np.arange(12, dtype=np.float32).reshape(4, 3), np.array([0, 1, 1, 0])
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=y)
    dataset_id = hashlib.sha256(buffer.getvalue()).hexdigest()
    (tmp_path / f"{dataset_id}.npz").write_bytes(buffer.getvalue())
    data = load_dataset(_spec(dataset_id), (3,), (2,), "sparse_categorical_crossentropy", tmp_path / "none",
                        datasets_dir=tmp_path)
    np.testing.assert_array_equal(data.x, x)
    np.testing.assert_array_equal(data.y, y)


def test_a_missing_upload_fails_the_job_naming_the_folder(tmp_path: Path) -> None:
    with pytest.raises(InvalidDataset, match=str(tmp_path)):
        load_dataset(_spec("a" * 64), (3,), (2,), "sparse_categorical_crossentropy", tmp_path, datasets_dir=tmp_path)


def test_an_uploaded_validation_dataset_is_held_out_whole(tmp_path: Path) -> None:
    from worker.engine.data import Dataset, hold_out

    x_val, y_val = np.full((3, 3), 7.0, dtype=np.float32), np.array([1, 0, 1])
    buffer = io.BytesIO()
    np.savez(buffer, x=x_val, y=y_val)
    dataset_id = hashlib.sha256(buffer.getvalue()).hexdigest()
    (tmp_path / f"{dataset_id}.npz").write_bytes(buffer.getvalue())
    spec = JobSpec.model_validate({"model": {"name": "mlp", "input_dim": 3, "classes": 2},
                                   "training": {"batch_size": 2},
                                   "validation": {"dataset": {"kind": "uploaded", "id": dataset_id}}})
    train = Dataset(np.zeros((4, 3), dtype=np.float32), np.array([0, 1, 1, 0]), 2, 0)
    kept, held = hold_out(spec, train, (3,), tmp_path / "none", tmp_path)
    assert kept is train and held is not None
    np.testing.assert_array_equal(held.x, x_val)
    np.testing.assert_array_equal(held.y, y_val)
    np.testing.assert_array_equal(held.rows, np.arange(3))
    with pytest.raises(InvalidDataset, match=str(tmp_path / "gone")):
        hold_out(spec, train, (3,), tmp_path, tmp_path / "gone")
