"""Gradients as backends hand them over: dense tensors, or `tf.IndexedSlices` (an Embedding's), unscaled alike."""

from __future__ import annotations

from typing import Any

from keras import ops


def unscale(g: Any, scale: Any) -> Any:
    """g / scale, in float32, back in g's dtype; a sparse gradient stays sparse."""
    if g is None:
        return None
    if is_sparse(g):
        return type(g)(ops.cast(ops.cast(g.values, "float32") / scale, g.values.dtype), g.indices, g.dense_shape)
    return ops.cast(ops.cast(g, "float32") / scale, g.dtype)


def is_sparse(g: Any) -> bool:
    """An `Embedding` gradient under TensorFlow: `tf.IndexedSlices`, rows possibly repeated."""
    return hasattr(g, "indices") and hasattr(g, "dense_shape")


def dense(g: Any) -> Any:
    """The gradient as one dense tensor; repeated rows of a sparse one are summed, as its update sums them."""
    if not is_sparse(g):
        return g
    import tensorflow as tf  # only TensorFlow makes IndexedSlices

    return tf.math.unsorted_segment_sum(g.values, g.indices, g.dense_shape[0])
