"""Settings, read from the environment (and `.env`) by pydantic-settings."""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


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
    speed_check_steps: int = 4
    """A job that succeeds then times its policy (on a CPU, when float16/bfloat16) or its comparison's
    variants against float32, this many steps per side and round, in turns (worker/speed.py). 0: off."""
    speed_check_rounds: int = 9
    """Rounds of that speed check: the quartiles of its per-round ratios are the interval shown."""
    lease_s: float = 30.0
    """A running attempt renews its lease this often / 6; a lease left to expire means its worker is gone."""
    reap_interval_s: float = 10.0
    """How often every worker looks for running jobs whose lease expired. A dead worker's job is
    requeued within lease_s + reap_interval_s (40 s by default)."""
    max_attempts: int = 3
    """Attempts per job, the first included; after the last, a lost worker fails the job (worker_lost)."""
    api_keys: str = ""
    """`key:tenant,...`. Empty: open mode, for a local API bound to 127.0.0.1 only."""


def get_settings() -> Settings:
    return Settings()
