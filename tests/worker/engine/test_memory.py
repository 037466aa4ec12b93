"""worker/engine/memory.py: free memory as a container sees it, the check before training, the release after a job."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import keras
import pytest

from app.core.errors import JobFailed, OutOfMemory
from mpjobs.contract.jobs import FailureReason
from tests.worker.conftest import Train, spec_of
from worker.engine import memory
from worker.engine.memory import check_fits, free_gpu, free_ram
from worker.engine.models import build_model
from worker.engine.optimizers import make_optimizer
from worker.engine.training import release_memory

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
    assert not list(out.glob("checkpoint*.npz"))


MLP_TRAINABLE = 1024 * 1024 + 1024 + 1024 * 10 + 10
"""mlp(input_dim=1024, hidden_units=1024, classes=10): its two Dense layers' kernels and biases."""
MLP_OUTPUTS = 1024 + 1024 + 10 + 10
"""Per sample: the input, the hidden Dense, the last Dense, the float32 softmax."""


def by_hand_gib(value: int) -> str:
    return f"{value / GIB:.2g} GiB"  # all the sizes here are under 1 GiB


@pytest.mark.parametrize("devices", [1, 2])
def test_on_a_gpu_a_model_is_checked_against_the_gpus_free_memory(monkeypatch: pytest.MonkeyPatch,
                                                                  devices: int) -> None:
    """float32 and Adam, 256 rows a step: gradients (4 bytes a weight) and the kept outputs with their gradients
    (4 bytes each, x 2), per GPU: each GPU holds a whole replica and trains its share of the rows."""
    spec = spec_of(model={"name": "mlp", "input_dim": 1024, "hidden_units": 1024, "classes": 10},
                   training={"batch_size": 256, "devices": devices})
    keras.utils.set_random_seed(0)
    model = build_model(spec, on_cpu_tf=True).model
    optimizer = make_optimizer(spec)
    optimizer.build(model.trainable_variables)
    gradients, activations = MLP_TRAINABLE * 4, 256 // devices * MLP_OUTPUTS * 4 * 2
    needed = gradients + activations

    def no_ram() -> None:
        raise AssertionError("a GPU job was checked against the host's RAM")

    monkeypatch.setattr(memory, "free_ram", no_ram)
    monkeypatch.setattr(memory, "free_gpu", lambda: (needed, "GPU memory"))
    check_fits(model, optimizer, spec, "gpu")  # exactly what it needs: it fits
    monkeypatch.setattr(memory, "free_gpu", lambda: (needed - 1, "GPU memory"))
    with pytest.raises(OutOfMemory):
        check_fits(model, optimizer, spec, "gpu")
    free = needed // 3
    monkeypatch.setattr(memory, "free_gpu", lambda: (free, "GPU memory"))
    with pytest.raises(OutOfMemory) as raised:
        check_fits(model, optimizer, spec, "gpu")
    assert raised.value.reason is FailureReason.OUT_OF_MEMORY
    built = 3 * MLP_TRAINABLE * 4  # the weights and Adam's two slots (its step counter is below the rounding)
    assert raised.value.message == (
        f"Out of memory before training: this float32 model of {MLP_TRAINABLE:,} parameters needs about "
        f"{by_hand_gib(needed)} more to train (gradients {by_hand_gib(gradients)}, activations for "
        f"training.batch_size=256 {by_hand_gib(activations)}) beyond its {by_hand_gib(built)} of weights and "
        f"optimizer state, and the worker has {by_hand_gib(free)} of GPU memory free. "
        "Fix: a smaller training.batch_size or model, or a worker with more memory.")


def test_free_gpu_memory_is_the_allocators_limit_less_what_it_holds(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    import tensorflow as tf

    if not tf.config.list_physical_devices("GPU"):  # this machine: no GPU, so no figure, and no check
        with caplog.at_level(logging.WARNING, logger="worker.engine.memory"):
            assert free_gpu() is None
        assert "free GPU memory unknown; training without the memory check" in caplog.text
    else:
        found = free_gpu()
        assert found is not None and 0 < found[0] <= memory._tensorflow_gpu_limit() and found[1] == "GPU memory"
    # The figure, from what TensorFlow's allocator was given and what it holds now.
    monkeypatch.setattr(memory, "_tensorflow_gpu_limit", lambda: 80 * GIB)
    monkeypatch.setattr(tf.config.experimental, "get_memory_info",
                        lambda device: {"current": 30 * GIB, "peak": 50 * GIB} if device == "GPU:0" else {})
    assert free_gpu() == (50 * GIB, "GPU memory")


def live_step_graphs() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o).__name__ == "FuncGraph"
               and o.name in ("one_step_on_data", "steps_on_data"))


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
