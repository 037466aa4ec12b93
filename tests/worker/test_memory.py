"""worker/memory.py: free memory as a container sees it, the check before training, the release after a job."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from app.core.errors import FailureReason, JobFailed
from tests.worker.conftest import Train, spec_of
from worker.engine import release_memory
from worker.memory import free_ram

GIB = 2**30
MEMINFO = "MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"
HOST_AVAILABLE = 20_000_000 * 1024


def fake_host(tmp_path: Path, cgroup_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(MEMINFO)
    (proc / "self" / "cgroup").write_text(cgroup_line)
    for name, text in files.items():
        (cgroup / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroup / name).write_text(text)
    return proc, cgroup


def test_without_a_cgroup_limit_free_ram_is_memavailable(tmp_path: Path) -> None:
    proc, cgroup = fake_host(tmp_path, "0::/\n", {"memory.max": "max\n", "memory.current": "123\n"})
    assert free_ram(proc, cgroup) == (HOST_AVAILABLE, "RAM (MemAvailable)")


def test_a_cgroup_v2_limit_counts_usage_less_reclaimable_page_cache(tmp_path: Path) -> None:
    """4 GiB limit, 3 GiB charged of which 1 GiB is inactive page cache: 2 GiB free."""
    proc, cgroup = fake_host(tmp_path, "0::/jobs/worker\n", {
        "jobs/worker/memory.max": f"{4 * GIB}\n", "jobs/worker/memory.current": f"{3 * GIB}\n",
        "jobs/worker/memory.stat": f"anon {2 * GIB}\ninactive_file {GIB}\nactive_file 0\n"})
    assert free_ram(proc, cgroup) == (2 * GIB, "RAM under this container's memory limit")


def test_a_cgroup_v1_limit_and_its_no_limit_value(tmp_path: Path) -> None:
    proc, cgroup = fake_host(tmp_path, "4:memory:/docker/abc\n1:cpu:/\n", {
        "memory/docker/abc/memory.limit_in_bytes": f"{8 * GIB}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{5 * GIB}\n",
        "memory/docker/abc/memory.stat": f"cache {GIB}\ntotal_inactive_file {GIB // 2}\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n"})
    assert free_ram(proc, cgroup) == (3 * GIB + GIB // 2, "RAM under this container's memory limit")
    (cgroup / "memory/docker/abc/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert free_ram(proc, cgroup) == (HOST_AVAILABLE, "RAM (MemAvailable)")


def test_a_model_whose_training_cannot_fit_fails_out_of_memory_before_any_step(train: Train, tmp_path: Path) -> None:
    """One attention layer over 8192 tokens in 128 heads: its scores and their softmax are 2 x 128 x 8192²
    values per sample. Counted by hand for 64 rows in float32, kept and with their gradients (x 2): 8 TiB."""
    t, d, heads, ffn = 8192, 128, 128, 8
    per_sample = (t + 2 * t * d  # tokens, Embedding, PositionEmbedding
                  + (t * d + 3 * t * d + 2 * heads * t * t + t * d)  # attention: output, q/k/v, scores, softmax, values
                  + t * d + t * ffn + t * d + t * d + t * d  # LayerNorm, Dense, Dense, Dropout, LayerNorm
                  + d + 2 + 2)  # GlobalAveragePooling1D, Dense, softmax
    activations = 64 * per_sample * 4 * 2
    spec = spec_of(model={"name": "transformer", "seq_len": t, "vocab_size": 2, "d_model": d, "heads": heads,
                          "layers": 1, "ffn_dim": ffn, "classes": 2}, training={"batch_size": 64, "steps": 5})
    out = tmp_path / "never-trained"
    with pytest.raises(JobFailed) as raised:
        train(spec, out=out)
    assert raised.value.reason is FailureReason.OUT_OF_MEMORY
    message = raised.value.message
    assert message.startswith("Out of memory before training: this float32 model of ")
    assert f"activations for training.batch_size=64 {activations / GIB:.1f} GiB" in message, message
    assert "of RAM" in message and message.endswith("Fix: a smaller training.batch_size or model, or a worker with "
                                                    "more memory.")
    assert not (out / "checkpoint.npz").exists()


def live_step_graphs() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o).__name__ == "FuncGraph" and o.name == "one_step_on_data")


def test_release_drops_the_graphs_tensorflow_keeps_after_a_job(train: Train) -> None:
    """Each traced train step registers a custom gradient in TensorFlow's global registry; its closure holds
    the step's graph, and with it every variable the graph captured. Keras's clear_session leaves it."""
    from tensorflow.python.framework import ops

    def custom_gradients() -> list[str]:
        return [name for name in ops._gradient_registry._registry if name.startswith("CustomGradient-")]

    train(spec_of(training={"steps": 2}, dataset={"samples": 64}))
    import keras

    keras.backend.clear_session(free_memory=True)  # all that release_memory did before
    assert custom_gradients() and live_step_graphs() > 0
    release_memory()
    assert custom_gradients() == [] and live_step_graphs() == 0
