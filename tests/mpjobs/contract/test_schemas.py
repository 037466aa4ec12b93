"""Bad input is refused with the field named and the allowed values listed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from mpjobs.contract.model_specs import KERAS_MODULES
from mpjobs.contract.spec import JobSpec


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
    import mpjobs.contract.model_specs as model_specs

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

    from mpjobs.contract.model_specs import KERAS_LOSSES, LOSS_ALIASES

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
    from mpjobs.contract.spec import ComparisonSpec

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


# --- strict types: a number is a JSON number, never a string or a boolean --------------------

FIXED = {"mode": "fixed", "scale": 1024}
DYNAMIC = {"mode": "dynamic"}
NUMBER_FIELDS: list[tuple[str, str, Any, Any]] = [
    # (model, field, where it goes in a spec -> the spec, the loc of its error), a valid value
    ("TrainingSpec", "steps", lambda v: {"model": MLP, "training": {"steps": v}}, 10),
    ("TrainingSpec", "batch_size", lambda v: {"model": MLP, "training": {"batch_size": v}}, 8),
    ("TrainingSpec", "learning_rate", lambda v: {"model": MLP, "training": {"learning_rate": v}}, 1),
    ("TrainingSpec", "seed", lambda v: {"model": MLP, "training": {"seed": v}}, 3),
    ("TrainingSpec", "checkpoint_every", lambda v: {"model": MLP, "training": {"checkpoint_every": v}}, 5),
    ("TrainingSpec", "max_seconds", lambda v: {"model": MLP, "training": {"max_seconds": v}}, 60),
    ("TrainingSpec", "underflow_check_every", lambda v: {"model": MLP, "training": {"underflow_check_every": v}}, 7),
    ("TrainingSpec", "layer_check_every", lambda v: {"model": MLP, "training": {"layer_check_every": v}}, 7),
    ("TrainingSpec", "devices", lambda v: {"model": MLP, "training": {"devices": v, "batch_size": 32}}, 2),
    ("Fp8Spec", "amax_history_length", lambda v: {"model": MLP, "fp8": {"amax_history_length": v}}, 16),
    ("SyntheticDataset", "samples", lambda v: {"model": MLP, "dataset": {"samples": v}}, 64),
    ("SyntheticDataset", "seed", lambda v: {"model": MLP, "dataset": {"seed": v}}, 1),
    ("FixedLossScale", "scale", lambda v: {"model": MLP, "loss_scale": {**FIXED, "scale": v}}, 8),
    ("DynamicLossScale", "initial_scale", lambda v: {"model": MLP, "loss_scale": {**DYNAMIC, "initial_scale": v}}, 8),
    ("DynamicLossScale", "growth_steps", lambda v: {"model": MLP, "loss_scale": {**DYNAMIC, "growth_steps": v}}, 9),
    ("MlpModel", "input_dim", lambda v: {"model": {**MLP, "input_dim": v}}, 4),
    ("MlpModel", "hidden_units", lambda v: {"model": {**MLP, "hidden_units": v}}, 4),
    ("MlpModel", "classes", lambda v: {"model": {**MLP, "classes": v}}, 4),
    ("CnnModel", "image_size", lambda v: {"model": {"name": "cnn", "image_size": v}}, 16),
    ("CnnModel", "filters", lambda v: {"model": {"name": "cnn", "filters": v}}, 4),
    ("CnnModel", "classes", lambda v: {"model": {"name": "cnn", "classes": v}}, 4),
    ("Conv3dUnetModel", "volume", lambda v: {"model": {"name": "conv3d_unet", "volume": v}}, 8),
    ("Conv3dUnetModel", "filters", lambda v: {"model": {"name": "conv3d_unet", "filters": v}}, 4),
    ("Conv3dUnetModel", "reference_edge", lambda v: {"model": {"name": "conv3d_unet", "reference_edge": v}}, 64),
    ("TransformerModel", "seq_len", lambda v: {"model": {"name": "transformer", "seq_len": v}}, 8),
    ("TransformerModel", "vocab_size", lambda v: {"model": {"name": "transformer", "vocab_size": v}}, 50),
    ("TransformerModel", "d_model", lambda v: {"model": {"name": "transformer", "d_model": v}}, 16),
    ("TransformerModel", "heads", lambda v: {"model": {"name": "transformer", "heads": v}}, 2),
    ("TransformerModel", "layers", lambda v: {"model": {"name": "transformer", "layers": v}}, 1),
    ("TransformerModel", "ffn_dim", lambda v: {"model": {"name": "transformer", "ffn_dim": v}}, 16),
    ("TransformerModel", "dropout", lambda v: {"model": {"name": "transformer", "dropout": v}}, 0),
    ("TransformerModel", "classes", lambda v: {"model": {"name": "transformer", "classes": v}}, 3),
    ("ComparisonSpec", "tolerance", lambda v: {"spec": {"model": MLP}, "tolerance": v}, 1),
    ("ComparisonSpec", "float32_seeds",
     lambda v: {"spec": {"model": MLP, "validation": {"split": 0.2}}, "float32_seeds": v}, 2),
    ("ValidationSplit", "split", lambda v: {"model": MLP, "validation": {"split": v}}, 0.25),
    ("ValidationSplit", "seed", lambda v: {"model": MLP, "validation": {"split": 0.2, "seed": v}}, 4),
    ("ValidationSplit", "eval_every", lambda v: {"model": MLP, "validation": {"split": 0.2, "eval_every": v}}, 5),
    ("ValidationData", "eval_every",
     lambda v: {"model": MLP, "validation": {"dataset": {"kind": "npz", "path": "v.npz"}, "eval_every": v}}, 5),
]


def number_fields_of(model: type[Any], seen: set[type[Any]] | None = None) -> set[tuple[str, str]]:
    """(model, field) of every int and float field reachable from `model`, found by walking its annotations;
    not one that takes a word as well (`steps_per_execution`: "auto"), whose own test names both."""
    from typing import get_args

    from pydantic import BaseModel

    seen = set() if seen is None else seen
    if model in seen:
        return set()
    seen.add(model)
    found: set[tuple[str, str]] = set()
    for name, field in model.model_fields.items():
        pending, types = [field.annotation], []
        while pending:
            kind = pending.pop()
            types.append(kind)
            pending.extend(get_args(kind))
        words = any(getattr(kind, "__origin__", None) is None and isinstance(kind, str) for kind in types)
        if any(kind in (int, float, bool) for kind in types) and not words:
            found.add((model.__name__, name))
        for kind in types:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found |= number_fields_of(kind, seen)
    return found


def test_the_table_of_number_fields_lists_every_number_field_of_the_specs() -> None:
    from mpjobs.contract.spec import ComparisonSpec

    assert {(model, field) for model, field, _, _ in NUMBER_FIELDS} == number_fields_of(ComparisonSpec)


def validate(data: dict[str, Any]) -> Any:
    from mpjobs.contract.spec import ComparisonSpec

    return (ComparisonSpec if "spec" in data else JobSpec).model_validate(data)


@pytest.mark.parametrize(("model", "field", "place", "valid"), NUMBER_FIELDS,
                         ids=[f"{m}.{f}" for m, f, _, _ in NUMBER_FIELDS])
@pytest.mark.parametrize("wrong", ["10", "1.5", True, False], ids=["str-int", "str-float", "true", "false"])
def test_a_number_field_refuses_a_string_or_a_boolean_naming_the_field(
        model: str, field: str, place: Any, valid: Any, wrong: Any) -> None:
    with pytest.raises(ValidationError) as raised:
        validate(place(wrong))
    errs = raised.value.errors()
    assert len(errs) == 1, errs
    assert errs[0]["loc"][-1] == field
    kind = "a boolean" if isinstance(wrong, bool) else "a string"
    assert errs[0]["msg"] == (f"Value error, Expected {field} to be a number, not {kind}. "
                              f"Received: {field}={json.dumps(wrong)}")
    accepted = validate(place(valid))
    assert validate(json.loads(accepted.model_dump_json())) == accepted


def test_whole_floats_stay_accepted_for_ints_and_ints_for_floats() -> None:
    spec = JobSpec.model_validate({"model": MLP, "training": {"steps": 10.0, "learning_rate": 1},
                                   "loss_scale": {"mode": "fixed", "scale": 1024}})
    assert (spec.training.steps, spec.training.learning_rate, spec.loss_scale.scale) == (10, 1.0, 1024.0)  # type: ignore[union-attr]
    assert type(spec.training.steps) is int and type(spec.training.learning_rate) is float
    assert only_error({"model": MLP, "training": {"steps": 10.5}})[0] == "training.steps"
    # What the API stores, the worker reads back (JobSpec.model_validate_json in app/store/jobs.py).
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec
    assert JobSpec.model_validate_json('{"model": {"name": "mlp"}, "training": {"learning_rate": 1}}'
                                       ).training.learning_rate == 1.0


def test_enum_and_literal_strings_stay_accepted() -> None:
    spec = JobSpec.model_validate({"model": MLP, "precision_policy": "mixed_float16", "loss_scale": "dynamic",
                                   "device": "cpu", "training": {"optimizer": "sgd"},
                                   "speed_check": [{"precision_policy": "mixed_bfloat16"}]})
    assert (spec.precision_policy.value, spec.device, spec.training.optimizer) == ("mixed_float16", "cpu", "sgd")


@pytest.mark.parametrize(("place", "loc"), [
    (lambda text: {"model": MLP, "name": text}, "name"),
    (lambda text: {"model": MLP, "dataset": {"kind": "npz", "path": text}}, "dataset.npz.path"),
    (lambda text: {"model": {"keras_json": _keras_json([]).replace('"s"', f'"{text}"'), "loss": "mse"}},
     "model.keras_json.keras_json"),
])
def test_text_with_a_lone_surrogate_is_refused(place: Any, loc: str) -> None:
    """A lone surrogate cannot be stored or sent as UTF-8: refused at the field, not a 500 later."""
    field, msg = only_error(place("a\ud800b"))
    assert field == loc
    assert msg.startswith("Value error, Expected ") and "\\ud800" in msg
    assert JobSpec.model_validate(place("a\U0001f600b"))  # a whole pair, 😀, is text


# --- keras_json: Keras's own modules only; a bounded number of layers ------------------------

KERAS_LAYER_CAP = 1000
SEQUENTIAL_LAYER_CAP = 200
"""docs/reliability.md: a keras_json of more than 1,000 layer configs, or a Sequential of more than 200, is a 422."""


def dense(units: int = 4) -> dict[str, Any]:
    return {"module": "keras.layers", "class_name": "Dense", "config": {"units": units}}


REFUSED_MODULES = ["kerasevil.layers", "keras_evil", "kerasx", "", "os", "builtins", "evil.keras", "Keras",
                   "keras.src.saving", "keras.saving", "keras.src.utils", "keras.utils", "keras.src", "keras.src.ops",
                   "keras.src.layers", "keras.src.models", "keras.src.ops.numpy.evil", "keras.layers.", 5, None, [], {}]


def allowed_modules() -> str:
    """docs/reliability.md's list, written out here rather than read from KERAS_MODULES."""
    return ("'keras', 'keras.constraints', 'keras.dtype_policies', 'keras.initializers', 'keras.layers', "
            "'keras.losses', 'keras.metrics', 'keras.optimizers', 'keras.optimizers.schedules', 'keras.quantizers', "
            "'keras.regularizers', 'keras.src.applications.convnext', 'keras.src.applications.inception_resnet_v2', "
            "'keras.src.models.functional', 'keras.src.ops.core', 'keras.src.ops.einops', 'keras.src.ops.image', "
            "'keras.src.ops.linalg', 'keras.src.ops.math', 'keras.src.ops.nn', 'keras.src.ops.numpy'")


