"""Training data: a seeded, learnable synthetic set, a `.npz` under the data root, or an uploaded `.npz`.

The batch order is a pure function of (seed, step): epoch `e` is the
permutation drawn from `default_rng([seed, e])`, and the trailing partial
batch is dropped. A resumed run needs nothing but the step to continue with
exactly the batches an uninterrupted run would have seen.

A `validation.split` holds rows out first (`split_rows`): training sees only the rest, as its rows.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.core.errors import InvalidDataset
from mpjobs.contract.data_specs import NpzDataset, UploadedDataset
from mpjobs.contract.evaluation import ValidationSplit
from mpjobs.contract.records import DataUse
from mpjobs.contract.spec import JobSpec

TEACHER_WIDTH = 64
"""Hidden width of the fixed random teacher that labels synthetic inputs."""

TOKEN_FEATURES = 16
"""Width of the teacher's token embedding for integer (token) inputs."""

SEGMENT_BYTES = 256 * 2**20
"""Most input bytes handed to one `fit` call. Each call costs tens of
milliseconds of set-up, so epochs are joined up to this size."""
FIRST_SEGMENT_BYTES = 2 * 2**20
"""The first segment's size: ready in milliseconds, so step 1 comes as fast for 300 steps as for
50,000 (a 256 MiB first segment took seconds to gather). Each next one doubles, up to SEGMENT_BYTES:
a long run still makes few `fit` calls (about log2(256 / 2) more)."""


