"""The mpjobs API over HTTP (httpx): submit jobs and comparisons, read them back as the API's own schemas."""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import httpx

from mpjobs._comparison import Comparison
from mpjobs._datasets import arrays_file, chunks, open_npz, sha256_of
from mpjobs._exceptions import BadResponse, NotFound, mapped, raise_for
from mpjobs._job import Job
from mpjobs._reading import read
from mpjobs._specs import as_dict, job_spec, validation_spec, variant
from mpjobs.contract.comparisons import ComparisonPage
from mpjobs.contract.comparisons import ComparisonReport as ComparisonResource
from mpjobs.contract.datasets import DatasetPage, DatasetRecord
from mpjobs.contract.jobs import JobPage, JobState
from mpjobs.contract.jobs import JobRecord as JobResource

DEFAULT_URL = "http://127.0.0.1:8000"
"""Where `make run` serves the API; MPJOBS_URL overrides it."""
DEFAULT_TIMEOUT_S = 30.0
"""Seconds per HTTP request (a live stream is allowed longer quiet spells: mpjobs/_stream.py)."""


class Client:
    """The mpjobs API at `url` (default: $MPJOBS_URL, else http://127.0.0.1:8000), sending `api_key`
    (default: $MPJOBS_API_KEY) as `Authorization: Bearer KEY`. `transport` is the test seam
    (`httpx.MockTransport`). Close it when done, or use it as a context manager.

    >>> from mpjobs import Client
    >>> with Client("http://127.0.0.1:8000") as client:                     # doctest: +SKIP
    ...     job = client.submit({"model": {"name": "mlp"}}, policy="mixed_float16", steps=300)
    ...     frame = job.wait().to_pandas()
    """

    def __init__(self, url: str | None = None, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 *, transport: httpx.BaseTransport | None = None) -> None:
        self.url = (url or os.environ.get("MPJOBS_URL") or DEFAULT_URL).rstrip("/")
        api_key = api_key if api_key is not None else os.environ.get("MPJOBS_API_KEY")
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    def __repr__(self) -> str:
        return f"<mpjobs.Client {self.url}>"

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request; its JSON answer (None for a 204). An error status raises its `ApiError`, an
        unreachable API `Unreachable` (or `Timeout`): mpjobs/_exceptions.py."""
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise mapped(exc, self.url, self.timeout) from exc
        raise_for(response)
        if response.status_code == 204:  # done, nothing to say: a delete
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise BadResponse(f"{self.url}{path} did not answer JSON; is the url right?") from exc

    # --- jobs -----------------------------------------------------------------

    def submit(self, spec: Any, *, policy: str | None = None, loss_scale: Any = None, steps: int | None = None,
               batch_size: int | None = None, learning_rate: float | None = None, loss: str | None = None,
               name: str | None = None, device: str | None = None, idempotency_key: str | None = None,
               data: tuple[Any, Any] | None = None, validation: Any = None,
               layer_policies: dict[str, str] | None = None) -> Job:
        """Queue a job. `spec`: a JobSpec, a dict as `POST /jobs` takes it, or a keras.Model (sent as its
        `to_json()`, its loss from `model.loss` once compiled, else `loss=`). The keywords set those fields
        on top (`loss_scale`: "none", "fixed", "dynamic" or a dict). `data=(x, y)`: train on these arrays,
        uploaded first (`upload`) unless the server has them already. `validation`: evaluate on held-out rows,
        a share of the data (0.2: a split with seed 0), arrays `(x_val, y_val)` (uploaded as `data` is) or the
        spec's dict; a compiled Keras model's metrics among those it takes go to `validation.metrics`. Without
        `validation` a model's metrics are not sent (the spec has no place for them). A retry with the same
        `idempotency_key` returns the first job. `layer_policies`: layers, by name, that compute in another
        policy ({"dense_1": "float32"}; docs/numerics.md, "Per-layer policies"). A spec the API refuses raises
        `InvalidSpec`, naming each field."""
        body = job_spec(spec, policy=policy, loss_scale=loss_scale, steps=steps, batch_size=batch_size,
                        learning_rate=learning_rate, loss=loss, name=name, device=device,
                        layer_policies=layer_policies)
        self._set_data(body, data)
        self._set_validation(body, validation, spec)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return Job(self, read(JobResource, self.request("POST", "/jobs", json=body, headers=headers)))

    def _set_data(self, body: dict[str, Any], data: tuple[Any, Any] | None) -> None:
        if data is not None:
            x, y = data
            body["dataset"] = {"kind": "uploaded", "id": self.upload(x, y).id}

    def _set_validation(self, body: dict[str, Any], validation: Any, model: Any) -> None:
        if validation is None:
            return
        uploaded = None
        if isinstance(validation, tuple | list) and len(validation) == 2:
            uploaded = self.upload(*validation).id
        body["validation"] = validation_spec(validation, model, uploaded)

    def job(self, job_id: str) -> Job:
        return Job(self, read(JobResource, self.request("GET", f"/jobs/{job_id}")))

    def jobs(self, state: JobState | str | None = None, limit: int = 50, cursor: str | None = None) -> JobPage:
        """One page of jobs, newest first; pass `next_cursor` as `cursor` for the next."""
        params = {k: v for k, v in (("state", state), ("limit", limit), ("cursor", cursor)) if v is not None}
        return read(JobPage, self.request("GET", "/jobs", params=params))

    def delete_job(self, job_id: str) -> None:
        """Delete an ended job for good: its record, step records, files and queue entries."""
        self.request("DELETE", f"/jobs/{job_id}", params={"purge": "true"})

    # --- comparisons ------------------------------------------------------------

    def compare(self, spec: Any, variants: list[Any] | None = None, *, name: str | None = None,
                tolerance: float | None = None, idempotency_key: str | None = None,
                data: tuple[Any, Any] | None = None, validation: Any = None, float32_seeds: int | None = None,
                plan: str | None = None, **overrides: Any) -> Comparison:
        """Run `spec` (as `submit` takes it, `overrides` its keywords) once per precision variant, same seed and
        data, and compare each with float32. `variants`: Variants, dicts or "POLICY[:MODE]" strings
        ("mixed_float16:dynamic"); None: float32, mixed_float16 with and without loss scaling, mixed_bfloat16.
        `data=(x, y)` and `validation=` as `submit` takes them. `float32_seeds=2`: also train float32 with the
        next seed, so the verdict weighs mixed precision's held-out difference against two float32 seeds'.
        `plan="auto"`: one more variant, the first half-precision one trained with its precision plan."""
        body: dict[str, Any] = {"spec": job_spec(spec, **overrides) if overrides else as_dict(spec)}
        self._set_data(body["spec"], data)
        self._set_validation(body["spec"], validation, spec)
        if float32_seeds is not None:
            body["float32_seeds"] = float32_seeds
        if plan is not None:
            body["plan"] = plan
        if variants is not None:
            body["variants"] = [variant(v) for v in variants]
        if name is not None:
            body["name"] = name
        if tolerance is not None:
            body["tolerance"] = tolerance
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        answer = self.request("POST", "/comparisons", json=body, headers=headers)
        return Comparison(self, read(ComparisonResource, answer))

    def comparison(self, comparison_id: str) -> Comparison:
        return Comparison(self, read(ComparisonResource, self.request("GET", f"/comparisons/{comparison_id}")))

    def comparisons(self, limit: int = 20, cursor: str | None = None) -> ComparisonPage:
        params = {k: v for k, v in (("limit", limit), ("cursor", cursor)) if v is not None}
        return read(ComparisonPage, self.request("GET", "/comparisons", params=params))

    def delete_comparison(self, comparison_id: str) -> None:
        """Delete a comparison and all its jobs for good, once every one has ended."""
        self.request("DELETE", f"/comparisons/{comparison_id}", params={"purge": "true"})

    # --- datasets ----------------------------------------------------------------

    def upload(self, x: Any, y: Any) -> DatasetRecord:
        """Upload arrays `x` (inputs, samples first) and `y` (labels) as a dataset; returns its record, whose
        `id` a spec names as `{"kind": "uploaded", "id": ...}`. The `.npz` is written to a temporary file and
        hashed first: when the server already has these bytes, nothing is sent. Needs NumPy."""
        with arrays_file(x, y) as file:
            return self._upload(file)

    def upload_file(self, path: str | Path) -> DatasetRecord:
        """Upload an `.npz` file holding arrays `x` and `y`, as it is (nothing sent if the server has it)."""
        with open_npz(path) as file:
            return self._upload(file)

    def _upload(self, file: IO[bytes]) -> DatasetRecord:
        digest, size = sha256_of(file)
        try:
            return self.dataset(digest)
        except NotFound:
            pass
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        return read(DatasetRecord, self.request("POST", "/datasets", content=chunks(file), headers=headers))

    def dataset(self, dataset_id: str) -> DatasetRecord:
        """One of your datasets: its arrays' shapes and dtypes, bytes, hash and the jobs that train on it."""
        return read(DatasetRecord, self.request("GET", f"/datasets/{dataset_id}"))

    def datasets(self) -> list[DatasetRecord]:
        """Your datasets, newest first."""
        return read(DatasetPage, self.request("GET", "/datasets")).datasets

    def delete_dataset(self, dataset_id: str) -> None:
        """Delete one of your datasets; refused (`Conflict`) while a queued or running job trains on it."""
        self.request("DELETE", f"/datasets/{dataset_id}")
