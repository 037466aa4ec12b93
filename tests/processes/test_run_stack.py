"""`make run`'s script starts Redis, the API and a worker, prints the curl, and stops cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest

from scripts.stack import ROOT
from tests.processes.conftest import RedisServer, free_port, wait_until


@contextmanager
def run_stack(log: Path, stop: signal.Signals = signal.SIGTERM, **env: str) -> Iterator[subprocess.Popen[bytes]]:
    """scripts/run-stack.sh with `env` (and this interpreter), its output in `log`; `stop` sent to all of it."""
    clean = {k: v for k, v in os.environ.items() if k not in {"REDIS_URL", "API_KEYS", "HOST"}}
    clean.update(PY=sys.executable, TF_CPP_MIN_LOG_LEVEL="2", **env)
    with open(log, "w") as out:
        process = subprocess.Popen([str(ROOT / "scripts/run-stack.sh")], cwd=ROOT, env=clean, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield process
    finally:
        with suppress(ProcessLookupError):  # the script may have ended, and stopped its processes, itself
            os.killpg(process.pid, stop)
        process.wait(30)


def test_run_stack_starts_everything_and_prints_the_curl(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "run.log"
    with run_stack(log, PORT=str(port)):
        wait_until(lambda: "curl -N" in log.read_text(), 120, "the ready message")
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz").json()
        assert ready["status"] == "ok" and ready["workers"]["cpu"] == 1
        text = log.read_text()
        assert "local redis-server at redis://127.0.0.1:" in text
        assert "-d @examples/mlp_mixed_float16.json" in text
        assert "API_KEYS is not set" not in text, "the default host is loopback: nothing to warn of"
    time.sleep(0.5)
    try:
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        raise AssertionError("the API still answers after the stack was stopped")
    except httpx.ConnectError:
        pass


LISTEN, TIME_WAIT = "0A", "06"  # TCP states as Linux's /proc/net/tcp writes them


def sockets_in(state: str, port: int) -> set[str]:
    """The local addresses of the TCP sockets in `state` on local `port` (/proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, socket_state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if socket_state == state and int(hex_port, 16) == port:
                found.add(address)
    return found


def closed_by_the_server(port: int) -> None:
    """One request with `Connection: close`, read to the end: the API closes first, so the connection
    stays in TIME_WAIT on the API's own port."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        while client.recv(4096):
            pass


def test_started_again_right_after_a_stop_it_starts_on_the_same_port(tmp_path: Path) -> None:
    """The connections of the first run's readiness checks are left in TIME_WAIT on the API's port
    for a minute; the port check took them for a program holding it, so a restart always failed."""
    port = free_port()
    with run_stack(tmp_path / "first.log", PORT=str(port)):
        wait_until(lambda: "curl -N" in (tmp_path / "first.log").read_text(), 120, "the first run's ready message")
        closed_by_the_server(port)  # as a check with `Connection: close` does; who closes first varies otherwise
    wait_until(lambda: sockets_in(TIME_WAIT, port), 5, "a TIME_WAIT connection on the API's port", 0.01)
    log = tmp_path / "second.log"
    with run_stack(log, PORT=str(port)) as script:
        wait_until(lambda: "curl -N" in log.read_text() or script.poll() is not None, 120, "the second run's end")
        assert "curl -N" in log.read_text(), log.read_text()
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").json()["status"] == "ok"


def test_the_port_check_ignores_time_wait_and_finds_a_listener_on_the_address_or_on_all(tmp_path: Path) -> None:
    def check(host: str, port: int) -> int:
        return subprocess.run([sys.executable, str(ROOT / "scripts/port_owner.py"), host, str(port), "the API"],
                              capture_output=True, timeout=30).returncode

    for bound, asked in [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "127.0.0.1"), ("127.0.0.1", "0.0.0.0")]:
        with socket.socket() as listener:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and redis-server do
            listener.bind((bound, 0))
            listener.listen()
            assert check(asked, listener.getsockname()[1]) == 1, f"a listener on {bound} was not seen from {asked}"
    with socket.socket() as listener:  # a connection the server closed first stays in TIME_WAIT on its port
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()
        client.recv(1)
        client.close()
    wait_until(lambda: sockets_in(TIME_WAIT, port) == {"0100007F"}, 5, "the server's side in TIME_WAIT", 0.01)
    assert check("127.0.0.1", port) == 0 and check("0.0.0.0", port) == 0


def pid_of_child(parent: int, *argv: str) -> int:
    """The pid of the child of `parent` whose command line holds `argv` (from /proc)."""
    for proc in Path("/proc").iterdir():
        with suppress(OSError, ValueError):
            if int((proc / "stat").read_text().rpartition(")")[2].split()[1]) == parent:
                args = (proc / "cmdline").read_bytes().decode().split("\0")
                if any(args[i:i + len(argv)] == list(argv) for i in range(len(args))):
                    return int(proc.name)
    raise AssertionError(f"no child of {parent} runs {' '.join(argv)}")


def test_a_process_that_exits_once_the_stack_is_ready_fails_the_script_with_its_own_last_lines(
        tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "run.log"
    with run_stack(log, PORT=str(port)) as script:
        wait_until(lambda: "curl -N" in log.read_text(), 120, "the ready message")
        os.kill(pid_of_child(script.pid, "-m", "worker"), signal.SIGKILL)
        code = script.wait(15)  # within seconds; the rest of the stack stopped with it
        text = log.read_text()
    assert code == 1, text
    assert "mpjobs: the worker exited (code 137); stopping the stack. The last lines of var/log/worker.log:" in text
    worker_lines = [line for line in (ROOT / "var/log/worker.log").read_text().splitlines() if line.strip()]
    assert worker_lines and f"\n    {worker_lines[-1]}\n" in text, text  # the worker's own last line, indented
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on `port`."""
    return sockets_in(LISTEN, port)


def test_without_api_keys_a_public_host_falls_back_to_loopback_with_a_warning(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "run.log"
    with run_stack(log, PORT=str(port), HOST="0.0.0.0"):
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200, 120, "the API")
        assert listening_addresses(port) == {"0100007F"}, "the API listens on 127.0.0.1 only"
        assert "mpjobs: API_KEYS is not set, so the API stays on 127.0.0.1 (not 0.0.0.0)\n" in log.read_text()


@pytest.mark.parametrize(("stop", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stopped_before_it_is_ready_the_script_exits_at_once(tmp_path: Path, stop: signal.Signals,
                                                             status: int) -> None:
    """Ctrl-C during start-up ends the script, not only its children: it used to return into its
    readiness loop and poll for about 90 s."""
    log = tmp_path / "run.log"
    clean = {k: v for k, v in os.environ.items() if k not in {"REDIS_URL", "API_KEYS", "HOST"}}
    clean.update(PY=sys.executable, TF_CPP_MIN_LOG_LEVEL="2", PORT=str(free_port()))
    with open(log, "w") as out:
        process = subprocess.Popen([str(ROOT / "scripts/run-stack.sh")], cwd=ROOT, env=clean, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: "local redis-server at" in log.read_text(), 60, "the script's redis-server")
        os.killpg(process.pid, stop)
        assert process.wait(20) == status
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)


def finished(log: Path, stop_after: float = 30, **env: str) -> tuple[int, str, float]:
    """Run the script to its end: (exit code, its output, seconds it took)."""
    clean = {k: v for k, v in os.environ.items() if k not in {"REDIS_URL", "API_KEYS", "HOST"}}
    clean.update(PY=sys.executable, TF_CPP_MIN_LOG_LEVEL="2", **env)
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen([str(ROOT / "scripts/run-stack.sh")], cwd=ROOT, env=clean, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = process.wait(stop_after)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
    return code, log.read_text(), time.monotonic() - started


def test_a_taken_api_port_fails_at_once_naming_the_program_that_holds_it(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, text, took = finished(tmp_path / "run.log", PORT=str(port))
    assert code == 1 and took < 10, (code, took, text)
    assert f"mpjobs: port {port} on 127.0.0.1, wanted for the API, is already taken by " in text
    assert f"(pid {os.getpid()})" in text, text  # this test's own process holds it
    assert "local redis-server at" not in text and "API at" not in text  # nothing of its own was started


def test_a_taken_redis_port_is_named_and_no_service_is_announced(tmp_path: Path) -> None:
    other = RedisServer(tmp_path / "other")
    (tmp_path / "other").mkdir()
    other.start()
    try:
        code, text, took = finished(tmp_path / "run.log", PORT=str(free_port()), REDIS_PORT=str(other.port))
    finally:
        other.stop()
    assert code == 1 and took < 10, (code, took, text)
    assert f"mpjobs: port {other.port} on 127.0.0.1, wanted for redis-server, is already taken by redis-server" in text
    assert "REDIS_PORT=<port> make run" in text
    assert "local redis-server at" not in text and "API at" not in text


def test_a_process_that_dies_at_start_fails_fast_with_its_own_last_lines(tmp_path: Path) -> None:
    # A malformed API_KEYS makes the API exit as it imports the app, after Redis has started.
    code, text, took = finished(tmp_path / "run.log", stop_after=60, PORT=str(free_port()), API_KEYS="no-tenant")
    assert code == 1, text
    assert took < 15, f"{took:.0f} s: the script waited for a process that had died"
    assert "mpjobs: the API exited (code 1); stopping the stack. The last lines of var/log/api.log:" in text
    assert "API_KEYS entry 1 must be 'key:tenant'." in text  # the API's own error, from its log
    assert "API at" not in text


def test_settings_come_from_the_env_file_and_the_environment_wins(tmp_path: Path) -> None:
    port, overridden = free_port(), free_port()
    env_file = tmp_path / "env"
    env_file.write_text(f"# as .env.example writes them\nREDIS_URL=\nPORT={overridden}\nAPI_KEYS=\"k1:team\"\n")
    log = tmp_path / "run.log"
    with run_stack(log, ENV_FILE=str(env_file), PORT=str(port)):  # PORT from the environment wins
        wait_until(lambda: "curl -N" in log.read_text(), 120, "the ready message")
        # API_KEYS came from the file: the API wants the key (and the script's readiness check sent it).
        assert httpx.get(f"http://127.0.0.1:{port}/jobs").status_code == 401
        assert httpx.get(f"http://127.0.0.1:{port}/jobs", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert not listening_addresses(overridden)
