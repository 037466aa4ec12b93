"""The one clock. Tests patch `app.core.clock.now` where they need time to stand still."""

from __future__ import annotations

from datetime import UTC, datetime


def now() -> datetime:
    return datetime.now(UTC)


def iso(moment: datetime | None = None) -> str:
    return (moment or now()).isoformat(timespec="milliseconds").replace("+00:00", "Z")
