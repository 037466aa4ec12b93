"""Archive failures lose nothing: a process SIGKILLed between writing a job's archive and trimming its Redis
streams leaves every step readable from Redis, and a later pass completes the archive."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from app.store import JobStore
from app.store.archive import LAYERS_FILE, METRICS_FILE, ROLLUPS_FILE
from app.store.keys import ENDED, archive_claim_key, layers_key, metrics_key, rollup_key
from app.store.retention import Archiver
from scripts.stack import ROOT, RedisServer, wait_until
from tests.app.store.history import ended_job


def read_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"the archiver printed nothing within {timeout} s"
    return process.stdout.readline().strip()


def test_a_kill_between_writing_the_files_and_trimming_redis_loses_nothing(server: RedisServer,
                                                                          tmp_path: Path) -> None:
    store = JobStore(server.client(), tmp_path / "artifacts")
    job_id, written, checks = ended_job(store, 5000, check_every=50)
    folder = tmp_path / "artifacts" / job_id / "history"
    folder.mkdir(parents=True)
    (folder / METRICS_FILE).write_bytes(b"PAR1 half a file from an earlier attempt")
    (folder / f".{METRICS_FILE}.99999.deadbeef.tmp").write_bytes(b"a temporary file its writer died with")
    before = (store.history.read_metrics(job_id, 0, 10_000), store.history.read_buckets(job_id, 500),
              store.history.read_layers(job_id, 0, 999))
    assert before[0].points == written, "the planted file is ignored: the record does not name an archive"

    child = subprocess.Popen([sys.executable, "-m", "tests.processes.kill_archiver", server.url,
                              str(tmp_path / "artifacts"), job_id, "1"], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert read_line(child, 60) == f"written {job_id}"
        # The files are whole, and nothing in Redis has moved yet: then the process dies.
        assert pq.read_table(folder / METRICS_FILE).num_rows == len(written)
        assert pq.read_table(folder / LAYERS_FILE).num_rows == len(checks)
        assert pq.read_table(folder / ROLLUPS_FILE).num_rows == 5000 // 64
        assert not list(folder.glob(".*.tmp")), "the dead writer's temporary file was cleared"
        child.send_signal(signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()

    # Nothing lost: the history is still in Redis, and reads come from there.
    r = store.redis
    assert r.xlen(metrics_key(job_id)) == len(written) and r.xlen(layers_key(job_id)) == len(checks)
    assert r.xlen(rollup_key(job_id)) == 5000 // 64
    assert store.history.archive_info(job_id) is None and r.zscore(ENDED, job_id) is not None
    assert (store.history.read_metrics(job_id, 0, 10_000), store.history.read_buckets(job_id, 500),
            store.history.read_layers(job_id, 0, 999)) == before

    # The dead process's claim runs out (1 s); a later pass finishes the archive.
    wait_until(lambda: Archiver(store, retention_s=0).archive(job_id) == "archived", 30, "a later archive pass")
    assert not r.exists(archive_claim_key(job_id))
    assert not r.exists(metrics_key(job_id), rollup_key(job_id), layers_key(job_id))
    store.history.archives = type(store.history.archives)()
    assert (store.history.read_metrics(job_id, 0, 10_000), store.history.read_buckets(job_id, 500),
            store.history.read_layers(job_id, 0, 999)) == before
    assert store.history.read_metrics(job_id, 0, 10_000).points == written
