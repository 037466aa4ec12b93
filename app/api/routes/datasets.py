"""Routes of /datasets: upload an `.npz` (streamed, content-addressed), list, describe, delete."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Response, status
from fastapi.concurrency import run_in_threadpool

from app.api import datasets, uploads
from app.api.deps import SettingsDep, StoreDep, TenantDep
from app.api.resources import ERROR_RESPONSES, ErrorBody
from app.core.errors import DatasetNotFound
from mpjobs.contract.data_specs import DATASET_ID_PATTERN
from mpjobs.contract.datasets import DatasetPage, DatasetRecord

UPLOAD_PATH = "/datasets"
"""`POST /datasets` reads its body as a stream, past the 1 MiB limit of other bodies (app/api/limits.py)."""
router = APIRouter(prefix=UPLOAD_PATH, tags=["datasets"], responses=ERROR_RESPONSES)
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": ErrorBody, "description": "No such dataset (or another tenant's)"},
}
UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "The raw bytes of an .npz holding arrays `x` and `y` (numpy.savez(file, x=..., y=...)), "
                       "sent as the body itself, not as a form. Streamed to disk: at most DATASET_MAX_BYTES.",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    },
}
_ID = re.compile(DATASET_ID_PATTERN)


async def get_dataset_id(dataset_id: Annotated[str, Path(description="The SHA-256 of the dataset's .npz bytes")],
                         tenant: TenantDep) -> str:
    """The dataset id in the path; a malformed one is the 404 of a missing one, after the tenant's 401."""
    if _ID.fullmatch(dataset_id) is None:
        raise DatasetNotFound(dataset_id)
    return dataset_id


DatasetIdDep = Annotated[str, Depends(get_dataset_id)]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=DatasetRecord, openapi_extra=UPLOAD_BODY,
             responses={200: {"model": DatasetRecord, "description": "This tenant already had these bytes"},
                        413: {"model": ErrorBody, "description": "Longer than DATASET_MAX_BYTES: nothing kept"},
                        415: {"model": ErrorBody, "description": "The body is not an .npz: nothing kept"},
                        422: {"description": "An array is missing, not numeric (object arrays included), of "
                                             "another length, or holds NaN or infinity (the row is named)"}})
async def upload_dataset(request: Request, store: StoreDep, settings: SettingsDep, tenant: TenantDep,
                         response: Response) -> DatasetRecord:
    """Upload an .npz of arrays `x` and `y` (Content-Type: application/octet-stream). Its id is the SHA-256
    of its bytes: the same bytes are stored once, and uploading them again answers 200 with the same id."""
    record, created = await uploads.receive(request, store, settings, tenant)
    response.headers["Location"] = f"/datasets/{record.id}"
    if not created:
        response.status_code = status.HTTP_200_OK
    return record


@router.get("", response_model=DatasetPage)
async def list_datasets(store: StoreDep, tenant: TenantDep) -> DatasetPage:
    """The caller's datasets, newest first."""
    return await run_in_threadpool(datasets.list_datasets, store, tenant)


@router.get("/{dataset_id}", response_model=DatasetRecord, responses=NOT_FOUND)
async def get_dataset(dataset_id: DatasetIdDep, store: StoreDep, tenant: TenantDep) -> DatasetRecord:
    """The dataset: its arrays' shapes, dtypes and ranges, its bytes and hash, and the jobs that train on it."""
    return await run_in_threadpool(datasets.get, store, tenant, dataset_id)


@router.delete("/{dataset_id}", status_code=status.HTTP_204_NO_CONTENT, responses={
    **NOT_FOUND, 409: {"model": ErrorBody, "description": "A queued or running job trains on it: nothing deleted"}})
async def delete_dataset(dataset_id: DatasetIdDep, store: StoreDep, settings: SettingsDep,
                         tenant: TenantDep) -> Response:
    """Delete the dataset (its file too, once no other tenant uploaded the same bytes)."""
    await run_in_threadpool(datasets.delete, store, settings, tenant, dataset_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
