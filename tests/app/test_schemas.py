"""Bad input is refused with the field named and the allowed values listed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from app.core.spec import JobSpec


def errors_of(data: dict[str, Any]) -> list[dict[str, Any]]:
    with pytest.raises(ValidationError) as raised:
        JobSpec.model_validate(data)
    return raised.value.errors()


def only_error(data: dict[str, Any]) -> tuple[str, str]:
    errs = errors_of(data)
    assert len(errs) == 1, errs
    return ".".join(map(str, errs[0]["loc"])), errs[0]["msg"]


MLP = {"name": "mlp"}


def test_defaults_are_filled_in() -> None:
    spec = JobSpec.model_validate({"model": MLP, "precision_policy": "mixed_float16"})
    assert spec.model_dump(mode="json")["loss_scale"] == {"mode": "dynamic", "initial_scale": 32768.0,
                                                          "growth_steps": 2000}
    assert JobSpec.model_validate({"model": MLP, "precision_policy": "float16"}).loss_scale.mode == "dynamic"  # type: ignore[union-attr]
    for policy in ("float32", "mixed_bfloat16", "bfloat16"):
        assert JobSpec.model_validate({"model": MLP, "precision_policy": policy}).loss_scale.mode == "none"  # type: ignore[union-attr]


@pytest.mark.parametrize(("bare", "expected"), [
    ("none", {"mode": "none"}),
    ("fixed", {"mode": "fixed", "scale": 1024.0}),
    ("dynamic", {"mode": "dynamic", "initial_scale": 32768.0, "growth_steps": 2000}),
])
def test_bare_loss_scale_strings(bare: str, expected: dict[str, Any]) -> None:
    spec = JobSpec.model_validate({"model": MLP, "loss_scale": bare})
    assert spec.model_dump(mode="json")["loss_scale"] == expected


def test_unknown_policy_lists_the_policies() -> None:
    field, msg = only_error({"model": MLP, "precision_policy": "fp8"})
    assert field == "precision_policy"
    assert msg == "Input should be 'float32', 'mixed_float16', 'mixed_bfloat16', 'float16' or 'bfloat16'"


@pytest.mark.parametrize("loss_scale", ["sometimes", {"mode": "sometimes"}])
def test_unknown_loss_scale_mode_lists_the_modes(loss_scale: object) -> None:
    field, msg = only_error({"model": MLP, "loss_scale": loss_scale})
    assert field == "loss_scale"
    assert "'none'" in msg and "'fixed'" in msg and "'dynamic'" in msg


@pytest.mark.parametrize("rate", [float("nan"), float("inf"), -0.001, 0.0])
def test_bad_learning_rate(rate: float) -> None:
    field, _ = only_error({"model": MLP, "training": {"learning_rate": rate}})
    assert field == "training.learning_rate"


def test_nan_in_json_text_is_refused() -> None:
    text = '{"model": {"name": "mlp"}, "training": {"learning_rate": NaN}}'
    with pytest.raises(ValidationError) as raised:
        JobSpec.model_validate_json(text)
    assert raised.value.errors()[0]["loc"][:2] == ("training", "learning_rate")


def test_unknown_model_names_the_choices() -> None:
    field, msg = only_error({"model": {"name": "resnet"}})
    assert field == "model"
    assert all(name in msg for name in ("mlp", "cnn", "conv3d_unet", "transformer", "keras_json"))


def test_unknown_fields_are_refused() -> None:
    assert only_error({"model": MLP, "trainng": {}})[0] == "trainng"
    assert only_error({"model": {"name": "mlp", "width": 3}})[0] == "model.mlp.width"


@pytest.mark.parametrize(("field", "value"), [
    ("steps", 0), ("steps", 10**9), ("batch_size", 0), ("seed", -1), ("checkpoint_every", 0),
])
def test_training_fields_are_bounded(field: str, value: int) -> None:
    assert only_error({"model": MLP, "training": {field: value}})[0] == f"training.{field}"


@pytest.mark.parametrize("devices", [0, 17, 1000])
def test_devices_name_the_allowed_range(devices: int) -> None:
    where, message = only_error({"model": MLP, "training": {"devices": devices}})
    assert where == "training.devices" and ("1" if devices < 1 else "16") in message


def test_the_batch_must_split_evenly_over_the_devices() -> None:
    where, message = only_error({"model": MLP, "training": {"devices": 3, "batch_size": 32}})
    assert where == "training" and "batch_size=32, devices=3" in message
    assert JobSpec.model_validate({"model": MLP, "training": {"devices": 4, "batch_size": 32}}).training.devices == 4


def _keras_json(layers: list[dict[str, Any]]) -> str:
    return json.dumps({"module": "keras", "class_name": "Sequential",
                       "config": {"name": "s", "layers": layers}})


def test_lambda_layer_is_refused_before_parsing() -> None:
    lam = {"module": "keras.layers", "class_name": "Lambda", "config": {"function": "os.system"}}
    field, msg = only_error({"model": {"keras_json": _keras_json([lam]), "loss": "mean_squared_error"}})
    assert field == "model.keras_json.keras_json"
    assert "Lambda" in msg


def test_custom_and_foreign_classes_are_refused() -> None:
    custom = {"module": "mypkg.layers", "class_name": "Evil", "config": {}}
    assert "mypkg.layers" in only_error({"model": {"keras_json": _keras_json([custom]), "loss": "huber"}})[1]
    registered = {"module": "keras.layers", "class_name": "Evil", "registered_name": "pkg>Evil", "config": {}}
    assert "pkg>Evil" in only_error({"model": {"keras_json": _keras_json([registered]), "loss": "huber"}})[1]


def test_deep_keras_json_is_refused() -> None:
    deep: Any = {}
    for _ in range(200):
        deep = {"config": deep}
    text = _keras_json([deep])
    assert "nested deeper" in only_error({"model": {"keras_json": text, "loss": "huber"}})[1]


KERAS_JSON_CHARS = 1_000_000
KERAS_JSON_LEVELS = 64
"""docs/reliability.md: `keras_json` over 1,000,000 characters, or nested over 64 levels, is a 422."""


def padded_keras_json(chars: int) -> str:
    """A valid Sequential config, `chars` characters long: trailing whitespace is still JSON."""
    text = _keras_json([{"module": "keras.layers", "class_name": "Dense", "config": {"units": 1}}])
    return text + " " * (chars - len(text))


def test_keras_json_of_exactly_the_character_limit_is_accepted_and_one_more_refused_before_parsing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import app.core.model_specs as model_specs

    parsed: list[int] = []
    real_loads = json.loads

    def loads(text: str, **kwargs: Any) -> Any:
        parsed.append(len(text))
        return real_loads(text, **kwargs)

    monkeypatch.setattr(model_specs.json, "loads", loads)
    at_limit = padded_keras_json(KERAS_JSON_CHARS)
    assert len(at_limit) == KERAS_JSON_CHARS
    spec = JobSpec.model_validate({"model": {"keras_json": at_limit, "loss": "huber"}})
    assert spec.model.keras_json == at_limit  # type: ignore[union-attr]
    assert parsed == [KERAS_JSON_CHARS]

    parsed.clear()
    errs = errors_of({"model": {"keras_json": at_limit + " ", "loss": "huber"}})
    assert [(e["loc"], e["type"], e["msg"]) for e in errs] == [
        (("model", "keras_json", "keras_json"), "string_too_long", "String should have at most 1000000 characters")]
    assert parsed == [], "refused before the parser saw it"


def nesting(value: Any) -> int:
    """How many containers the deepest value lies inside: a value of the root object is at level 1."""
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return max((1 + nesting(child) for child in children), default=0)


def nested_keras_json(levels: int, innermost: Any) -> str:
    """A Sequential config whose deepest value, `innermost`, lies exactly `levels` containers deep."""
    deep: Any = innermost
    while True:
        text = _keras_json([deep])
        reached = nesting(json.loads(text))
        if reached == levels:
            return text
        assert reached < levels
        deep = {"config": deep}


@pytest.mark.parametrize("innermost", ["a string", 1.5, {}, []], ids=["string", "number", "empty-dict", "empty-list"])
def test_keras_json_nested_exactly_64_levels_is_accepted_and_65_refused(innermost: Any) -> None:
    at_limit = nested_keras_json(KERAS_JSON_LEVELS, innermost)
    assert JobSpec.model_validate({"model": {"keras_json": at_limit, "loss": "huber"}})
    field, msg = only_error({"model": {"keras_json": nested_keras_json(KERAS_JSON_LEVELS + 1, innermost),
                                       "loss": "huber"}})
    assert field == "model.keras_json.keras_json"
    assert msg == "Value error, model.keras_json is nested deeper than 64 levels."


def test_keras_json_loss_lists_choices() -> None:
    field, msg = only_error({"model": {"keras_json": _keras_json([]), "loss": "poisson"}})
    assert field == "model.keras_json.loss"
    assert "'mean_squared_error'" in msg and "'output_mean'" in msg


@pytest.mark.parametrize("path", ["../secret.npz", "/etc/passwd", "a/../../b.npz", "a\\..\\b.npz"])
def test_dataset_path_must_stay_inside_the_data_root(path: str) -> None:
    field, msg = only_error({"model": MLP, "dataset": {"kind": "npz", "path": path}})
    assert field == "dataset.npz.path"
    assert "data root" in msg


def test_transformer_heads_must_divide_width() -> None:
    field, msg = only_error({"model": {"name": "transformer", "d_model": 65, "heads": 4}})
    assert field == "model.transformer"
    assert "d_model=65" in msg


@pytest.mark.parametrize(("alias", "name"), [
    ("mse", "mean_squared_error"), ("MAE", "mean_absolute_error"), ("mape", "mean_absolute_percentage_error"),
    ("msle", "mean_squared_logarithmic_error"), ("bce", "binary_crossentropy"), ("kld", "kl_divergence"),
    ("CategoricalCrossentropy", "categorical_crossentropy"), ("LogCosh", "log_cosh"), ("hinge", "hinge"),
])
def test_keras_loss_aliases_become_the_long_name(alias: str, name: str) -> None:
    spec = JobSpec.model_validate({"model": {"keras_json": _keras_json([]), "loss": alias}})
    assert spec.model.loss == name  # type: ignore[union-attr]
    assert spec.model_dump(mode="json")["model"]["loss"] == name


def test_unknown_loss_names_the_field_and_every_allowed_name() -> None:
    field, msg = only_error({"model": {"keras_json": _keras_json([]), "loss": "logcosh"}})
    assert field == "model.keras_json.loss"
    assert msg.startswith("Value error, model.loss must be one of 'sparse_categorical_crossentropy', ")
    assert all(f"'{name}'" in msg for name in ("log_cosh", "output_mean", "mse", "kld", "MeanSquaredError"))
    assert msg.endswith("Received: loss='logcosh'")


def test_every_accepted_loss_name_is_the_keras_loss_it_stands_for() -> None:
    import keras
    from keras.src.losses import ALL_OBJECTS_DICT

    from app.core.model_specs import KERAS_LOSSES, LOSS_ALIASES

    functions = {name: keras.losses.get(name) for name in KERAS_LOSSES if name != "output_mean"}
    assert all(fn.__name__ == name for name, fn in functions.items())
    for alias, name in LOSS_ALIASES.items():
        resolved = keras.losses.get(alias)
        assert getattr(resolved, "fn", resolved) is functions[name], alias
    # Every other name Keras resolves to one of these losses is listed too.
    for key in ALL_OBJECTS_DICT:
        try:
            resolved = keras.losses.get(key)
        except (TypeError, ValueError):  # base classes that need arguments
            continue
        if getattr(resolved, "fn", resolved) in functions.values():
            assert key in KERAS_LOSSES or key in LOSS_ALIASES, key


def test_comparison_jobs_are_named_after_the_comparison_or_the_model_never_after_the_specs_policy() -> None:
    from app.core.spec import ComparisonSpec

    spec = {"name": "mlp mixed_float16", "model": MLP, "precision_policy": "mixed_float16", "loss_scale": "none"}
    jobs = ComparisonSpec.model_validate({"spec": spec}).job_specs()
    assert [j.name for j in jobs] == ["mlp · float32", "mlp · mixed_float16 + dynamic", "mlp · mixed_float16 + none",
                                      "mlp · mixed_bfloat16"]
    assert [j.precision_policy.value for j in jobs] == ["float32", "mixed_float16", "mixed_float16", "mixed_bfloat16"]
    named = ComparisonSpec.model_validate({"name": "widths", "spec": spec, "variants": [
        {"precision_policy": "float32"}, {"precision_policy": "bfloat16"}]})
    assert [j.name for j in named.job_specs()] == ["widths · float32", "widths · bfloat16"]
    # A name as long as a job's may be is cut; the variant's label is kept whole.
    fixed = {"precision_policy": "mixed_float16", "loss_scale": {"mode": "fixed", "scale": 1024}}
    long = ComparisonSpec.model_validate({"name": "x" * 200, "spec": spec,
                                          "variants": [{"precision_policy": "float32"}, fixed]})
    assert [j.name for j in long.job_specs()] == ["x" * 190 + " · float32",
                                                  "x" * 171 + " · mixed_float16 + fixed 1024"]