@pytest.mark.parametrize("module", REFUSED_MODULES)
def test_a_module_outside_keras_is_refused(module: Any) -> None:
    layer = {**dense(), "module": module}
    field, msg = only_error({"model": {"keras_json": _keras_json([layer]), "loss": "mse"}})
    assert field == "model.keras_json.keras_json"
    assert msg == (f"Value error, model.keras_json's config.layers[0].module is {module!r} (for 'Dense'); it must be "
                   f"one of Keras's own modules: {allowed_modules()}.")


def test_the_refusal_names_where_the_module_is() -> None:
    initialized = {**dense(), "config": {"units": 4, "kernel_initializer": {
        "module": "keras.src.saving", "class_name": "GlorotUniform", "config": {}}}}
    msg = only_error({"model": {"keras_json": _keras_json([dense(), initialized]), "loss": "mse"}})[1]
    assert msg.startswith("Value error, model.keras_json's config.layers[1].config.kernel_initializer.module is "
                          "'keras.src.saving' (for 'GlorotUniform'); it must be one of")
    root = json.dumps({"module": "keras_evil", "class_name": "Sequential", "config": {"layers": [dense()]}})
    msg = only_error({"model": {"keras_json": root, "loss": "mse"}})[1]
    assert msg.startswith("Value error, model.keras_json's module is 'keras_evil' (for 'Sequential')")