@dataclass(frozen=True)
class Dataset:
    x: np.ndarray
    y: np.ndarray
    batch_size: int
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return len(self.x) // self.batch_size

    def batches(self, start_step: int, end_step: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield (x, y) index runs, one per epoch touched, for steps start+1..end."""
        per_epoch, bs = self.steps_per_epoch, self.batch_size
        step = start_step
        while step < end_step:
            epoch, offset = divmod(step, per_epoch)
            count = min(per_epoch - offset, end_step - step)
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.x))
            idx = order[offset * bs : (offset + count) * bs]
            yield self.x[idx], self.y[idx]
            step += count

    def segments(self, start_step: int, end_step: int, first_bytes: int = FIRST_SEGMENT_BYTES
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Like `batches`, joined into segments gathered only as training reaches them: the first
        `first_bytes`, each next one twice the last, up to SEGMENT_BYTES (or one epoch)."""
        bytes_per_step = max(1, self.x[: self.batch_size].nbytes + self.y[: self.batch_size].nbytes)
        most = max(self.steps_per_epoch, SEGMENT_BYTES // bytes_per_step)
        size, first = max(1, first_bytes // bytes_per_step), start_step
        while first < end_step:
            last = min(first + min(size, most), end_step)
            parts = list(self.batches(first, last))
            yield np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
            first, size = last, size * 2


def _teacher_features(x: np.ndarray, rng: np.random.Generator, ids: range | None) -> np.ndarray:
    if ids is not None:
        table = rng.standard_normal((ids.stop, TOKEN_FEATURES)).astype(np.float32)
        flat = table[x].reshape(len(x), -1, TOKEN_FEATURES).mean(axis=1)  # ids of any shape: the mean of all
    else:
        flat = x.reshape(len(x), -1)
    w1 = rng.standard_normal((flat.shape[1], TEACHER_WIDTH)).astype(np.float32)
    features: np.ndarray = np.tanh(flat @ w1 / math.sqrt(flat.shape[1]))
    return features


def synthetic(
    input_shape: tuple[int, ...],
    output_shape: tuple[int, ...],
    loss_name: str,
    samples: int,
    seed: int,
    ids: range | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Inputs from N(0, 1) (or token ids uniform over `ids`); labels from a random teacher network."""
    rng = np.random.default_rng(seed)
    shape = (samples, *input_shape)
    x: np.ndarray = (
        rng.integers(ids.start, ids.stop, size=shape, dtype=np.int32)
        if ids is not None
        else rng.standard_normal(shape, dtype=np.float32)
    )
    if loss_name in {"output_mean", "scan_voxel_sum"}:
        return x, np.zeros((samples, 1), np.float32)
    hidden = _teacher_features(x, rng, ids)
    out_size = math.prod(output_shape)
    w2 = rng.standard_normal((TEACHER_WIDTH, out_size)).astype(np.float32)
    scores = (hidden @ w2).reshape(samples, *output_shape)
    if loss_name == "sparse_categorical_crossentropy":
        return x, scores.argmax(axis=-1).astype(np.int32)
    if loss_name == "categorical_crossentropy":
        return x, np.eye(output_shape[-1], dtype=np.float32)[scores.argmax(axis=-1)]
    if loss_name == "binary_crossentropy":
        return x, (scores > 0).astype(np.float32)
    if loss_name in {"hinge", "squared_hinge"}:  # a margin loss's labels are -1 or 1
        return x, np.where(scores > 0, 1.0, -1.0).astype(np.float32)
    if loss_name == "kl_divergence":  # a distribution over the last axis, as the model's softmax gives
        shifted = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return x, (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)
    return x, scores.astype(np.float32)


def resolve_inside(root: Path, relative: str) -> Path:
    """Resolve `relative` under `root`, following symlinks, and refuse escapes."""
    base = Path(os.path.realpath(root))
    target = Path(os.path.realpath(base / relative))
    if target != base and base not in target.parents:
        raise InvalidDataset(f"dataset.path must stay inside the data root. Received: path={relative!r}")
    return target


ZIP_MAGIC = b"PK\x03\x04"
"""An .npz is a zip archive of .npy files (numpy.savez); a .npy file starts with NPY_MAGIC."""
NPY_MAGIC = b"\x93NUMPY"
NUMERIC_KINDS = "biuf"
"""NumPy dtype kinds a model can train on: bool, signed and unsigned integers, floats."""
_KIND_WORDS = {"U": "text", "S": "bytes", "c": "complex numbers", "M": "dates", "m": "time spans", "V": "raw records",
               "O": "Python objects"}


def _check_npz_file(path: Path, name: str) -> None:
    """Refuse a file that is not an .npz before NumPy reads it (it would call a text file pickled data)."""
    try:
        with open(path, "rb") as file:
            head = file.read(16)
    except FileNotFoundError:
        raise InvalidDataset(f"dataset.path {name!r} does not exist under the data root.") from None
    except OSError as exc:
        raise InvalidDataset(f"dataset.path {name!r} cannot be read: {exc.strerror}.") from None
    if head.startswith(ZIP_MAGIC):
        return
    what = ("is empty" if not head else "is a single .npy array" if head.startswith(NPY_MAGIC)
            else f"starts with {head[:8]!r}")
    raise InvalidDataset(
        f"dataset.path {name!r} is not an .npz file: it {what}. Expected a zip archive of arrays 'x' and 'y', "
        "as numpy.savez(path, x=..., y=...) writes (it starts with b'PK').")


def load_npz(spec: NpzDataset, data_root: Path) -> tuple[np.ndarray, np.ndarray]:
    path = resolve_inside(data_root, spec.path)
    _check_npz_file(path, spec.path)
    return _load_arrays(path, f"dataset.path {spec.path!r}", spec.path)


def load_uploaded(spec: UploadedDataset, datasets_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """An uploaded dataset by id: `<ARTIFACTS_DIR>/datasets/<id>.npz`, which every worker reads (the API checked
    its arrays when it was uploaded; they are checked again here, as any file read from a shared folder)."""
    path = datasets_dir / f"{spec.id}.npz"
    if not path.is_file():
        raise InvalidDataset(f"Uploaded dataset {spec.id!r} is not in {datasets_dir} on this worker: it was deleted, "
                             "or this worker does not share the API's ARTIFACTS_DIR (docs/architecture.md).")
    return _load_arrays(path, f"uploaded dataset {spec.id!r}", spec.id)


def _load_arrays(path: Path, shown: str, name_of_file: str) -> tuple[np.ndarray, np.ndarray]:
    """`x` and `y` of the .npz at `path`, checked; `shown` names it in errors (`dataset.path 'a.npz'`)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            x, y = archive["x"], archive["y"]
    except FileNotFoundError:
        raise InvalidDataset(f"{shown} does not exist under the data root.") from None
    except KeyError:
        raise InvalidDataset(f"{shown} must hold arrays named 'x' and 'y'.") from None
    except (OSError, ValueError) as exc:
        raise InvalidDataset(f"{shown} is not a readable .npz file: {exc}") from None
    for name, array in (("x", x), ("y", y)):
        if array.dtype.kind not in NUMERIC_KINDS:
            raise InvalidDataset(
                f"dataset {name!r} in {name_of_file!r} holds {_KIND_WORDS.get(array.dtype.kind, array.dtype.name)}: "
                f"models train on numbers, so "
                f"{name!r} must be an array of floats, integers or booleans. Received: dtype={array.dtype.str!r}")
    if len(x) != len(y):
        raise InvalidDataset(f"dataset 'x' has {len(x)} samples but 'y' has {len(y)}.")
    return x, y


def load_dataset(
    spec: JobSpec,
    input_shape: tuple[int, ...],
    output_shape: tuple[int, ...],
    loss_name: str,
    data_root: Path,
    ids: range | None = None,
    datasets_dir: Path | None = None,
) -> Dataset:
    """The job's dataset. `datasets_dir` (`<ARTIFACTS_DIR>/datasets`) holds the uploaded ones."""
    d = spec.dataset
    if isinstance(d, NpzDataset | UploadedDataset):
        if isinstance(d, UploadedDataset):
            if datasets_dir is None:
                raise InvalidDataset("This worker has no datasets folder to read uploaded datasets from.")
            x, y = load_uploaded(d, datasets_dir)
        else:
            x, y = load_npz(d, data_root)
        if tuple(x.shape[1:]) != tuple(input_shape):
            raise InvalidDataset(
                f"dataset 'x' samples have shape {tuple(x.shape[1:])}; the model expects {tuple(input_shape)}."
            )
    else:
        x, y = synthetic(input_shape, output_shape, loss_name, d.samples, d.seed, ids)
    if len(x) < spec.training.batch_size:
        raise InvalidDataset(
            f"dataset has {len(x)} samples, fewer than training.batch_size={spec.training.batch_size}."
        )
    return Dataset(x, y, spec.training.batch_size, spec.training.seed)


@dataclass(frozen=True)
class HeldOut:
    """The rows a job is evaluated on, never trained on."""

    x: np.ndarray
    y: np.ndarray
    rows: np.ndarray
    """Their indices in the job's dataset (a split), or 0..n-1 in a validation dataset of their own."""


def split_rows(rows: int, split: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(held-out, training) row indices, each ascending: of `numpy.random.default_rng(seed).permutation(rows)`,
    the first floor(split * rows + 0.5) (at least 1, at most rows - 1) are held out, the rest trained on."""
    order = np.random.default_rng(seed).permutation(rows)
    count = max(1, min(rows - 1, math.floor(split * rows + 0.5)))
    return np.sort(order[:count]), np.sort(order[count:])


def hold_out(spec: JobSpec, dataset: Dataset, input_shape: tuple[int, ...], data_root: Path,
             datasets_dir: Path | None = None) -> tuple[Dataset, HeldOut | None]:
    """The job's training data less its held-out rows, and those rows (None: no `validation`).

    A validation dataset of its own is an `.npz` under `data_root` or an uploaded one in `datasets_dir`.
    """
    v = spec.validation
    if v is None:
        return dataset, None
    if isinstance(v, ValidationSplit):
        held, kept = split_rows(len(dataset.x), v.split, v.seed)
        if len(kept) < dataset.batch_size:
            raise InvalidDataset(f"validation.split={v.split} leaves {len(kept)} rows to train on, fewer than "
                                 f"training.batch_size={dataset.batch_size}. Expected a smaller split or more rows.")
        trained = Dataset(dataset.x[kept], dataset.y[kept], dataset.batch_size, dataset.seed)
        return trained, HeldOut(dataset.x[held], dataset.y[held], held)
    if isinstance(v.dataset, UploadedDataset) and datasets_dir is not None:
        x, y = load_uploaded(v.dataset, datasets_dir)
        shown = f"uploaded {v.dataset.id!r}"
    elif isinstance(v.dataset, NpzDataset):
        x, y = load_npz(v.dataset, data_root)
        shown = repr(v.dataset.path)
    else:
        raise InvalidDataset("validation.dataset must be of kind 'npz' or 'uploaded'. "
                             f"Received: kind={v.dataset.kind!r}")
    if tuple(x.shape[1:]) != tuple(input_shape) or y.shape[1:] != dataset.y.shape[1:]:
        raise InvalidDataset(f"validation.dataset {shown} holds x of shape {tuple(x.shape[1:])} and y of "
                             f"{tuple(y.shape[1:])} per row; expected those of the training data: "
                             f"{tuple(input_shape)} and {tuple(dataset.y.shape[1:])}.")
    return dataset, HeldOut(x, y, np.arange(len(x)))


def data_use(dataset: Dataset, held_out: HeldOut | None, steps_done: int) -> DataUse:
    """What training does with the data, in the summary's words."""
    rows, per_epoch = len(dataset.x), dataset.steps_per_epoch
    return DataUse(rows=rows, held_out_rows=0 if held_out is None else len(held_out.rows), steps_per_epoch=per_epoch,
                   epochs=steps_done / per_epoch, dropped_per_epoch=rows % dataset.batch_size)
