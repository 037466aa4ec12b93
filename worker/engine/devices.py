"""Which device trains, and whether it computes a precision fast.

The only module allowed backend-specific calls: TensorFlow's or JAX's device
queries, imported lazily so the rest of the engine stays backend-neutral.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import keras

from app.core.config import get_settings
from app.core.errors import JobFailed
from mpjobs.contract.formats import ratio_range, speed_words
from mpjobs.contract.records import PrecisionSpeed

FAST_FLOAT16_MIN_CC = (7, 0)
"""Tensor cores for float16 arrived with Volta (compute capability 7.0)."""
FAST_BFLOAT16_MIN_CC = (8, 0)
"""bfloat16 tensor cores arrived with Ampere (compute capability 8.0)."""
CPU_HALF_FLAGS = ("avx512_fp16", "amx_fp16", "avx512_bf16", "amx_bf16")
SLOW_RATIO = 1.5
"""On a CPU, a policy whose whole measured interval is this many times slower than float32 (and
beyond the A/A noise) earns `slow_precision_on_device`."""


@dataclass(frozen=True)
class DeviceInfo:
    kind: str
    """"cpu" or "gpu"."""
    name: str
    backend: str
    compute_capability: tuple[int, int] | None = None
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    count: int = 1
    """Devices one job can train on here (`training.devices`): the visible GPUs, else the logical CPUs."""

    def describe(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "name": self.name,
            "backend": self.backend,
            "compute_capability": ".".join(map(str, self.compute_capability)) if self.compute_capability else None,
            "half_precision_flags": sorted(self.cpu_flags & set(CPU_HALF_FLAGS)),
        }


def _cpu_info() -> tuple[str, frozenset[str]]:
    name, flags = platform.processor() or platform.machine(), frozenset[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return name, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            name = value.strip()
        elif key.strip() == "flags":
            flags = frozenset(value.split())
        if name and flags:
            break
    return name, flags


def configure_cpu_devices(count: int) -> int:
    """Split the CPU into `count` TensorFlow logical devices; returns how many CPU devices there are.

    TensorFlow fixes its devices when it first uses them, so this must come first: the
    worker calls it (through `detect_device`) before its first job. Later it changes nothing.
    """
    if count <= 1 or keras.backend.backend() != "tensorflow":
        return 1
    import tensorflow as tf

    try:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError:  # already initialised: what is there stays
        pass
    return len(tf.config.list_logical_devices("CPU"))


def training_devices(count: int) -> list[str]:
    """The names of the `count` devices a job on that many trains on: GPUs, else logical CPUs."""
    import tensorflow as tf

    pool = tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("CPU")
    if len(pool) < count:
        raise JobFailed(f"training.devices={count}, but this worker has {len(pool)} device(s): "
                        f"{', '.join(d.name for d in pool)}.", None)
    return [d.name for d in pool[:count]]


def distribution(count: int) -> Any:
    """A `tf.distribute.MirroredStrategy` over this worker's first `count` devices; None for one device."""
    if count <= 1:
        return None
    if keras.backend.backend() != "tensorflow":
        raise JobFailed(f"training.devices={count} needs the tensorflow backend, not {keras.backend.backend()}.",
                        None)
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(training_devices(count))


def detect_device(cpu_devices: int | None = None) -> DeviceInfo:
    """This worker's device kind and count; on a CPU host, first splits the CPU into `cpu_devices`
    logical devices (default: the CPU_LOGICAL_DEVICES setting)."""
    backend = keras.backend.backend()
    cpu_name, flags = _cpu_info()
    if backend == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            details = tf.config.experimental.get_device_details(gpus[0])
            return DeviceInfo("gpu", details.get("device_name", "GPU"), backend, details.get("compute_capability"),
                              count=len(gpus))
        wanted = get_settings().cpu_logical_devices if cpu_devices is None else cpu_devices
        return DeviceInfo("cpu", cpu_name, backend, None, flags, count=configure_cpu_devices(wanted))
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        if device.platform == "gpu":
            major, minor = (int(p) for p in str(device.compute_capability).split(".")[:2])
            return DeviceInfo("gpu", device.device_kind, backend, (major, minor))
    return DeviceInfo("cpu", cpu_name, backend, None, flags)


def slow_precision_message(
    device: DeviceInfo, compute_dtype: str, policy: str, speed: PrecisionSpeed | None = None,
) -> str | None:
    """Plain advice when `compute_dtype` is slow on `device`, else None.

    A GPU is judged by its compute capability. A CPU is judged only by `speed`, the
    job's own measurement (worker.numerics.speed): without one there is nothing to say.
    """
    if compute_dtype == "float32":
        return None
    if device.kind == "gpu":
        need = FAST_FLOAT16_MIN_CC if compute_dtype == "float16" else FAST_BFLOAT16_MIN_CC
        cc = device.compute_capability
        if cc is None or cc >= need:
            return None
        return (
            f"{policy} computes in {compute_dtype}, but {device.name} (compute capability "
            f"{cc[0]}.{cc[1]}) has no fast {compute_dtype} units; they need {need[0]}.{need[1]} or newer. "
            "Expect no speedup over float32; keep float32 on this GPU."
        )
    if speed is None or speed.difference != "slower" or speed.interval[0] < SLOW_RATIO:
        return None
    present = sorted(device.cpu_flags & set(CPU_HALF_FLAGS))
    units = f"it has {', '.join(present)}" if present else f"it has none of {', '.join(CPU_HALF_FLAGS)}"
    low, high = speed.interval
    noise = (f"; float32 against itself: {ratio_range(speed.noise_low, speed.noise_high)}"
             if speed.noise_low is not None and speed.noise_high is not None else "")
    return (
        f"On this CPU ({device.name}; {units}) a training step of this model took {speed.policy_ms:.3g} ms "
        f"under {policy} against {speed.float32_ms:.3g} ms in float32: "
        f"{speed_words(speed.slowdown, low, high, speed.difference)}, the 95% interval of {speed.rounds} rounds "
        f"timed in turns after the run on fresh copies of the model{noise}. "
        f"{device.backend} has no fast {compute_dtype} path on this CPU for some of the ops this model uses. "
        "It runs correctly: use it on CPU to check numerics, and train for speed in float32 here "
        "or in mixed precision on a GPU."
    )