@pytest.mark.parametrize("class_name", [{}, [], 5, None])
def test_a_class_name_that_is_not_text_is_refused_not_an_exception(class_name: Any) -> None:
    field, msg = only_error(keras_spec({"module": "keras", "class_name": class_name, "config": {"layers": []}}))
    assert field == "model.keras_json.keras_json"
    assert msg == ("Value error, model.keras_json must be a Sequential or Functional model from model.to_json(). "
                   f"Received: class_name={class_name!r}")
    nested = sequential([{"module": "keras.layers", "class_name": class_name, "config": {"layers": [dense()]}}])
    assert JobSpec.model_validate(keras_spec(nested))  # not a model, so not counted: Keras refuses it in the worker


@pytest.mark.parametrize("module", sorted(KERAS_MODULES))
def test_each_allowed_module_is_accepted(module: str) -> None:
    assert JobSpec.model_validate({"model": {"keras_json": _keras_json([{**dense(), "module": module}]),
                                             "loss": "mse"}})


def functional(layers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"module": "keras", "class_name": "Functional", "config": {"name": "f", "layers": layers}}


def sequential(layers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"module": "keras", "class_name": "Sequential", "config": {"name": "s", "layers": layers}}


def keras_spec(config: dict[str, Any]) -> dict[str, Any]:
    return {"model": {"keras_json": json.dumps(config), "loss": "mse"}}


