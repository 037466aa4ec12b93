"""`Job.download_model` and `mpjobs download` against an API served in-process (`httpx.MockTransport`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import mpjobs
from mpjobs.cli import Exit, main
from tests.mpjobs.test_cli_watch import ID, job

MODEL_PATH = f"/jobs/{ID}/artifacts/model.keras"
NOT_YET = f"Job {ID!r} has no model.keras yet; it is written when the job succeeds."
BODY = os.urandom(3 * 65536 + 17)  # several chunks of a streamed body


class Chunks(httpx.SyncByteStream):
    """A body sent in pieces; with `fail`, the connection drops after the first."""

    def __init__(self, body: bytes, fail: bool = False) -> None:
        self.body, self.fail = body, fail

    def __iter__(self) -> Iterator[bytes]:
        yield self.body[:65536]
        if self.fail:
            raise httpx.ReadError("connection reset by peer")
        yield self.body[65536:]


def serving(model: bytes | None, seen: list[str], *, fail: bool = False) -> httpx.MockTransport:
    """A succeeded job; its model.keras is `model`, or a 404 with the API's message when None."""
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == MODEL_PATH:
            if model is None:
                return httpx.Response(404, json={"detail": NOT_YET})
            return httpx.Response(200, stream=Chunks(model, fail),
                                  headers={"Content-Type": "application/octet-stream"})
        if request.url.path == f"/jobs/{ID}":
            return httpx.Response(200, json=job("succeeded", 3))
        return httpx.Response(404, json={"detail": f"No job with id {request.url.path.split('/')[2]!r}."})

    return httpx.MockTransport(answer)


def client_of(transport: httpx.MockTransport) -> mpjobs.Client:
    return mpjobs.Client("http://api.test", api_key="", transport=transport)


def test_download_model_writes_the_whole_body_to_the_path_and_returns_it(tmp_path: Path) -> None:
    seen: list[str] = []
    target = tmp_path / "trained.keras"
    target.write_bytes(b"an older download")
    assert client_of(serving(BODY, seen)).job(ID).download_model(target) == target
    assert target.read_bytes() == BODY
    assert seen == [f"/jobs/{ID}", MODEL_PATH]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trained.keras"]  # no temp file left


def test_a_job_with_no_model_raises_not_found_with_the_apis_message_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(mpjobs.NotFound) as caught:
        client_of(serving(None, [])).job(ID).download_model(tmp_path / "m.keras")
    assert caught.value.detail == NOT_YET
    assert list(tmp_path.iterdir()) == []


def test_a_dropped_connection_leaves_the_old_file_whole_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "m.keras"
    target.write_bytes(b"the previous model")
    with pytest.raises(mpjobs.Unreachable):
        client_of(serving(BODY, [], fail=True)).job(ID).download_model(target)
    assert target.read_bytes() == b"the previous model"
    assert [p.name for p in tmp_path.iterdir()] == ["m.keras"]


def run_cli(argv: list[str], transport: httpx.MockTransport, monkeypatch: pytest.MonkeyPatch) -> int:
    """`mpjobs ARGV` with its client on `transport`."""
    real = mpjobs.Client

    def on_transport(url: str, api_key: str | None, timeout: float) -> mpjobs.Client:
        return real(url, api_key, timeout, transport=transport)

    monkeypatch.setattr("mpjobs.cli.Client", on_transport)
    return main(argv)


def test_cli_download_writes_id_keras_here_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert run_cli(["download", ID], serving(BODY, []), monkeypatch) == Exit.OK
    assert (tmp_path / f"{ID}.keras").read_bytes() == BODY
    assert capsys.readouterr().out == f"{ID}.keras\n"


def test_cli_download_o_writes_the_path_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "out.keras"
    assert run_cli(["download", ID, "-o", str(target)], serving(BODY, []), monkeypatch) == Exit.OK
    assert target.read_bytes() == BODY
    assert capsys.readouterr().out == f"{target}\n"


def test_cli_download_of_a_job_with_no_model_exits_not_found_with_the_apis_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert run_cli(["download", ID], serving(None, []), monkeypatch) == Exit.NOT_FOUND
    assert capsys.readouterr().err == f"mpjobs: {NOT_YET}\n"
    assert list(tmp_path.iterdir()) == []
