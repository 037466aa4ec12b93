"""At submission: a job's dataset exists (an upload of the tenant's, a file under DATA_ROOT) and fits its model.

The model's input and output are read from its spec, never from Keras: a built-in model's shapes follow from
its fields (as worker/engine/models.py builds it); a keras_json one's from its config (its input layer's
`batch_shape`, and the `units` of a Dense output layer). What cannot be read so is left to the worker.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.config import Settings
from app.core.errors import DatasetRefused
from app.core.npz import BadArray, NotAnNpz, inspect_npz
from app.store import JobStore
from mpjobs.contract.data_specs import NpzDataset, UploadedDataset
from mpjobs.contract.datasets import ArrayShape
from mpjobs.contract.keras_io import endpoint_names
from mpjobs.contract.model_specs import CnnModel, Conv3dUnetModel, KerasJsonModel, MlpModel, TransformerModel
from mpjobs.contract.spec import ComparisonSpec, JobSpec

Loc = tuple[str | int, ...]
NO_LABELS = frozenset({"output_mean", "scan_voxel_sum"})
"""Losses that read no labels: any `y` will do."""


@dataclass(frozen=True)
class ModelEnds:
    """What a dataset must fit: one sample's input shape (None for a free axis) and the output's width."""

    input_shape: tuple[int | None, ...] | None
    outputs: int | None
    loss: str
    vocab: int | None = None
    """Token ids the input takes, 0 to vocab - 1 (the transformer's embedding); None: any numbers."""


def model_ends(spec: JobSpec) -> ModelEnds:
    m = spec.model
    if isinstance(m, MlpModel):
        return ModelEnds((m.input_dim,), m.classes, "sparse_categorical_crossentropy")
    if isinstance(m, CnnModel):
        return ModelEnds((m.image_size, m.image_size, 3), m.classes, "sparse_categorical_crossentropy")
    if isinstance(m, Conv3dUnetModel):
        return ModelEnds((m.volume, m.volume, m.volume, 1), 1, "scan_voxel_sum")
    if isinstance(m, TransformerModel):
        return ModelEnds((m.seq_len,), m.classes, "sparse_categorical_crossentropy", m.vocab_size)
    assert isinstance(m, KerasJsonModel)
    return _keras_json_ends(json.loads(m.keras_json), m.loss)


def _keras_json_ends(config: dict[str, Any], loss: str) -> ModelEnds:
    inner = config.get("config") if isinstance(config, dict) else None
    layers = inner.get("layers") if isinstance(inner, dict) else None
    if not isinstance(inner, dict) or not isinstance(layers, list) or not layers or not all(
            isinstance(layer, dict) for layer in layers):
        return ModelEnds(None, None, loss)
    by_name = {layer.get("config", {}).get("name"): layer for layer in layers if isinstance(layer.get("config"), dict)}
    if config.get("class_name") == "Sequential":
        first, last = layers[0], layers[-1]
    else:
        ins, outs = endpoint_names(inner.get("input_layers")), endpoint_names(inner.get("output_layers"))
        first = by_name.get(ins[0]) if ins and len(ins) == 1 else None
        last = by_name.get(outs[0]) if outs and len(outs) == 1 else None
    return ModelEnds(_batch_shape(first), _units(last), loss)


def _batch_shape(layer: dict[str, Any] | None) -> tuple[int | None, ...] | None:
    conf = layer.get("config") if layer else None
    shape = (conf.get("batch_shape") or conf.get("batch_input_shape")) if isinstance(conf, dict) else None
    if not isinstance(shape, list) or not shape or not all(n is None or isinstance(n, int) for n in shape):
        return None
    return tuple(shape[1:])


def _units(layer: dict[str, Any] | None) -> int | None:
    conf = layer.get("config") if layer else None
    if layer is None or layer.get("class_name") != "Dense" or not isinstance(conf, dict):
        return None
    units = conf.get("units")
    return units if isinstance(units, int) else None


def check_dataset(spec: JobSpec, store: JobStore, settings: Settings, tenant: str, at: Loc = ()) -> None:
    """Raise DatasetRefused (422) when the job's dataset is missing or cannot fit its model; nothing is written.

    Args:
        at: where `spec` sits in the request body: () for POST /jobs, ("spec",) in a comparison.
    """
    held = getattr(spec.validation, "dataset", None)
    if isinstance(held, UploadedDataset) and store.datasets.get(tenant, held.id) is None:
        raise DatasetRefused((*at, "validation", "dataset", "id"), (
            f"Expected the id of a dataset uploaded with POST /datasets. Received: id={held.id!r}, which names "
            "none of yours. Upload it first (client.upload(x, y), or mpjobs upload FILE.npz)."))
    d = spec.dataset
    if isinstance(d, UploadedDataset):
        record = store.datasets.get(tenant, d.id)
        if record is None:
            raise DatasetRefused((*at, "dataset", "id"), (
                f"Expected the id of a dataset uploaded with POST /datasets. Received: id={d.id!r}, which names "
                "none of yours. Upload it first (client.upload(x, y), or mpjobs upload FILE.npz)."))
        x, y, where = record.x, record.y, (*at, "dataset", "id")
    elif isinstance(d, NpzDataset):
        where = (*at, "dataset", "path")
        info = _npz_headers(settings.data_root, d.path, where)
        x = ArrayShape(shape=list(info[0]), dtype="")
        y = ArrayShape(shape=list(info[1]), dtype="")
    else:
        return
    _check_fit(model_ends(spec), x, y, where)


def check_comparison(comparison: ComparisonSpec, store: JobStore, settings: Settings, tenant: str) -> None:
    """Every variant trains on the same dataset and model: checking the first checks them all."""
    check_dataset(comparison.job_specs()[0], store, settings, tenant, at=("spec",))


def _npz_headers(root: Path, relative: str, where: Loc) -> tuple[tuple[int, ...], tuple[int, ...]]:
    base = Path(os.path.realpath(root))
    try:
        path = Path(os.path.realpath(base / relative))
        found = base in path.parents and path.is_file()
    except OSError:  # a name too long for the file system, say: no such file either
        found = False
    if not found:
        raise DatasetRefused(where, f"Expected dataset.path to name an .npz file under the data root (DATA_ROOT). "
                                    f"Received: path={relative!r}, which does not exist there.")
    try:
        info = inspect_npz(path, check_values=False)
    except (NotAnNpz, BadArray) as exc:
        raise DatasetRefused(where, f"dataset.path {relative!r}: {exc}") from None
    except OSError as exc:
        raise DatasetRefused(where, f"dataset.path {relative!r} cannot be read: {exc.strerror}.") from None
    return info.x.shape, info.y.shape


def _check_fit(ends: ModelEnds, x: ArrayShape, y: ArrayShape, where: Loc) -> None:
    sample = tuple(x.shape[1:])
    want = ends.input_shape
    if want is not None and (len(want) != len(sample) or any(w not in (None, s) for w, s in zip(want, sample,
                                                                                                   strict=True))):
        shown = tuple("None" if w is None else w for w in want)
        raise DatasetRefused(where, f"Expected samples of x shaped as the model's input, {shown}. Received: x has "
                                    f"shape {tuple(x.shape)}, samples of shape {sample}.")
    if ends.vocab is not None and x.low is not None and x.high is not None and (
            x.low < 0 or x.high >= ends.vocab or not float(x.low).is_integer() or not float(x.high).is_integer()):
        raise DatasetRefused(where, f"Expected token ids from 0 to {ends.vocab - 1} in x: the model's embedding has "
                                    f"model.vocab_size={ends.vocab}. Received: x holds values from {x.low:g} to "
                                    f"{x.high:g}.")
    classes, loss = ends.outputs, ends.loss
    if classes is None or loss in NO_LABELS:
        return
    if loss == "sparse_categorical_crossentropy":
        if y.low is not None and y.high is not None and (y.low < 0 or y.high >= classes):
            raise DatasetRefused(where, f"Expected class ids from 0 to {classes - 1} in y: the model's output has "
                                        f"{classes} classes and the loss is {loss}. Received: y holds values from "
                                        f"{y.low:g} to {y.high:g}.")
        return
    width = y.shape[-1] if len(y.shape) >= 2 else 1
    if width != classes:
        raise DatasetRefused(where, f"Expected labels y of width {classes}, the model's output width, for the loss "
                                    f"{loss}. Received: y has shape {tuple(y.shape)} (width {width}).")