def test_keras_json_of_exactly_the_layer_cap_is_accepted_and_one_more_refused() -> None:
    # Four nested Sequentials of 200 layers each (804 configs) and 196 layers of the Functional itself.
    nested = [sequential([dense() for _ in range(SEQUENTIAL_LAYER_CAP)]) for _ in range(4)]
    at_cap = functional([*nested, *[dense() for _ in range(KERAS_LAYER_CAP - 4 - 4 * SEQUENTIAL_LAYER_CAP)]])
    assert JobSpec.model_validate(keras_spec(at_cap))
    over = functional([*nested, *[dense() for _ in range(KERAS_LAYER_CAP + 1 - 4 - 4 * SEQUENTIAL_LAYER_CAP)]])
    field, msg = only_error(keras_spec(over))
    assert field == "model.keras_json.keras_json"
    assert msg == ("Value error, model.keras_json has 1001 layer configs (nested models' included); at most 1000 "
                   "are allowed.")


def test_a_sequential_of_exactly_its_cap_is_accepted_and_one_more_refused() -> None:
    assert JobSpec.model_validate(keras_spec(sequential([dense() for _ in range(SEQUENTIAL_LAYER_CAP)])))
    field, msg = only_error(keras_spec(sequential([dense() for _ in range(SEQUENTIAL_LAYER_CAP + 1)])))
    assert field == "model.keras_json.keras_json"
    assert msg == ("Value error, model.keras_json has a Sequential of 201 layers; at most 200 are allowed "
                   "(Keras loads a Sequential in time that grows with the square of its layers).")
    nested = functional([sequential([dense() for _ in range(SEQUENTIAL_LAYER_CAP + 1)])])
    assert "a Sequential of 201 layers" in only_error(keras_spec(nested))[1]


