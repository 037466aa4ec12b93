"""Memory: will a built model fit where it trains, and does the worker give it all back after the job.

`check_fits` runs once the model and its optimizer are built, before the data is made or a step runs:
what training still needs (gradients, one batch's activations, the float32 check's twin; the
weights and optimizer state are already allocated) against what is free where the model trains,
a GPU's allocator or the host's RAM (`MemAvailable`, or the container's cgroup limit less its usage).
Too much fails the job with `out_of_memory` at once, naming the sizes, instead of deep in a step.

`release` runs after every job. Keras's `clear_session` is not enough under TensorFlow:

- every traced train step registers its all-reduce's custom gradient in TensorFlow's global gradient
  registry, whose closure holds the step's graph and so every variable it captured: each job's
  model and optimizer stayed in the worker for good (about a model's size per job, measured);
- freed memory stays in the C allocator; `malloc_trim(0)` hands it back to the system.

`tune_allocator` makes the second point work: it runs first thing in a worker process, before
TensorFlow loads. oneDNN's own CPU allocator keeps a pool of every buffer it ever held (an idle
worker kept its largest job's peak), so TensorFlow is told to use the C allocator, and that one
keeps its large buffers in one arena instead of mapping and unmapping them each step (which made
a step of a 16M-weight mlp twice as slow); `malloc_trim` then returns them after the job.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from app.core.errors import OutOfMemory
from app.core.model_size import ModelSize, attention_elements, estimate, gib
from mpjobs.contract.spec import JobSpec

log = logging.getLogger(__name__)

NO_LIMIT = 2**60
"""A cgroup limit at or above this is cgroup v1's way of saying "none" (9223372036854771712)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters
_LARGEST_INT = 2**31 - 1
ITEM_BYTES = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "int16": 2,
              "int8": 1, "uint8": 1, "bool": 1}


def tune_allocator() -> None:
    """Before TensorFlow loads: the C allocator for TensorFlow's CPU buffers, kept in one arena without
    per-buffer mappings or automatic trimming, so that `release` can return a job's memory. Linux/glibc
    only; an operator's own TF_ONEDNN_USE_SYSTEM_ALLOCATOR wins."""
    os.environ.setdefault("TF_ONEDNN_USE_SYSTEM_ALLOCATOR", "1")
    libc = _glibc()
    if libc is None:
        return
    for parameter, value in ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _LARGEST_INT), (_M_TRIM_THRESHOLD, _LARGEST_INT)):
        if libc.mallopt(parameter, value) != 1:
            log.warning("mallopt(%d, %d) refused: memory may stay with the worker after a job", parameter, value)


def release() -> None:
    """After a job (Keras's session already cleared): drop its traced gradients, collect, trim."""
    if "tensorflow" in sys.modules:
        _drop_custom_gradients()
    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _drop_custom_gradients() -> None:
    """TensorFlow registers each `tf.custom_gradient` traced in a graph (the default strategy's all-reduce,
    in every train step) as "CustomGradient-N", for good. Only the graph that made one uses it."""
    from tensorflow.python.framework import ops

    registry: dict[str, Any] = ops._gradient_registry._registry  # noqa: SLF001  no public way to drop one
    for name in [name for name in registry if name.startswith("CustomGradient-")]:
        del registry[name]


def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


# --- what is free ----------------------------------------------------------------------------------


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    """A `key value` file's value (memory.stat, /proc/meminfo's `MemAvailable:   123 kB`); 0 if absent."""
    try:
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[0] == key:
                return int(fields[1])
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_free(root: Path, own: dict[str, Path]) -> int | None:
    """The memory limit of this process's cgroup less what it uses (page cache it can drop excluded);
    None without a limit. `own`: this process's cgroup path by version ("v1" for the memory controller)."""
    free: list[int] = []
    v2, v1 = own.get("v2", Path("/")).relative_to("/"), own.get("v1", Path("/")).relative_to("/")
    for group in (root / v2, root):
        limit = _read_int(group / "memory.max")  # "max" reads as None
        if limit is not None and limit < NO_LIMIT:
            free.append(limit - (_read_int(group / "memory.current") or 0)
                        + _stat(group / "memory.stat", "inactive_file"))
    for group in (root / "memory" / v1, root / "memory"):
        limit = _read_int(group / "memory.limit_in_bytes")
        if limit is not None and limit < NO_LIMIT:
            free.append(limit - (_read_int(group / "memory.usage_in_bytes") or 0)
                        + _stat(group / "memory.stat", "total_inactive_file"))
    return max(0, min(free)) if free else None


