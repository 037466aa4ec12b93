"""How large a built-in model is, and how much memory training it takes, computed from its spec.

The API never imports Keras, so the sizes of the models worker/engine/models.py builds are written out
here layer by layer (tests/worker/engine/test_model_size.py checks them against the built models).

What training holds at once, per device (`TrainingMemory`):

- the weights, in the policy's variable dtype (float32 under the mixed policies);
- their gradients and the optimizer's slots (Adam and AdamW keep 2 per weight, RMSprop 1, SGD 0),
  trainable weights only, in the variable dtype;
- the float32 check's twin (worker/numerics/float32_check.py) where that check runs: a float32 copy of the
  weights, its gradient and both gradients as float32 host arrays, and its own activations;
- the activations of one batch: every layer's output for `batch_size / devices` samples in the
  compute dtype, times `ACTIVATION_FACTOR`.

>>> from mpjobs.contract.spec import JobSpec
>>> spec = JobSpec.model_validate({"model": {"name": "mlp", "input_dim": 1000, "hidden_units": 1000}})
>>> builtin_size(spec.model).parameters
1011010
>>> round(training_memory(spec).total / 2**20, 1)
15.9
"""

from __future__ import annotations

from dataclasses import dataclass

from mpjobs.contract.model_specs import CnnModel, Conv3dUnetModel, MlpModel, TransformerModel
from mpjobs.contract.spec import JobSpec

BuiltinModel = MlpModel | CnnModel | Conv3dUnetModel | TransformerModel

ACTIVATION_FACTOR = 2
"""Training keeps each layer's output for the backward pass, which makes a gradient of the same size:
twice the outputs. Rough on purpose: pre-activations, attention masks and an op's scratch space come
and go, and XLA fuses some outputs away."""
OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "rmsprop": 1, "sgd": 0}
"""Variables the optimizer keeps per weight (SGD without momentum, RMSprop not centered)."""
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelSize:
    parameters: int
    """Every weight, as Keras's `count_params()` counts them (batch norm's moving statistics included)."""
    trainable: int
    """The weights with a gradient and optimizer slots."""
    activations: int
    """Elements of every layer's output for one sample (the input included), plus attention's inner
    tensors: its query, key and value projections, its scores, their softmax (and their dropout)."""


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes one device holds while it trains the model (see the module docstring)."""

    size: ModelSize
    weights: int
    gradients: int
    optimizer_slots: int
    float32_twin: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_slots + self.float32_twin + self.activations

    def describe(self) -> str:
        """"about 18.5 GiB (weights 4.6 GiB, gradients 4.6 GiB, ...)" with the parts that are not zero."""
        parts = [("weights", self.weights), ("gradients", self.gradients), ("optimizer slots", self.optimizer_slots),
                 ("float32 check twin", self.float32_twin), ("activations", self.activations)]
        listed = ", ".join(f"{name} {gib(value)}" for name, value in parts if value)
        return f"about {gib(self.total)} ({listed})"


def gib(value: int) -> str:
    """Bytes in GiB, for messages: "4.6 GiB", "0.003 GiB"."""
    return f"{value / 2**30:.2g} GiB" if value < 2**30 else f"{value / 2**30:.1f} GiB"


def attention_elements(query_len: int, key_len: int, heads: int, key_dim: int, value_dim: int, dropout: bool) -> int:
    """Attention's inner tensors per sample: projections, scores, softmax (and its dropout), the
    weighted values. The output projection is the layer's output, counted with the others."""
    projections = query_len * heads * key_dim + key_len * heads * (key_dim + value_dim)
    scores = heads * query_len * key_len
    return projections + scores * (3 if dropout else 2) + query_len * heads * value_dim


def _mlp(m: MlpModel) -> ModelSize:
    params = m.input_dim * m.hidden_units + m.hidden_units + m.hidden_units * m.classes + m.classes
    # input, Dense, Dense, softmax
    return ModelSize(params, params, m.input_dim + m.hidden_units + 2 * m.classes)


def _cnn(m: CnnModel) -> ModelSize:
    f, s = m.filters, m.image_size
    params = (27 * f + f) + (9 * f * 2 * f + 2 * f) + (2 * f * m.classes + m.classes)
    half, quarter = s // 2, s // 2 // 2
    # input, Conv2D, MaxPooling2D, Conv2D, MaxPooling2D, GlobalAveragePooling2D, Dense, softmax
    activations = (s * s * 3 + s * s * f + half * half * f + half * half * 2 * f + quarter * quarter * 2 * f
                   + 2 * f + 2 * m.classes)
    return ModelSize(params, params, activations)