def test_real_keras_configs_pass_the_checks() -> None:
    """What model.to_json() writes: every module it names is allowed, and its layers are counted."""
    import keras
    from keras import layers

    from mpjobs.contract.model_specs import check_keras_json, layer_count

    head = keras.Sequential([layers.Dense(4), layers.Dense(2, activation="softmax", dtype="float32")])
    inputs = keras.Input((16, 16, 3))
    x = layers.Conv2D(8, 3, kernel_initializer=keras.initializers.HeNormal())(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.Reshape((14 * 14, 8))(x)
    x = layers.MultiHeadAttention(2, 4, kernel_regularizer=keras.regularizers.L2(1e-4))(x, x)
    x = layers.LayerNormalization(dtype=keras.DTypePolicy("mixed_float16"))(x)
    functional_model = keras.Model(inputs, head(layers.GlobalAveragePooling1D()(x)))
    sequential_model = keras.Sequential([keras.Input((8,)), layers.Embedding(100, 16), layers.LayerNormalization(),
                                         layers.Dense(4, kernel_constraint=keras.constraints.MaxNorm(2),
                                                      activity_regularizer="l1", dtype="mixed_float16")])
    resnet = keras.applications.ResNet50(weights=None)
    # Config entries: the Functional's 8 (its InputLayer included) and its head's InputLayer (made when
    # it was built) and 2 layers; the Sequential's InputLayer and 3 layers; ResNet50's 177.
    for model, count in [(functional_model, 8 + 1 + 2), (sequential_model, 1 + 3), (resnet, 177)]:
        config = check_keras_json(model.to_json())
        assert layer_count(config) == count
        assert JobSpec.model_validate({"model": {"keras_json": model.to_json(), "loss": "mse"}})


def modules_in(node: Any) -> set[str]:
    if isinstance(node, dict):
        return ({node["module"]} if "module" in node else set()).union(*map(modules_in, node.values()))
    if isinstance(node, list):
        return set().union(*map(modules_in, node))
    return set()


SIMPLE_ARGS: list[tuple[Any, ...]] = [(), (4,), (2, 3), ((2, 1),), (0.5,), (0.1, 0.1), (4, 4, 2)]
"""Tried in turn on each layer class until one builds it."""


def keras_written_configs() -> Iterator[tuple[str, str]]:
    """(what, model.to_json()) of models built of every public layer class that simple arguments make, and of
    every initializer, regularizer, constraint, activation, dtype policy, quantization, optimizer, loss, metric,
    op and nested model; ConvNeXt's and InceptionResNetV2's own layers stand for those whole applications."""
    import keras
    from keras import layers, ops
    from keras.src.applications.convnext import LayerScale
    from keras.src.applications.inception_resnet_v2 import CustomScaleLayer

    made = 0
    for name in sorted(dir(layers)):
        cls = getattr(layers, name)
        if not isinstance(cls, type) or not issubclass(cls, layers.Layer) or name == "Lambda":
            continue
        for args in SIMPLE_ARGS:
            try:
                layer = cls(*args)
            except Exception:  # noqa: BLE001, S112  these arguments do not fit this class: try the next
                continue
            made += 1
            yield name, keras.Sequential([layer]).to_json()
            break
    assert made >= 150  # of 163 in Keras 3.15: the rest wrap other frameworks' code or take layers
    for wrapped in (layers.Bidirectional(layers.LSTM(2)), layers.RNN(layers.StackedRNNCells([layers.GRUCell(2)])),
                    layers.TimeDistributed(layers.Dense(2)), layers.Permute((2, 1)),
                    layers.RandomTranslation(0.1, 0.1)):
        yield type(wrapped).__name__, keras.Sequential([wrapped]).to_json()
    for family in (keras.initializers, keras.regularizers, keras.constraints):
        inputs = keras.Input((4,))
        outputs = []
        for name in sorted(dir(family)):
            cls = getattr(family, name)
            abstract = name in {"Initializer", "Regularizer", "Constraint"}
            if not isinstance(cls, type) or abstract or "stft" in name.lower():  # STFT's want a 3-D kernel
                continue
            argument = {keras.initializers: "kernel_initializer", keras.regularizers: "kernel_regularizer",
                        keras.constraints: "kernel_constraint"}[family]
            outputs.append(layers.Dense(4, **{argument: cls()})(inputs))
        yield family.__name__, keras.Model(inputs, layers.Concatenate()(outputs)).to_json()
    activations = [getattr(keras.activations, n) for n in dir(keras.activations)
                   if not n.startswith("_") and n not in {"get", "serialize", "deserialize"}]
    yield "activations", keras.Sequential([keras.Input((4,)), *[layers.Dense(4, activation=f) for f in activations],
                                           *[layers.Activation(f) for f in activations]]).to_json()
    for policy in ("float32", "float16", "bfloat16", "mixed_float16", "mixed_bfloat16"):
        inputs = keras.Input((4,))
        x = layers.Dense(4, dtype=keras.DTypePolicy(policy))(layers.Dense(4, dtype=policy)(inputs))
        yield policy, keras.Model(inputs, layers.Dense(2, dtype="float32")(x)).to_json()
    for mode in ("int8", "float8"):
        quantized = keras.Sequential([keras.Input((4,)), layers.Dense(4), layers.Dense(2)])
        quantized.quantize(mode)
        yield f"quantized {mode}", quantized.to_json()
    inner = keras.Input((4,))
    functional_inner = keras.Model(inner, layers.Dense(4)(inner))
    inputs = keras.Input((4,))
    x = keras.Sequential([layers.Dense(4), layers.LayerNormalization()])(functional_inner(inputs))
    x = ops.relu(ops.cast(x + inputs * 2.0, "float32"))
    x = ops.rsqrt(ops.abs(x) + 1.0) / (ops.linalg.norm(x, axis=-1, keepdims=True) + 1.0)
    nested = keras.Model(inputs, x + x[:, :1])
    yield "nested models and ops", keras.Sequential([keras.Input((4,)), nested, functional_inner]).to_json()
    images = keras.Input((8, 8, 16), batch_size=2)
    x = ops.image.resize(LayerScale(1e-6, 16)(images), (4, 4))
    x = CustomScaleLayer(0.2)([x, ops.rearrange(x, "b h w c -> b w h c")])
    yield "applications' layers, image ops and einops", keras.Model(images, x).to_json()
    compiled = keras.Sequential([keras.Input((4,)), layers.Dense(2)])
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    compiled.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(schedule)),
                     loss=keras.losses.Huber(), metrics=[keras.metrics.MeanAbsoluteError()])
    yield "compiled", compiled.to_json()


