"""Recognise a backend's "no kernel for this dtype" and "out of memory" errors, wherever they are raised.

TensorFlow and XLA say it several ways, in graphs and eagerly, while a model
trains or while it is built (an initializer's op). `missing_kernel` turns each
into `UnsupportedPrecision` with the op (or, where TensorFlow names only the
op's parameter, that parameter) and a fix. `out_of_memory` turns TensorFlow's
ResourceExhaustedError, NumPy's MemoryError and XLA's RESOURCE_EXHAUSTED into
`OutOfMemory` with the tensor's shape and size.

>>> error = RuntimeError("The precision 'F16_F16_F32' is not supported by dot_general on CPU.")
>>> missing_kernel(error, "float16", "jax", "cpu").message.split(".")[0]
'jax has no float16 kernel for op dot_general on this cpu'
"""

from __future__ import annotations

import math
import re

from app.core.errors import JobFailed, OutOfMemory, UnsupportedPrecision

_NO_KERNEL_HERE = re.compile(
    r"No OpKernel was registered to support Op '(?P<graph>\w+)'"
    r"|Could not find device for node: .*? = (?P<eager>\w+)\["
    # XLA under JAX, e.g. float16 attention with float32 accumulation on CPU:
    r"|The precision '\w+' is not supported by (?P<xla>\w+) on"
)
"""The op exists for the dtype, but this device has no kernel for it."""

_NO_KERNEL_ANYWHERE = re.compile(
    # The op's definition leaves the dtype out, e.g. TensorFlow's Qr (the Orthogonal
    # initializer of LSTM and GRU) has no bfloat16: eagerly "[Op:Qr]", in a graph "Op<name=Qr".
    r"Value for attr '\w+' of (?P<dtype>b?float\d+|half) is not in the list of allowed values"
    r".*?(?:Op<name=(?P<graph>\w+)|\[Op:(?P<eager>\w+)\])"
    # A graph node whose shape function refuses the dtype, e.g. Range with Tidx=DT_HALF:
    r"|Unsupported dtype\w* for '\{\{node [^}]*\}\} = (?P<node>\w+)\[[^\]]*DT_(?:HALF|BFLOAT16)"
    # Building a graph op; TensorFlow names only the parameter here:
    r"|Value passed to parameter '(?P<parameter>\w+)' has DataType (?P<passed>b?float\d+|half) not in list of allowed",
    re.DOTALL,
)
"""No device has a kernel of the op for the dtype."""


def missing_kernel(
    exc: BaseException, compute_dtype: str, backend: str, device_kind: str
) -> UnsupportedPrecision | None:
    """The named failure for an error that says an op has no kernel for a dtype, else None.

    Args:
        exc: The error raised while the model was built or trained.
        compute_dtype: The policy's compute dtype, named when the error does not name one.
        backend: The Keras backend, e.g. "tensorflow".
        device_kind: "cpu" or "gpu".
    """
    text = str(exc)
    here = _NO_KERNEL_HERE.search(text)
    if here:
        op = here["graph"] or here["eager"] or here["xla"]
        others = "mixed_bfloat16 or float32" if compute_dtype == "float16" else "float32"
        elsewhere = ", or run it on a GPU" if device_kind == "cpu" else ""
        return UnsupportedPrecision(
            f"{backend} has no {compute_dtype} kernel for op {op} on this {device_kind}. "
            f"Fix: use {others} for this model on {device_kind}{elsewhere}."
        )
    anywhere = _NO_KERNEL_ANYWHERE.search(text)
    if anywhere:
        named = anywhere["graph"] or anywhere["eager"] or anywhere["node"]
        op = f"op {named}" if named else f"the op that takes parameter {anywhere['parameter']!r}"
        dtype = anywhere["dtype"] or anywhere["passed"] or compute_dtype
        return UnsupportedPrecision(
            f"{backend} has no {dtype} kernel for {op} on any device. "
            f"Fix: use float32 for this model, or a mixed policy if the op only initializes weights "
            f"(it keeps them in float32), or avoid the layer that runs it."
        )
    return None


_TENSORFLOW_OOM = re.compile(
    r"OOM when allocating tensor with shape\[(?P<shape>[\d,]*)\] and type (?P<dtype>\w+) on (?P<device>\S+)")
"""TensorFlow's ResourceExhaustedError, eagerly and in graphs, on CPU (allocator mklcpu, cpu) and GPU (GPU_0_bfc)."""
_NUMPY_OOM = re.compile(r"Unable to allocate (?P<size>[\d.]+ \w+) for an array with shape (?P<shape>\([\d, ]*\))"
                        r" and data type (?P<dtype>\w+)")
