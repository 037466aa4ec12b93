"""Uploaded datasets read, listed and deleted for their tenant; the last record of a file deletes the file."""

from __future__ import annotations

import contextlib

from app.api.uploads import dataset_path
from app.core.config import Settings
from app.core.errors import DatasetInUse, DatasetNotFound
from app.store import DatasetInUseBy, JobStore
from mpjobs.contract.datasets import DatasetPage, DatasetRecord


def get(store: JobStore, tenant: str, dataset_id: str) -> DatasetRecord:
    """The tenant's dataset, or DatasetNotFound: another tenant's is indistinguishable from none."""
    record = store.datasets.get(tenant, dataset_id)
    if record is None:
        raise DatasetNotFound(dataset_id)
    return record


def list_datasets(store: JobStore, tenant: str) -> DatasetPage:
    return DatasetPage(datasets=store.datasets.list_datasets(tenant))


def delete(store: JobStore, settings: Settings, tenant: str, dataset_id: str) -> None:
    """Delete the tenant's record; the file too once no tenant holds one.

    Raises:
        DatasetNotFound: no such dataset for this tenant.
        DatasetInUse: one of the tenant's queued or running jobs trains on it (nothing deleted).
    """
    try:
        others = store.datasets.delete(tenant, dataset_id)
    except DatasetInUseBy as exc:
        raise DatasetInUse(dataset_id, exc.job_id, exc.state) from None
    if others is None:
        raise DatasetNotFound(dataset_id)
    if others == 0:
        with contextlib.suppress(FileNotFoundError):
            dataset_path(settings, dataset_id).unlink()
