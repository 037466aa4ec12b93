"""Admission: refuse (422) a valid spec that exceeds this deployment's limits, before anything is written.

The spec's own bounds (mpjobs/contract/spec.py) are the same everywhere; these limits are the operator's
(MAX_JOB_SECONDS, MAX_MODEL_BYTES), so they are checked here, against the settings, by the routes
that queue work.
"""

from __future__ import annotations

from app.core.config import Settings
from app.core.errors import SpecRefused
from app.core.model_size import gib, synthetic_dataset_bytes, training_memory
from mpjobs.contract.spec import ComparisonSpec, JobSpec, SyntheticDataset

Loc = tuple[str | int, ...]


def admit(spec: JobSpec, settings: Settings, at: Loc = (), variant: str | None = None) -> None:
    """Raise `SpecRefused` when `spec` asks for more time or memory than this deployment allows.

    Args:
        at: where `spec` sits in the request body: () for POST /jobs, ("spec",) in a comparison.
        variant: the comparison variant `spec` runs, named in the message.

    Raises:
        SpecRefused: `training.max_seconds` above MAX_JOB_SECONDS; a built-in model whose synthetic dataset,
            or whose estimated training memory (app/core/model_size.py), exceeds MAX_MODEL_BYTES.
    """
    limit_s = settings.max_job_seconds
    asked_s = spec.training.max_seconds
    if asked_s is not None and asked_s > limit_s:
        raise SpecRefused((*at, "training", "max_seconds"), (
            f"Expected training.max_seconds to be at most {limit_s}, this deployment's limit on one attempt "
            f"(MAX_JOB_SECONDS). Received: max_seconds={asked_s}"))
    data = synthetic_dataset_bytes(spec)
    if data is not None and data > settings.max_model_bytes and isinstance(spec.dataset, SyntheticDataset):
        samples = spec.dataset.samples
        raise SpecRefused((*at, "dataset", "samples"), (
            f"Expected a synthetic dataset that fits in {gib(settings.max_model_bytes)}, this deployment's limit "
            f"(MAX_MODEL_BYTES={settings.max_model_bytes}). Received: samples={samples:,} of "
            f"{data // samples:,} bytes each, {gib(data)} held at once. Fix: fewer dataset.samples "
            "(the batches cycle through them), a smaller input, or a deployment with a larger MAX_MODEL_BYTES."))
    memory = training_memory(spec)
    if memory is None or memory.total <= settings.max_model_bytes:
        return
    # Name what to shrink: the batch when its activations outweigh the model's own bytes.
    batch_heavy = memory.activations > memory.total - memory.activations
    field: Loc = ("training", "batch_size") if batch_heavy else ("model",)
    under = f" under variant {variant!r}" if variant else ""
    model = getattr(spec.model, "name", "model")
    raise SpecRefused((*at, *field), (
        f"Expected a model that trains in at most {gib(settings.max_model_bytes)}, this deployment's limit "
        f"(MAX_MODEL_BYTES={settings.max_model_bytes}). Received: {model} with {memory.size.parameters:,} "
        f"parameters, which needs {memory.describe()} to train at training.batch_size={spec.training.batch_size}"
        f"{under}, as {spec.precision_policy.value} with {spec.training.optimizer}. "
        f"Fix: a smaller {'training.batch_size' if batch_heavy else 'model or training.batch_size'}, "
        "or a deployment with a larger MAX_MODEL_BYTES."))


def admit_comparison(comparison: ComparisonSpec, settings: Settings) -> None:
    """`admit` every variant's job: the comparison is refused whole if any one of them would be."""
    labels = [variant.label for variant in comparison.variants or ()]
    for index, spec in enumerate(comparison.job_specs()):  # the variants', then the plan's and the seed control's
        admit(spec, settings, at=("spec",), variant=labels[index] if index < len(labels) else spec.name)