_XLA_OOM = re.compile(r"RESOURCE_EXHAUSTED: Out of memory (?:while trying to allocate|allocating) (?P<bytes>\d+) bytes")
"""XLA under JAX, or under TensorFlow with jit_compile."""
_TENSORFLOW_BYTES = {"double": 8, "int64": 8, "float": 4, "int32": 4, "half": 2, "bfloat16": 2, "int16": 2,
                     "int8": 1, "uint8": 1, "bool": 1}
_OOM_ADVICE = "Fix: a smaller training.batch_size or model, or a worker with more memory."


def byte_size(value: float) -> str:
    """4398046511104 -> "4 TiB"."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def out_of_memory(exc: BaseException) -> OutOfMemory | None:
    """The named failure for an error that says memory ran out, else None."""
    text = str(exc)
    tensorflow = _TENSORFLOW_OOM.search(text)
    if tensorflow:
        shape, dtype, device = tensorflow["shape"], tensorflow["dtype"], tensorflow["device"]
        dims = [int(d) for d in shape.split(",") if d]
        size = f" ({byte_size(math.prod(dims) * _TENSORFLOW_BYTES[dtype])})" if dtype in _TENSORFLOW_BYTES else ""
        return OutOfMemory(f"Out of memory: a {dtype} tensor of shape [{shape}]{size} could not be allocated on "
                           f"{device}. {_OOM_ADVICE}")
    numpy = _NUMPY_OOM.search(text)
    if numpy:
        return OutOfMemory(f"Out of memory: a {numpy['dtype']} array of shape {numpy['shape']} ({numpy['size']}) "
                           f"could not be allocated in RAM. {_OOM_ADVICE}")
    xla = _XLA_OOM.search(text)
    if xla:
        return OutOfMemory(f"Out of memory: XLA could not allocate {byte_size(int(xla['bytes']))} on this device. "
                           f"{_OOM_ADVICE}")
    if isinstance(exc, MemoryError) or type(exc).__name__ == "ResourceExhaustedError":
        first = text.strip().splitlines()[0][:300] if text.strip() else "no details"
        return OutOfMemory(f"Out of memory ({type(exc).__name__}: {first}). {_OOM_ADVICE}")
    return None


def named_failure(exc: Exception, compute_dtype: str, backend: str, device_kind: str) -> JobFailed:
    """The one place where TensorFlow/Keras errors become named failures."""
    missing = missing_kernel(exc, compute_dtype, backend, device_kind)
    if missing is not None:
        return missing
    memory = out_of_memory(exc)
    if memory is not None:
        return memory
    return JobFailed(f"{type(exc).__name__}: {error_cause(str(exc))[:500]}")


_BOLD = re.compile(r"\x1b\[1m(?P<cause>.*?)\x1b\[0m", re.S)
_NODE = re.compile(r"Detected at node (?P<node>\S+)")


def error_cause(text: str) -> str:
    """A backend error's cause on one line, not the heading Keras or TensorFlow put before it.

    >>> error_cause("Exception encountered when calling LSTM.call().\\n\\n\\x1b[1mIf an RNN is stateful, ...\\n"
    ...             "- Expected batch size: 4\\x1b[0m\\n\\nArguments received by LSTM.call():\\n  • mask=None")
    'If an RNN is stateful, ... - Expected batch size: 4 (in LSTM.call())'
    >>> error_cause("Graph execution error:\\n\\nDetected at node model/embedding/GatherV2 defined at (most recent "
    ...             "call last):\\n  File \\"x.py\\"\\n\\nindices[0,0] = 25 is not in [0, 5)\\n\\t [[{{node}}]]")
    'indices[0,0] = 25 is not in [0, 5) (at node model/embedding/GatherV2)'
    """
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    bold = _BOLD.search(text)
    if bold and lines[0].startswith("Exception encountered when calling"):  # Keras: the cause is in bold
        layer = lines[0].removeprefix("Exception encountered when calling").strip().rstrip(".")
        return f"{' '.join(bold['cause'].split())} (in {layer})"
    if lines[0].rstrip().endswith(":") and len(lines) > 1:  # TensorFlow: a heading, the traceback, the cause
        causes = [line for line in lines[1:] if not line[0].isspace() and not line.startswith(("Detected at", "[["))]
        node = _NODE.search(text)
        if causes:
            return causes[-1].strip() + (f" (at node {node['node']})" if node else "")
    return lines[0]
