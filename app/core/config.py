"""Settings, read from the environment (and `.env`) by pydantic-settings."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from mpjobs.contract.training_spec import MAX_DEVICES

MIN_SPEED_ROUNDS = 5
"""Quartiles of fewer per-round ratios say little; even 5 once called an A/A pair different under load."""


MODEL_ARTIFACT = "model.keras"
"""The trained model's file name in a job's folder: `<ARTIFACTS_DIR>/<job id>/model.keras`."""

DATASETS_FOLDER = "datasets"
"""Uploaded datasets' folder under ARTIFACTS_DIR (no job id is spelled so: ids are 32 hex digits)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_file=".env", extra="ignore")

    redis_url: str = "redis://localhost:6379/0"
    artifacts_dir: Path = Path("var/artifacts")
    """Per-job folders: checkpoints and the trained `model.keras`."""
    data_root: Path = Path("var/data")
    """`npz` datasets are resolved inside this folder and may never leave it."""
    report_interval_s: float = 0.05
    """Longest a finished step waits in the worker before it is reported."""
    report_max_records: int = 256
    """Most step records held before a report is forced."""
    checkpoint_interval_s: float = Field(30.0, gt=0)
    """A running job also checkpoints once this many seconds of training passed since its last checkpoint,
    whichever comes first with the spec's `checkpoint_every` steps: an attempt of slow steps that lives
    less than `checkpoint_every` steps still leaves a checkpoint to resume from."""
    speed_check_steps: int = 4
    """A job that succeeds then times its policy (on a CPU, when float16/bfloat16) or its comparison's
    variants against float32, this many steps per side and round, in turns (worker/numerics/speed.py). 0: off."""
    speed_check_rounds: int = Field(9, ge=MIN_SPEED_ROUNDS)
    """Rounds of that speed check: the 95% interval of its median per-round ratio is the interval shown."""
    speed_check_max_seconds: float = Field(60.0, gt=0)
    """Past this, a speed check trains one step per side and round, and ends after the round that
    crosses it (never before MIN_SPEED_ROUNDS rounds): a slow policy cannot hold a job for minutes."""
    lease_s: float = 30.0
    """A running attempt renews its lease this often / 6; a lease left to expire means its worker is gone."""
    reap_interval_s: float = 10.0
    """How often every worker looks for running jobs whose lease expired. A dead worker's job is
    requeued within lease_s + reap_interval_s (40 s by default)."""
    heartbeat_interval_s: float = Field(10.0, gt=0)
    """Seconds between a worker's RQ heartbeats while a job runs (RQ's `maintain_heartbeats`: the worker's
    `last_heartbeat` and the job's StartedJobRegistry expiry); far inside RQ's 90 s worker and job TTLs."""
    max_attempts: int = 3
    """Attempts lost in a row without progress (none resumed past the checkpoint of the one before; the first
    attempt included) after which a lost worker fails the job (worker_lost). An attempt that got further
    starts the count again: a long job on workers that keep dying still finishes, a stuck one does not."""
    redis_memory_high_water: float = Field(0.9, gt=0, le=1)
    """The share of Redis's `maxmemory` past which `POST /jobs` and `POST /comparisons` answer 503 and
    write nothing, so the jobs already running keep the rest for their steps. No limit when Redis has
    no `maxmemory` (0)."""
    worker_gpus: str = "all"
    """`all`, or GPU indices as nvidia-smi numbers them (`0,1`): the GPUs `python -m worker` runs one
    job slot each on, every slot a process of its own pinned with CUDA_VISIBLE_DEVICES (worker/service/slots.py)."""
    host_gpus: str = ""
    """This host's GPU indices (`0,1`, or `none`) instead of asking nvidia-smi: where it cannot answer,
    and in tests, which give a CPU machine GPUs to pin slots to. Empty: detected."""
    cpu_logical_devices: int = Field(1, ge=1, le=MAX_DEVICES)
    """On a CPU host (TensorFlow), split the CPU into this many devices, so the worker takes jobs with
    `training.devices` up to it: for testing multi-device jobs without GPUs. 1: the CPU as one device."""
    max_job_seconds: int = Field(24 * 3600, ge=1)
    """The longest any attempt may run, from the moment a worker takes it (model build, data, training,
    speed check): a spec's `training.max_seconds` may be lower, never higher (the API refuses it), and a
    spec without one gets this. The job then fails with reason `timeout`, its last checkpoint kept."""
    max_model_bytes: int = Field(16 * 2**30, ge=1)
    """The API refuses (422) a built-in model whose estimated training memory (weights, gradients,
    optimizer slots and activations), or whose synthetic dataset, exceeds this; the worker also checks
    a built model against its own free memory before training."""
    history_retention_s: float = Field(7 * 24 * 3600, ge=0)
    """How long an ended job's step records, rollups and layer checks stay in Redis before they are
    archived to `<ARTIFACTS_DIR>/<job id>/history/` (Parquet) and their streams removed; reads then come
    from the archive. 0: archived as soon as the job ends. The job record and its events stay in Redis."""
    dataset_max_bytes: int = Field(4 * 2**30, ge=1)
    """The largest `.npz` `POST /datasets` takes, in bytes (4 GiB): a longer body is refused with 413 and
    nothing of it is kept. Uploads are streamed to `<ARTIFACTS_DIR>/datasets/`, never held in memory."""
    max_streams: int = Field(2000, ge=1)
    """The most live streams (`GET /jobs/{id}/metrics/stream`) one API process serves at once: past it a new
    one is answered 503 with Retry-After, before any body. Each costs memory and a share of one event loop,
    never a Redis connection."""
    stream_queue_events: int = Field(4096, ge=1)
    """The most events a live stream's viewer may have waiting: one that falls further behind (a slow client
    or network) is dropped with an `error` event (`too_slow`) and resumes after its last event id, so it
    never slows the others. A viewer with nothing waiting takes any one read's events whole."""
    stream_read_connections: int = Field(2, ge=1, le=64)
    """Redis connections an API process keeps for viewers catching up on a job's history, besides the one of
    its live reader: however many watch, its live streams hold these and no more."""
    api_keys: str = ""
    """`key:tenant,...`. Empty: open mode, for a local API bound to 127.0.0.1 only."""

    @field_validator("redis_url", mode="before")
    @classmethod
    def _default_when_empty(cls, value: object) -> object:
        """`REDIS_URL=` (empty, as .env.example writes it for `make run`) is the default."""
        return "redis://localhost:6379/0" if value == "" else value

    def job_dir(self, job_id: str) -> Path:
        """`<ARTIFACTS_DIR>/<job id>`: the job's checkpoint, TensorBoard logs and trained model."""
        return self.artifacts_dir / job_id

    def datasets_dir(self) -> Path:
        """`<ARTIFACTS_DIR>/datasets`: uploaded datasets, one `<sha256>.npz` each, read by every worker."""
        return self.artifacts_dir / DATASETS_FOLDER

    def model_path(self, job_id: str) -> Path:
        return self.job_dir(job_id) / MODEL_ARTIFACT


def get_settings() -> Settings:
    return Settings()