def _conv3d_unet(m: Conv3dUnetModel) -> ModelSize:
    f, full = m.filters, m.volume**3
    half = (m.volume // 2) ** 3
    trainable = (27 * f + f) + 2 * f + (27 * f * 2 * f + 2 * f) + 2 * 2 * f + (27 * 3 * f * f + f) + (f + 1)
    moving_statistics = 2 * f + 2 * 2 * f  # batch norm's moving mean and variance: weights, never trained
    # input; Conv3D, BatchNorm, ReLU; MaxPool3D; Conv3D, BatchNorm, ReLU; UpSampling3D; Concatenate; Conv3D; Conv3D
    activations = full + 3 * full * f + half * f + 3 * half * 2 * f + full * 2 * f + full * 3 * f + full * f + full
    return ModelSize(trainable + moving_statistics, trainable, activations)


def _transformer(m: TransformerModel) -> ModelSize:
    d, t, ffn = m.d_model, m.seq_len, m.ffn_dim
    per_layer = (4 * d * d + 4 * d) + 2 * d + (d * ffn + ffn) + (ffn * d + d) + 2 * d
    params = m.vocab_size * d + t * d + m.layers * per_layer + d * m.classes + m.classes
    attention = attention_elements(t, t, m.heads, d // m.heads, d // m.heads, m.dropout > 0)
    # per block: attention's output and inner tensors, LayerNorm, Dense, Dense, Dropout, LayerNorm
    block = t * d + attention + t * d + t * ffn + t * d + t * d + t * d
    # tokens, Embedding, PositionEmbedding, the blocks, GlobalAveragePooling1D, Dense, softmax
    activations = t + 2 * t * d + m.layers * block + d + 2 * m.classes
    return ModelSize(params, params, activations)


def builtin_size(model: BuiltinModel) -> ModelSize:
    """Parameters and per-sample activations of a built-in model, exactly as worker/engine/models.py builds it."""
    if isinstance(model, MlpModel):
        return _mlp(model)
    if isinstance(model, CnnModel):
        return _cnn(model)
    if isinstance(model, Conv3dUnetModel):
        return _conv3d_unet(model)
    return _transformer(model)


def float32_twin_runs(spec: JobSpec) -> bool:
    """Whether the job builds a float32 twin of its model: the float32 check or the layer checks under a
    float16/bfloat16 compute policy or with FP8 layers, on one device (as worker/engine/checks.py decides)."""
    t = spec.training
    half = (spec.precision_policy.compute_dtype != "float32" or spec.fp8 is not None) and t.devices == 1
    return half and (t.underflow_check_every > 0 or (t.layer_check_every or 0) > 0)


def estimate(spec: JobSpec, size: ModelSize) -> TrainingMemory:
    """Training memory per device for a model of `size` trained as `spec` says."""
    policy, t = spec.precision_policy, spec.training
    variable, compute = DTYPE_BYTES[policy.variable_dtype], DTYPE_BYTES[policy.compute_dtype]
    rows = t.batch_size // t.devices
    twin = 0
    if float32_twin_runs(spec):
        twin = 4 * (size.parameters + 3 * size.trainable) + rows * size.activations * 4 * ACTIVATION_FACTOR
    return TrainingMemory(
        size=size,
        weights=size.parameters * variable,
        gradients=size.trainable * variable,
        optimizer_slots=size.trainable * OPTIMIZER_SLOTS[t.optimizer] * variable,
        float32_twin=twin,
        activations=rows * size.activations * compute * ACTIVATION_FACTOR,
    )


def training_memory(spec: JobSpec) -> TrainingMemory | None:
    """The estimate for a built-in model; None for a `keras_json` one (the worker checks it once built)."""
    if not isinstance(spec.model, MlpModel | CnnModel | Conv3dUnetModel | TransformerModel):
        return None
    return estimate(spec, builtin_size(spec.model))


def input_elements(model: BuiltinModel) -> int:
    """Elements of one sample's input (float32, or int32 tokens for the transformer): 4 bytes each."""
    if isinstance(model, MlpModel):
        return model.input_dim
    if isinstance(model, CnnModel):
        return model.image_size * model.image_size * 3
    if isinstance(model, Conv3dUnetModel):
        return model.volume**3
    return model.seq_len


def synthetic_dataset_bytes(spec: JobSpec) -> int | None:
    """The synthetic dataset's inputs as the worker holds them (worker/engine/data.py draws them all at the start),
    for a built-in model; None for an npz dataset or a keras_json model (sized where they are read)."""
    if spec.dataset.kind != "synthetic" or not isinstance(spec.model, BuiltinModel):
        return None
    return spec.dataset.samples * input_elements(spec.model) * 4
