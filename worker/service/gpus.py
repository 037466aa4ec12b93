"""Which GPUs this host has and which of them get a job slot, found without loading TensorFlow here.

The supervisor (worker/service/slots.py) asks before it starts any slot, and TensorFlow must not be
initialised in a process that starts others: so nvidia-smi answers, or TensorFlow in a
subprocess of its own when nvidia-smi is missing but an NVIDIA driver is there.

    >>> chosen_gpus("0,1", host_gpus="0,1,2,3")
    ['0', '1']
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("mpjobs.worker")

NVIDIA_SMI = ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]
"""nvidia-smi numbers GPUs in PCI bus order; slots get CUDA_DEVICE_ORDER=PCI_BUS_ID to match."""
TF_GPU_COUNT = "import tensorflow as tf; print(len(tf.config.list_physical_devices('GPU')))"
NVIDIA_DRIVER = Path("/proc/driver/nvidia")
"""Present when the NVIDIA kernel driver is loaded: only then is TensorFlow asked, in a subprocess
(seconds), so a CPU host without nvidia-smi starts its worker as fast as before."""
DETECT_TIMEOUT_S = 120.0


def parse_indices(text: str, setting: str) -> list[str]:
    """`0,1` -> ['0', '1']; `none` or '' -> []. Raises ValueError naming the setting."""
    text = text.strip()
    if text in ("", "none"):
        return []
    indices = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() for part in indices) or len(set(indices)) != len(indices):
        raise ValueError(f"Expected `all` or distinct GPU indices such as `0,1`. Received: {setting}={text}")
    return [str(int(part)) for part in indices]


def host_gpus(injected: str = "") -> list[str]:
    """This host's GPU indices: `injected` (the HOST_GPUS setting) when set, else detected."""
    if injected.strip():
        return parse_indices(injected, "HOST_GPUS")
    if shutil.which(NVIDIA_SMI[0]):
        try:
            out = subprocess.run(NVIDIA_SMI, capture_output=True, text=True, timeout=DETECT_TIMEOUT_S, check=True)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("nvidia-smi failed (%s); treating this host as having no GPU", exc)
            return []
        return parse_indices(",".join(line for line in out.stdout.split() if line), "nvidia-smi")
    if NVIDIA_DRIVER.exists():
        return _tensorflow_gpus()
    return []


def _tensorflow_gpus() -> list[str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    try:
        out = subprocess.run([sys.executable, "-c", TF_GPU_COUNT], capture_output=True, text=True,
                             timeout=DETECT_TIMEOUT_S, check=True, env=env)
        count = int(out.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.warning("TensorFlow could not list the GPUs (%s); treating this host as having no GPU", exc)
        return []
    return [str(i) for i in range(count)]


def chosen_gpus(worker_gpus: str, host_gpus: list[str] | str) -> list[str]:
    """The job slots, each as the CUDA_VISIBLE_DEVICES it gets: one per GPU of `host_gpus` for `all`,
    else one per entry of WORKER_GPUS, where `0+1` is one slot with two GPUs (for jobs with
    `training.devices: 2`). Every GPU named must be the host's, and in one slot only.

    >>> chosen_gpus("0+1,2", host_gpus="0,1,2,3")
    ['0,1', '2']
    """
    present = parse_indices(host_gpus, "HOST_GPUS") if isinstance(host_gpus, str) else host_gpus
    if worker_gpus.strip() == "all":
        return present
    slots = [parse_indices(group.replace("+", ","), "WORKER_GPUS") for group in worker_gpus.split(",")]
    wanted = [gpu for slot in slots for gpu in slot]
    if not wanted or not all(slots) or len(set(wanted)) != len(wanted):
        raise ValueError("Expected `all`, or GPU indices such as `0,1` (a slot each), `0+1` for one slot with "
                         f"both, each GPU once. Received: WORKER_GPUS={worker_gpus}")
    missing = [gpu for gpu in wanted if gpu not in present]
    if missing:
        have = ", ".join(present) if present else "none"
        raise ValueError(f"WORKER_GPUS={worker_gpus} names GPU {', '.join(missing)}, which this host does not "
                         f"have. Expected `all` or some of its GPUs: {have}")
    return [",".join(slot) for slot in slots]


def pinned_gpus() -> list[str]:
    """The GPUs this process was pinned to (CUDA_VISIBLE_DEVICES), as recorded with each job it runs;
    [] when it was not pinned."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    parts = [] if visible is None else [part.strip() for part in visible.split(",")]
    return [part for part in parts if part and not part.startswith("-")]  # -1: hidden, no GPU
