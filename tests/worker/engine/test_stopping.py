"""An attempt stops wherever it is: in each phase without steps, by the watcher's interrupt; stuck, by exit.

The service tests (tests/processes/test_hostile_jobs.py) cancel and time out a real model build
in a live worker. Here: the phases a live job passes too quickly to catch from outside (data
preparation, the speed check), each interrupted as it begins; and the watcher's rules, timed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from redis import Redis

from app.core.config import Settings
from app.store import JobStore
from app.store.keys import job_key
from mpjobs.contract.jobs import JobState
from scripts.stack import RedisServer, wait_until
from tests.worker.conftest import spec_of
from worker.engine import stopping as interrupt
from worker.engine import training as engine
from worker.engine.stopping import CancelInterrupt, DeadlineInterrupt, Interrupted, Interrupter, TimeLimit
from worker.service import watcher as attempt_watch
from worker.service.watcher import CANCEL_GRACE_S, CANCEL_POLL_S, AttemptWatcher
from worker.telemetry.reporters import ListReporter


def interrupted_at(monkeypatch: pytest.MonkeyPatch, interrupter: Interrupter, target: str) -> None:
    """Make the engine interrupt itself as it enters phase `target`, as the watcher would from its thread."""
    set_phase, phase = interrupt.set_phase, interrupt.phase

    def set_and_interrupt(name: str) -> None:
        set_phase(name)
        if name == target:
            interrupter.interrupt(CancelInterrupt)

    def phase_and_interrupt(name: str) -> AbstractContextManager[None]:
        manager = phase(name)
        if name == target:
            interrupt.set_phase(name)
            interrupter.interrupt(CancelInterrupt)
        return manager

    monkeypatch.setattr(engine, "set_phase", set_and_interrupt)
    monkeypatch.setattr(engine, "phase", phase_and_interrupt)


@pytest.mark.parametrize(("target", "steps_before"), [
    ("building the model", 0),
    ("preparing the data", 0),
    ("measuring speed against float32", 8),
])
def test_an_interrupt_stops_the_engine_in_each_phase_without_steps(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, target: str, steps_before: int) -> None:
    # mixed_bfloat16 on a CPU: the job times its policy against float32 after it trains (worker/numerics/speed.py).
    spec = spec_of(precision_policy="mixed_bfloat16", training={"steps": 8, "batch_size": 8},
                   dataset={"samples": 64}, model={"name": "mlp", "input_dim": 16, "hidden_units": 8})
    settings = Settings(artifacts_dir=tmp_path, data_root=tmp_path, speed_check_steps=1)
    reporter, interrupter = ListReporter(), Interrupter()
    interrupted_at(monkeypatch, interrupter, target)
    with pytest.raises(CancelInterrupt), interrupter:
        engine.run_job(spec, reporter=reporter, checkpoint_dir=tmp_path / "run", settings=settings)
    assert interrupter.where == target
    assert len(reporter.records) == steps_before


@pytest.fixture
def store(server: RedisServer) -> Iterator[JobStore]:
    client = Redis.from_url(server.url, decode_responses=True)
    client.flushdb()
    try:
        yield JobStore(client)
    finally:
        client.close()


def watched(store: JobStore, work: Callable[[], object], limit: TimeLimit | None = None,
            stuck: list[type[Interrupted]] | None = None) -> tuple[threading.Thread, list[BaseException]]:
    """`work` on a thread inside an Interrupter, watched as a running job's attempt is."""
    ended: list[BaseException] = []
    interrupter = Interrupter()
    watcher = AttemptWatcher(store, "job1", "here:1", lease_s=30, limit=limit, interrupter=interrupter,
                                   on_stuck=None if stuck is None else stuck.append)

    def run() -> None:
        with watcher:
            try:
                with interrupter:
                    work()
            except BaseException as exc:  # noqa: BLE001  what the attempt saw
                ended.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, ended


def busy(seconds: float) -> Callable[[], None]:
    def work() -> None:  # Python bytecode all along, like Keras loading a config
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pass
    return work


def test_a_cancel_outside_training_interrupts_the_attempt_at_once(store: JobStore) -> None:
    interrupt.set_phase("building the model")
    thread, ended = watched(store, busy(30))
    asked = time.monotonic()
    store.cancels.request_cancel("job1")
    thread.join(timeout=5)
    assert not thread.is_alive(), "a cancel while building the model was not honoured within 5 s"
    assert [type(e) for e in ended] == [CancelInterrupt]
    assert time.monotonic() - asked < CANCEL_POLL_S * 4 + 1


def test_a_cancel_during_training_gets_its_grace_period_first(store: JobStore) -> None:
    interrupt.set_phase("training")
    thread, ended = watched(store, busy(30))
    asked = time.monotonic()
    store.cancels.request_cancel("job1")
    thread.join(timeout=CANCEL_GRACE_S + 5)
    assert [type(e) for e in ended] == [CancelInterrupt]
    assert time.monotonic() - asked >= CANCEL_GRACE_S  # the step had its chance to end by itself


def test_past_the_time_limit_outside_training_the_attempt_is_interrupted(store: JobStore) -> None:
    interrupt.set_phase("preparing the data")
    limit = TimeLimit(1, "MAX_JOB_SECONDS", time.monotonic() + 1)
    thread, ended = watched(store, busy(30), limit=limit)
    thread.join(timeout=6)
    assert [type(e) for e in ended] == [DeadlineInterrupt]
    assert time.monotonic() >= limit.deadline


def test_an_attempt_that_ignores_its_interrupt_is_abandoned(monkeypatch: pytest.MonkeyPatch,
                                                            store: JobStore) -> None:
    monkeypatch.setattr(attempt_watch, "STUCK_S", 0.5)
    interrupt.set_phase("building the model")
    stuck: list[type[Interrupted]] = []
    gate = threading.Lock()
    gate.acquire()
    # One C call that returns only when the test lets it: no bytecode for the interrupt to land on.
    thread, _ = watched(store, gate.acquire, stuck=stuck)
    store.cancels.request_cancel("job1")
    try:
        wait_until(lambda: stuck, timeout=10, what="the stuck attempt to be abandoned")
        assert stuck[0] is CancelInterrupt
    finally:
        gate.release()
    thread.join(timeout=10)


def test_the_phase_is_published_with_the_job(store: JobStore) -> None:
    store.redis.hset(job_key("job1"), mapping={"state": JobState.RUNNING.value})
    interrupt.set_phase("preparing the data")
    released = threading.Event()
    thread, _ = watched(store, lambda: released.wait(30))  # runs until the phase is seen, however long that takes
    try:
        wait_until(lambda: store.redis.hget(job_key("job1"), "phase") == "preparing the data", timeout=10,
                   what="the phase in the job's record")
    finally:
        released.set()
    thread.join(timeout=5)
