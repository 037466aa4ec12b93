"""The client's public face (`mpjobs.__all__`): every name the command needs is there, and nothing else is added."""

from __future__ import annotations

import pytest

import mpjobs
from mpjobs.contract.jobs import JobState
from mpjobs.contract.records import DiagnosisCode


def test_all_is_the_public_face_and_each_name_resolves() -> None:
    assert mpjobs.__all__ == [
        "DEFAULT_TIMEOUT_S", "DEFAULT_URL", "ApiError", "BadResponse", "Client", "ClientError", "Comparison",
        "Conflict", "InvalidSpec", "Job", "MpjobsError", "NotFound", "ServerError", "Timeout", "Unauthorized",
        "Unavailable", "Unreachable", "WaitTimeout", "member"]
    assert all(hasattr(mpjobs, name) for name in mpjobs.__all__)


def test_member_reads_a_known_value_as_its_member_and_an_unknown_one_as_a_stand_in() -> None:
    assert mpjobs.member(JobState, "canceled") is JobState.CANCELED
    assert mpjobs.member(DiagnosisCode, "overflow_skips") is DiagnosisCode.OVERFLOW_SKIPS
    paused = mpjobs.member(JobState, "paused")
    assert (paused == "paused", paused.value, isinstance(paused, JobState)) == (True, "paused", True)
    assert paused not in set(JobState) and not paused.terminal
    with pytest.raises(ValueError, match="'paused' is not a valid JobState"):
        JobState("paused")  # the enum itself is as strict as before


def test_the_defaults_are_the_clients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MPJOBS_URL", raising=False)
    assert (mpjobs.DEFAULT_URL, mpjobs.DEFAULT_TIMEOUT_S) == ("http://127.0.0.1:8000", 30.0)
    with mpjobs.Client() as client:
        assert (client.url, client.timeout) == (mpjobs.DEFAULT_URL, mpjobs.DEFAULT_TIMEOUT_S)
