"""Step 1 comes as fast at any run length: the data is gathered a segment at a time, the first one small.

Reported: time to the first step grew with `steps` (2.3 s at 300 steps, 6.5-7 s at 5,000 for the
mlp), because up to 256 MiB of batches were gathered before step 1. `bench/service_overhead.py`
times dequeue -> step 1 at 300 and 50,000 steps.
"""

from __future__ import annotations

import numpy as np

from worker.engine.data import FIRST_SEGMENT_BYTES, SEGMENT_BYTES, Dataset

BATCH = 32
FEATURES = 784


def dataset(samples: int = 4096) -> Dataset:
    rng = np.random.default_rng(0)
    return Dataset(rng.standard_normal((samples, FEATURES), dtype=np.float32),
                   rng.integers(0, 10, samples).astype(np.int32), BATCH, seed=3)


def step_bytes() -> int:
    return BATCH * FEATURES * 4 + BATCH * 4


def test_the_first_segment_is_the_same_few_mib_for_300_steps_and_for_50000() -> None:
    data = dataset()
    firsts = [next(data.segments(0, steps))[0] for steps in (300, 50_000)]
    assert firsts[0].shape == firsts[1].shape
    assert firsts[0].nbytes <= FIRST_SEGMENT_BYTES and len(firsts[0]) == (FIRST_SEGMENT_BYTES // step_bytes()) * BATCH


def test_segments_double_up_to_the_cap_and_hold_every_batch_in_order() -> None:
    data, steps = dataset(), 9_000
    # Exactly the batches `batches` yields (the documented order: a pure function of seed and step), each
    # segment checked against its rows as it comes: the ~900 MB are never held, or joined, twice.
    expected, sizes = data.batches(0, steps), []
    run_x, run_y, at = np.empty((0, FEATURES), np.float32), np.empty((0,), np.int32), 0
    for x, y in data.segments(0, steps):
        sizes.append(len(x) // BATCH)
        done = 0
        while done < len(x):  # a segment and a run of `batches` need not start at the same row
            if at == len(run_x):
                (run_x, run_y), at = next(expected), 0
            n = min(len(x) - done, len(run_x) - at)
            assert np.array_equal(x[done:done + n], run_x[at:at + n]), f"rows {done}-{done + n} of a segment"
            assert np.array_equal(y[done:done + n], run_y[at:at + n]), f"rows {done}-{done + n} of a segment"
            done, at = done + n, at + n
    assert at == len(run_x) and next(expected, None) is None, "the segments hold every batch"
    first = FIRST_SEGMENT_BYTES // step_bytes()
    cap = max(data.steps_per_epoch, SEGMENT_BYTES // step_bytes())
    assert sizes[:-1] == [min(first * 2**i, cap) for i in range(len(sizes) - 1)] and sum(sizes) == steps


def test_a_resumed_run_starts_its_segments_at_its_checkpoint() -> None:
    data = dataset()
    whole = np.concatenate([x for x, _ in data.segments(0, 700)])
    resumed = np.concatenate([x for x, _ in data.segments(300, 700)])
    assert np.array_equal(resumed, whole[300 * BATCH:])