@pytest.mark.filterwarnings("ignore:Layer InputLayer does not have a `quantize` method")
def test_every_module_keras_writes_is_allowed_and_each_allowed_one_is_written() -> None:
    """The allow-list is exactly what Keras writes: nothing it writes is refused, nothing more is allowed."""
    from mpjobs.contract.model_specs import check_keras_json

    written: set[str] = set()
    for what, text in keras_written_configs():
        check_keras_json(text)  # raises for a module it refuses, naming it
        written |= modules_in(json.loads(text))
        assert JobSpec.model_validate({"model": {"keras_json": text, "loss": "mse"}}), what
    assert written == KERAS_MODULES


def test_a_functional_of_several_inputs_or_outputs_is_refused_at_submission_naming_them() -> None:
    """The worker refuses such a model (tests/worker/engine/test_inputs.py); the API does first, in the same words,
    from the config alone, for each way model.to_json() writes its inputs and outputs."""
    import keras
    from keras import layers

    first, second = keras.Input((3,), name="first"), keras.Input((4,), name="second")
    joined = layers.Concatenate()([first, second])
    why = ("model.keras_json must have exactly one input and one output: mpjobs feeds each step one array x "
           "(generated, or the .npz's x) and compares the output with one y. Received: ")
    refused = {
        "2 inputs ('first', 'second') and 1 output ('out')": keras.Model([first, second], layers.Dense(1, name="out")(
            joined)),
        "1 input ('first') and 2 outputs ('a', 'b')": keras.Model(first, [layers.Dense(1, name="a")(first),
                                                                           layers.Dense(1, name="b")(first)]),
        "1 input ('first') and 2 outputs ('c', 'd')": keras.Model(first, {"c": layers.Dense(1, name="c")(first),
                                                                           "d": layers.Dense(1, name="d")(first)}),
    }
    for received, model in refused.items():
        field, message = only_error({"model": {"keras_json": model.to_json(), "loss": "mse"}})
        assert field == "model.keras_json.keras_json" and message == f"Value error, {why}{received}.", message
    # One of each, however written, passes; a nested model may have several (only the model trained is fed).
    inner = keras.Model([first, second], layers.Dense(2)(joined))
    outer_in = keras.Input((3,), name="x")
    wrapped = keras.Model(outer_in, inner([outer_in, layers.Dense(4)(outer_in)]))
    for model in (keras.Model([first], [layers.Dense(1)(first)]), keras.Model({"first": first}, layers.Dense(1)(first)),
                  wrapped):
        assert JobSpec.model_validate({"model": {"keras_json": model.to_json(), "loss": "mse"}})
