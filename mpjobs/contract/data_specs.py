"""The datasets a spec may name besides a synthetic one: an `.npz` under the server's data root, or an upload."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Literal

from pydantic import Field, field_validator

from mpjobs.contract.strict import Strict, Text


class NpzDataset(Strict):
    """Arrays `x` and `y` in a `.npz` file under the configured data root."""

    kind: Literal["npz"] = "npz"
    path: Text = Field(min_length=1, max_length=1024)

    @field_validator("path")
    @classmethod
    def _relative_inside_root(cls, value: str) -> str:
        path = PurePosixPath(value)
        if path.is_absolute() or ".." in path.parts or "\\" in value or "\0" in value:
            raise ValueError(
                "dataset.path must be relative to the data root, without '..'. "
                f"Received: path={value!r}"
            )
        return value


DATASET_ID_PATTERN = r"^[0-9a-f]{64}$"
"""An uploaded dataset's id: the SHA-256 of its `.npz` bytes, 64 lowercase hex digits (POST /datasets)."""


class UploadedDataset(Strict):
    """Arrays `x` and `y` of an `.npz` uploaded with `POST /datasets`, named by the id it answered."""

    kind: Literal["uploaded"] = "uploaded"
    id: str = Field(pattern=DATASET_ID_PATTERN, description="The SHA-256 of the uploaded .npz's bytes, as "
                                                            "POST /datasets answers it.")


__all__ = ["DATASET_ID_PATTERN", "NpzDataset", "UploadedDataset"]
