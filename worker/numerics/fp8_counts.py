"""FP8 on a checked step, counted exactly: each FP8 tensor's values past the format's largest, and those lost.

Keras quantizes inside its FP8 layers (`quantize_and_dequantize`, forward for inputs and kernel, in the
custom gradient for the output gradient), where no model output reaches. So on a check step the engine
runs the step's forward and backward pass once more with that function tapped: each call is counted
where Keras makes it, on the very tensor and scale it quantizes, x / scale in the compute dtype as Keras
divides it. The taps are on only while this pass is traced and run, never in training's compiled step.

- saturated: |x / scale| > the format's largest (Keras clips them there), over all values;
- lost: x != 0 but cast(clip(x / scale)) == 0, over the non-zero values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
import ml_dtypes
import numpy as np
from keras import ops

from worker.numerics.gradients import current_values

Counts = dict[tuple[str, str], tuple[float, float]]
"""(layer path, tensor) -> (saturated share, lost share)."""


class _Taps:
    """Which FP8 layer is quantizing now: set around its call, and around the gradient its call defined."""

    def __init__(self, sink: Callable[[tuple[str, str], Any, Any, Any, Any], None]) -> None:
        self.sink, self.layer, self.calls = sink, None, 0

    def custom_gradient(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def decorate(fun: Callable[..., Any]) -> Any:
            layer = self.layer

            def forward(*args: Any, **kwargs: Any) -> Any:
                out, grad = fun(*args, **kwargs)

                def backward(*upstream: Any, variables: Any = None, **kw: Any) -> Any:
                    before, self.layer = self.layer, layer
                    try:
                        return grad(*upstream, variables=variables, **kw)
                    finally:
                        self.layer = before
                return out, backward
            return original(forward)
        return decorate

    def quantize(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def tapped(inputs: Any, scale: Any, quantized_dtype: str, compute_dtype: str) -> Any:
            if self.layer is not None:
                if quantized_dtype == "float8_e5m2":
                    tensor = "outputs_grad"
                else:  # the layer quantizes its inputs, then its kernel
                    tensor, self.calls = ("inputs", "kernel")[self.calls % 2], self.calls + 1
                top = ops.cast(float(ml_dtypes.finfo(quantized_dtype).max), compute_dtype)
                x = ops.divide(inputs, ops.cast(scale, compute_dtype))
                q = ops.cast(ops.cast(ops.clip(x, -top, top), quantized_dtype), "float32")
                nonzero = ops.not_equal(inputs, 0)
                self.sink((self.layer.path, tensor), ops.sum(ops.cast(ops.abs(x) > top, "int32")),
                          ops.sum(ops.cast(ops.logical_and(nonzero, ops.equal(q, 0.0)), "int32")),
                          ops.sum(ops.cast(nonzero, "int32")), ops.size(inputs))
            return original(inputs, scale, quantized_dtype, compute_dtype)
        return tapped

    def wrap_call(self, layer: Any) -> Callable[..., Any]:
        method = type(layer)._float8_call

        def call(*args: Any, **kwargs: Any) -> Any:
            before, self.layer, self.calls = self.layer, layer, 0
            try:
                return method(layer, *args, **kwargs)
            finally:
                self.layer = before
        return call


@contextlib.contextmanager
def tapped(model: keras.Model, sink: Callable[..., None]) -> Iterator[None]:
    """Keras's quantizer (and its custom gradients) tapped for `model`'s FP8 layers, for the block's length."""
    import keras.src.ops as kops
    import keras.src.quantizers as kquantizers

    taps = _Taps(sink)
    layers = [layer for layer in model._flatten_layers(include_self=False)
              if getattr(layer, "quantization_mode", None) == "float8"]
    saved = kops.custom_gradient, kquantizers.quantize_and_dequantize
    kops.custom_gradient = taps.custom_gradient(saved[0])
    kquantizers.quantize_and_dequantize = taps.quantize(saved[1])
    for layer in layers:
        object.__setattr__(layer, "_float8_call", taps.wrap_call(layer))
    try:
        yield
    finally:
        kops.custom_gradient, kquantizers.quantize_and_dequantize = saved
        for layer in layers:
            object.__delattr__(layer, "_float8_call")


class Fp8Counter:
    """Counts a model's FP8 tensors on one step's batch at the scales in force (`__call__`)."""

    def __init__(self, loss: Any) -> None:
        self.loss = loss
        self._fn: Any = None
        self._labels: list[tuple[str, str]] = []
        self._seen: list[tuple[tuple[str, str], list[int]]] = []

    def _build(self, model: keras.Model) -> Any:
        def value(trainable: list[Any], non_trainable: list[Any], x: Any, y: Any, scale: Any) -> Any:
            y_pred, _ = model.stateless_call(trainable, non_trainable, x, training=True)
            return ops.cast(self.loss(y, y_pred), "float32") * scale

        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            found: list[Any] = []

            def sink(label: tuple[str, str], *counts: Any) -> None:
                self._labels.append(label)
                found.append(ops.stack([ops.cast(c, "int64") for c in counts]))

            @tf.function(reduce_retracing=True)
            def counts(trainable: list[Any], non_trainable: list[Any], x: Any, y: Any, scale: Any) -> Any:
                found.clear()
                self._labels.clear()
                with tapped(model, sink):
                    with tf.GradientTape() as tape:
                        tape.watch(trainable)
                        loss = value(trainable, non_trainable, x, y, scale)
                    tape.gradient(loss, trainable)  # the output gradients are quantized, and counted, here
                    return ops.stack(found) if found else tf.zeros((0, 4), "int64")
            return lambda *args: np.asarray(counts(*args))
        if keras.backend.backend() == "jax":
            import jax

            def host(label: tuple[str, str], *counts: Any) -> None:
                self._seen.append((label, [int(c) for c in counts]))

            def jax_sink(label: tuple[str, str], *counts: Any) -> None:
                jax.debug.callback(lambda *c: host(label, *c), *counts, ordered=False)

            def run(*args: Any) -> Any:
                with tapped(model, jax_sink):
                    return jax.grad(value)(*args)
            fn = jax.jit(run)

            def call(*args: Any) -> Any:
                self._seen.clear()
                jax.block_until_ready(fn(*args))
                jax.effects_barrier()
                self._labels = [label for label, _ in self._seen]
                return np.asarray([c for _, c in self._seen], dtype=np.int64).reshape(-1, 4)
            return call
        raise NotImplementedError(f"FP8 counts support the tensorflow and jax backends, not {keras.backend.backend()}")

    def __call__(self, model: keras.Model, x: np.ndarray, y: np.ndarray, scale: float) -> Counts:
        """(layer path, tensor) -> (saturated, lost) shares on this batch, at the loss scale `scale`."""
        if self._fn is None:
            self._fn = self._build(model)
        trainable, non_trainable = current_values(model)
        table = self._fn(trainable, non_trainable, x, y, ops.convert_to_tensor(scale, "float32"))
        out: Counts = {}
        for label, (saturated, lost, nonzero, size) in zip(self._labels, table.tolist(), strict=True):
            out[label] = (saturated / size if size else 0.0, lost / nonzero if nonzero else 0.0)
        return out
