"""`training.steps_per_execution`: "auto" or a whole number of steps per call, anything else refused naming both."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mpjobs.contract.spec import JobSpec
from mpjobs.contract.training_spec import MAX_STEPS_PER_EXECUTION


def per_call(value: object) -> object:
    spec = JobSpec.model_validate({"model": {"name": "mlp"}, "training": {"steps_per_execution": value}})
    return spec.training.steps_per_execution


def test_auto_by_default_and_whole_numbers_up_to_the_most() -> None:
    assert JobSpec.model_validate({"model": {"name": "mlp"}}).training.steps_per_execution == "auto"
    assert per_call("auto") == "auto"
    assert per_call(1) == 1 and per_call(8.0) == 8 and per_call(MAX_STEPS_PER_EXECUTION) == MAX_STEPS_PER_EXECUTION


@pytest.mark.parametrize(("value", "shown"), [
    ("8", '"8"'), ("Auto", '"Auto"'), (True, "true"), (0, "0"), (MAX_STEPS_PER_EXECUTION + 1, "257"), (2.5, "2.5"),
    (None, "null"), ([8], "[8]"),
])
def test_anything_else_is_refused_naming_the_field_and_what_it_takes(value: object, shown: str) -> None:
    with pytest.raises(ValidationError) as raised:
        per_call(value)
    errors = raised.value.errors()
    assert len(errors) == 1 and errors[0]["loc"] == ("training", "steps_per_execution")
    assert errors[0]["msg"] == ('Value error, Expected steps_per_execution to be "auto" or a whole number of steps '
                                f"from 1 to {MAX_STEPS_PER_EXECUTION}. Received: steps_per_execution={shown}")
