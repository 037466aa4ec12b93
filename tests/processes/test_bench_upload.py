"""The upload benchmark in quick mode: it runs end to end and sets the upload beside a plain copy."""

from __future__ import annotations

from bench import upload


def test_the_upload_is_measured_beside_a_plain_copy_of_the_same_bytes() -> None:
    throughput, timed, floor, check = upload.run(quick=True)
    assert throughput.unit == "MB/s" and throughput.value > 0 and throughput.baseline_value
    assert timed.unit == "s" and timed.value > 0 and timed.baseline_value and timed.ratio and timed.ratio > 0
    assert timed.goal == "<= 2x a plain copy" and timed.met == (timed.ratio <= 2)
    assert floor.unit == check.unit == "s" and floor.value > 0 and check.value > 0
    assert floor.baseline_value == check.baseline_value == timed.baseline_value