def free_ram(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> tuple[int, str] | None:
    """(bytes free for this process, where that was read), or None off Linux.

    The host's `MemAvailable`, or less where this process's cgroup (a container's memory limit) allows less.
    """
    available = _stat(proc / "meminfo", "MemAvailable:") * 1024 or None
    own: dict[str, Path] = {}
    try:
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                own["v2"] = Path(path)
            elif "memory" in controllers.split(","):
                own["v1"] = Path(path)
    except (OSError, ValueError):
        pass
    limited = _cgroup_free(cgroup, own)
    if limited is not None and (available is None or limited < available):
        return limited, "RAM under this container's memory limit"
    return (available, "RAM (MemAvailable)") if available is not None else None


def free_gpu() -> tuple[int, str] | None:
    """Bytes the backend's allocator can still hand out on the first GPU, or None where it cannot say."""
    import keras

    try:
        if keras.backend.backend() == "jax":
            import jax

            stats = jax.local_devices()[0].memory_stats() or {}
            if "bytes_limit" in stats:
                return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), "GPU memory"
            return None
        import tensorflow as tf

        return _tensorflow_gpu_limit() - int(tf.config.experimental.get_memory_info("GPU:0")["current"]), "GPU memory"
    except Exception:  # a diagnostic: without an answer the job trains unchecked
        log.warning("free GPU memory unknown; training without the memory check", exc_info=True)
        return None


@functools.cache
def _tensorflow_gpu_limit() -> int:
    """What TensorFlow's allocator may hold on the first GPU, fixed when TensorFlow started."""
    from tensorflow.python.client import device_lib

    return next(int(d.memory_limit) for d in device_lib.list_local_devices() if d.device_type == "GPU")


# --- what training needs -----------------------------------------------------------------------------


def _elements(tensor: Any) -> int:
    return math.prod(int(d) for d in tuple(tensor.shape)[1:] if d is not None)


def _attention_inside(layer: Any, node: Any) -> int:
    """MultiHeadAttention's inner tensors per sample, as app/core/model_size.py counts them."""
    config = layer.get_config()
    query, *rest = node.input_tensors
    value = rest[0] if rest else query
    heads, key_dim = int(config["num_heads"]), int(config["key_dim"])
    return attention_elements(_elements(query) // int(query.shape[-1]), _elements(value) // int(value.shape[-1]), heads,
                      key_dim, int(config.get("value_dim") or key_dim), float(config.get("dropout") or 0) > 0)


def activation_elements(model: Any) -> int:
    """Per sample: the model's inputs, every layer's outputs (each call of a shared layer, the layers of a
    nested model), and attention's inner tensors."""
    import keras

    def layers(m: Any) -> int:
        total = 0
        for layer in m.layers:
            if isinstance(layer, keras.layers.InputLayer):
                continue
            if isinstance(layer, keras.Model):
                total += layers(layer)
                continue
            for node in layer._inbound_nodes:  # noqa: SLF001  each call of the layer
                total += sum(_elements(t) for t in node.output_tensors)
                if isinstance(layer, keras.layers.MultiHeadAttention):
                    total += _attention_inside(layer, node)
        return total

    return sum(_elements(t) for t in model.inputs) + layers(model)


def _nbytes(variables: Any) -> int:
    return sum(math.prod(v.shape) * ITEM_BYTES.get(str(v.dtype), 4) for v in variables)


def check_fits(model: Any, optimizer: Any, spec: JobSpec, device_kind: str,
               free: tuple[int, str] | None = None) -> None:
    """Raise `OutOfMemory` when training `model` would need more than is free where it trains.

    `free` is (bytes, where) for tests; by default the first GPU's, or the host's RAM on a CPU.
    """
    trainable = sum(math.prod(v.shape) for v in model.trainable_variables)
    size = ModelSize(model.count_params(), trainable, activation_elements(model))
    memory = estimate(spec, size)
    replicas = spec.training.devices if device_kind == "cpu" else 1  # a CPU's logical devices share its RAM
    gradients = memory.gradients * replicas
    activations = memory.activations * replicas
    needed = gradients + activations + memory.float32_twin
    if free is None:
        free = free_gpu() if device_kind == "gpu" else free_ram()
    if free is None or needed <= free[0]:
        return
    built = _nbytes(model.weights) + _nbytes(optimizer.variables)
    parts = [("gradients", gradients), (f"activations for training.batch_size={spec.training.batch_size}",
                                        activations), ("the float32 check's twin", memory.float32_twin)]
    listed = ", ".join(f"{name} {gib(value)}" for name, value in parts if value)
    raise OutOfMemory(
        f"Out of memory before training: this {spec.precision_policy.value} model of {size.parameters:,} "
        f"parameters needs about {gib(needed)} more to train ({listed}) beyond its {gib(built)} of weights and "
        f"optimizer state, and the worker has {gib(free[0])} of {free[1]} free. "
        "Fix: a smaller training.batch_size or model, or a worker with more memory.")
