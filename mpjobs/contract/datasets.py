"""An uploaded dataset as the API describes it: its id (the SHA-256 of its bytes), its arrays and its jobs."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ArrayShape(BaseModel):
    """One array of the dataset: its shape (samples first) and NumPy dtype (`<f4`, `<i8`, `|b1`...)."""

    shape: list[int]
    dtype: str
    low: float | None = None
    """Its smallest value (None for booleans): the class ids a sparse categorical loss can take start here."""
    high: float | None = None
    """Its largest value (None for booleans)."""


class DatasetRecord(BaseModel):
    """`GET /datasets/{id}`: an `.npz` of arrays `x` and `y` uploaded with `POST /datasets`."""

    id: str = Field(description="The SHA-256 of the .npz's bytes (hex): the same bytes always get the same id.")
    sha256: str
    bytes: int
    x: ArrayShape
    y: ArrayShape
    created_at: str
    jobs: list[str] = Field(default_factory=list, description="Ids of this tenant's jobs that train on it.")

    @property
    def samples(self) -> int:
        return self.x.shape[0]


class DatasetPage(BaseModel):
    """`GET /datasets`: the caller's datasets, newest first."""

    datasets: list[DatasetRecord]
