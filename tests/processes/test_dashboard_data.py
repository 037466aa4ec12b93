"""The dashboard's data choices and comparison layout in headless Chromium: uploaded datasets and held-out
evaluation in the job form, the synthetic set's repeat stated, and a comparison page that fits 1400 px."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.select import Select

from mpjobs.contract.formats import number, rate
from scripts.stack import Stack, private_stack
from tests.browser import headless_chromium
from tests.processes.test_dashboard import (
    KEY,
    TINY_UNET,
    attr,
    by_testid,
    layer_checks,
    open_dashboard,
    page_errors,
    screenshot,
    set_value,
    shown,
    submit_job,
    text_of,
    wait_for,
)
from tests.processes.test_datasets_http import OCTET, npz_bytes
from tests.worker.numerics.test_plan import CASES, build


@pytest.fixture(scope="module")
def keyed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with private_stack(tmp_path_factory.mktemp("dashboard-data"), API_KEYS=f"{KEY}:tenant-d") as stack:
        yield stack


@pytest.fixture(scope="module")
def api(keyed_stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed_stack.base_url, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    with headless_chromium("--window-size=1400,1000", browser_logs=True) as driver:
        yield driver


def upload(api: httpx.Client, rows: int) -> dict[str, Any]:
    """An .npz the form's default mlp fits (784 inputs, 10 classes); returns its DatasetRecord."""
    rng = np.random.default_rng(7)
    body = npz_bytes(x=rng.standard_normal((rows, 784)).astype(np.float32), y=rng.integers(0, 10, rows))
    answer = api.post("/datasets", content=body, headers=OCTET)
    assert answer.status_code in (200, 201), answer.text
    record: dict[str, Any] = api.get(f"/datasets/{answer.json()['id']}").json()
    return record


def test_the_form_lists_an_uploaded_dataset_and_submits_a_job_that_names_it(
        keyed_stack: Stack, api: httpx.Client, browser: WebDriver) -> None:
    record = upload(api, 48)
    open_dashboard(browser, keyed_stack, "#/jobs")
    option = wait_for(browser, lambda d: d.find_elements(
        By.CSS_SELECTOR, f'[data-field="dataset.kind"] option[data-dataset-id="{record["id"]}"]'), 60,
        "the uploaded dataset in the select")[0]  # an event, not a speed: the form's first GET /datasets
    assert record["id"][:12] in option.text and "[48, 784]" in option.text and "[48]" in option.text
    assert f"{rate(record['bytes'])} bytes" in option.text
    select = Select(browser.find_element(By.CSS_SELECTOR, '[data-field="dataset.kind"]'))
    assert select.first_selected_option.get_attribute("value") == "synthetic"  # the default
    select.select_by_value(f"uploaded:{record['id']}")
    assert not by_testid(browser, "synthetic-repeat-hint").is_displayed()  # no synthetic rows to repeat
    by_testid(browser, "validation-enabled").click()
    set_value(browser, "validation.split", 0.25)
    browser.find_element(By.CSS_SELECTOR, '[data-metric="accuracy"]').click()
    job_id = submit_job(browser, {"name": "on an upload", "model.name": "mlp", "precision_policy": "float32",
                                  "training.steps": 3, "training.batch_size": 8})
    spec = api.get(f"/jobs/{job_id}").json()["spec"]
    assert spec["dataset"] == {"kind": "uploaded", "id": record["id"]}
    assert spec["validation"]["split"] == 0.25 and spec["validation"]["metrics"] == ["accuracy"]

    # A metric the model's loss cannot take lands beside the metrics, and nothing is queued.
    before = len(api.get("/jobs").json()["jobs"])
    browser.find_element(By.CSS_SELECTOR, '[data-metric="accuracy"]').click()
    browser.find_element(By.CSS_SELECTOR, '[data-metric="auc"]').click()
    by_testid(browser, "submit-job").click()
    error = wait_for(browser, shown("error-validation.metrics"), 10, "the error beside the metrics")
    assert "'auc' cannot measure" in error.text and "sparse_categorical_accuracy" in error.text
    assert not by_testid(browser, "form-errors").is_displayed()
    assert len(api.get("/jobs").json()["jobs"]) == before
    screenshot(browser, "dashboard-form-data.png")
    assert page_errors(browser) == []


def test_the_synthetic_repeat_is_stated_from_the_spec(
        keyed_stack: Stack, api: httpx.Client, browser: WebDriver) -> None:
    open_dashboard(browser, keyed_stack, "#/jobs")
    hint = wait_for(browser, lambda d: by_testid(d, "synthetic-repeat-hint").is_displayed()
                    and text_of(d, "synthetic-repeat-hint"), 10, "the synthetic repeat hint")
    assert f"repeat every {4096 // 32} steps at batch 32" in hint
    set_value(browser, "training.batch_size", 50)
    wait_for(browser, lambda d: f"repeat every {4096 // 50} steps at batch 50" in text_of(d, "synthetic-repeat-hint"),
             5, "the hint to follow the batch size")

    spec = {"name": "repeat", "model": {"name": "mlp", "input_dim": 8, "hidden_units": 8, "classes": 3},
            "precision_policy": "float32", "dataset": {"kind": "synthetic", "samples": 1000},
            "training": {"steps": 2, "batch_size": 50}, "layer_policies": {"dense_1": "mixed_bfloat16"}}
    job = api.post("/jobs", json=spec)
    assert job.status_code in (200, 201, 202), job.text
    open_dashboard(browser, keyed_stack, f"#/jobs/{job.json()['id']}")
    note = wait_for(browser, lambda d: text_of(d, "synthetic-repeat"), 10, "the repeat note on the job page")
    assert f"1,000 training rows repeat every {1000 // 50} steps at batch 50" in note
    assert text_of(browser, "layer-policies").strip() == "dense_1 in mixed_bfloat16 ·"
    screenshot(browser, "dashboard-job-repeat.png")


def test_the_comparison_page_fits_1400px_and_every_loss_curve_shows(
        keyed_stack: Stack, api: httpx.Client, browser: WebDriver) -> None:
    # The tiny U-Net underflows under float16 (test_dashboard.py): its variants carry long diagnoses.
    spec = {"model": TINY_UNET, "dataset": {"kind": "synthetic", "samples": 8},
            "training": {"steps": 3, "batch_size": 2, "optimizer": "sgd", "learning_rate": 0.1,
                         "underflow_check_every": 1},
            "validation": {"split": 0.25, "eval_every": 0}}
    answer = api.post("/comparisons", json={"name": "a comparison that fits the page", "spec": spec})
    assert answer.status_code in (200, 201, 202), answer.text
    comparison_id = answer.json()["id"]
    comparison = wait_for(browser, lambda _: (c := api.get(f"/comparisons/{comparison_id}").json())["state"] == "done"
                          and c, 180, "the comparison to finish")
    assert browser.get_window_size()["width"] == 1400
    open_dashboard(browser, keyed_stack, f"#/comparisons/{comparison_id}")
    variants = comparison["variants"]
    finite = sum(p["loss"] is not None for v in variants
                 for p in api.get(f"/jobs/{v['job_id']}/metrics").json()["points"])
    wait_for(browser, lambda d: attr(d, "comparison-page", "data-state") == "done"
             and attr(d, "chart-comparison-loss", "data-points") == str(finite), 20,
             f"every loss curve ({finite} finite points; {[v['state'] for v in variants]})")

    # No sideways scroll: the page and every diagnoses cell fit the 1400 px window.
    fit = browser.execute_script("""const root = document.documentElement;
        return { scroll: root.scrollWidth, client: root.clientWidth, inner: window.innerWidth,
                 right: [...document.querySelectorAll('[data-testid="variant-row"] .diag-cell')]
                   .map((td) => td.getBoundingClientRect().right),
                 wrap: [...document.querySelectorAll('.table-wrap')].map((w) => w.scrollWidth - w.clientWidth) };""")
    assert any(v["diagnoses"] for v in variants)  # long text to wrap
    assert fit["scroll"] <= fit["client"], fit
    assert len(fit["right"]) == len(variants) and max(fit["right"]) <= fit["client"], fit
    assert max(fit["wrap"]) <= 0, fit  # nor inside the table's own box

    # Each variant's curve has its own colour, dash and width: none hides another.
    styles = json.loads(attr(browser, "chart-comparison-loss", "data-styles") or "[]")
    assert [s["label"] for s in styles] == [v["label"] for v in variants]
    looks = {(s["stroke"], tuple(s["dash"]), s["width"]) for s in styles}
    assert len(looks) == len(variants) and len({tuple(s["dash"]) for s in styles}) == len(variants)
    gap = json.loads(attr(browser, "chart-comparison-loss-gap", "data-styles") or "[]")
    assert [s["label"] for s in gap] == [v["label"] for v in variants]

    # The held-out column: each variant job's final evaluation (the report carries no held_out here), or "–" for
    # a job that ended without one. A succeeded job of a spec with validation always has one.
    cells = browser.find_elements(By.CSS_SELECTOR, '[data-testid="variant-row"] [data-testid="held-out"]')
    jobs = [api.get(f"/jobs/{variant['job_id']}").json() for variant in variants]
    ended = {v["label"]: (job["state"], job["error"], (job["summary"] or {}).get("validation"))
             for v, job in zip(variants, jobs, strict=True)}
    for cell, variant, job in zip(cells, variants, jobs, strict=True):
        validation = (job["summary"] or {}).get("validation")
        assert job["state"] != "succeeded" or validation, ended
        if variant.get("held_out"):
            assert cell.get_attribute("data-source") == "report", ended
            assert cell.text.startswith(variant["held_out"]["metric"])
        elif validation:
            assert cell.get_attribute("data-source") == "job", ended
            expected = [f"loss {number(validation['loss'])}",
                        *(f"{name} {number(value)}" for name, value in validation["metrics"].items())]
            assert cell.text == ", ".join(expected)
        else:
            assert (cell.get_attribute("data-source"), cell.text) == ("none", "–"), ended
    baseline = next(job for v, job in zip(variants, jobs, strict=True) if v["baseline"])
    assert baseline["state"] == "succeeded", ended  # float32's cell always shows the "job" branch
    screenshot(browser, "dashboard-comparison-1400.png")
    open_dashboard(browser, keyed_stack, f"#/jobs/{variants[1]['job_id']}")
    wait_for(browser, lambda d: text_of(d, "synthetic-repeat"), 10, "the job page")
    screenshot(browser, "dashboard-job-1400.png")

    # Issue 32, item 7: each variant's Layers panel cites its own dtype's smallest subnormal, and prints no "null".
    smallest, seen = {"float16": "2^-24", "bfloat16": "2^-133"}, set()
    for variant, job in zip(variants, jobs, strict=True):
        checks = layer_checks(api, variant["job_id"])
        if not checks or job["state"] != "succeeded":
            continue
        dtype = checks[-1]["compute_dtype"]
        seen.add(dtype)
        open_dashboard(browser, keyed_stack, f"#/jobs/{variant['job_id']}")
        caption = wait_for(browser, lambda d: attr(d, "layers-panel", "data-job-state") == "succeeded"
                           and text_of(d, "layers-caption"), 20, f"{variant['label']}'s Layers panel")
        assert f"{dtype}'s smallest subnormal is {smallest[dtype]}" in caption, caption
        assert "null" not in by_testid(browser, "layers-panel").text.split(), variant["label"]
    assert "float16" in seen and ("bfloat16" in seen or ended["mixed_bfloat16"][0] != "succeeded"), ended
    assert page_errors(browser) == []


def test_the_job_page_shows_the_precision_plan(keyed_stack: Stack, api: httpx.Client, browser: WebDriver) -> None:
    """Issue 32, item 3: the plan of an overflowing model (tests/worker/numerics/test_plan.py), as the API has it."""
    model = {"keras_json": build(CASES["overflow"], "functional").to_json(), "loss": "sparse_categorical_crossentropy"}
    job = api.post("/jobs", json={"model": model, "precision_policy": "mixed_float16", "training": {"steps": 1,
                                  "batch_size": 16}, "dataset": {"samples": 32}})
    assert job.status_code in (200, 201, 202), job.text
    job_id = job.json()["id"]
    plan = wait_for(browser, lambda _: (r := api.get(f"/jobs/{job_id}/plan")).status_code == 200 and r.json(), 120,
                    "the job's plan")
    open_dashboard(browser, keyed_stack, f"#/jobs/{job_id}")
    message = wait_for(browser, lambda d: text_of(d, "plan-message"), 30, "the plan on the job page")
    assert message == plan["plan"]["message"] and "`loud`, `quiet`" in message
    assert json.loads(text_of(browser, "plan-fragment")) == plan["spec_fragment"]
    assert text_of(browser, "plan-keras").strip() == plan["keras"]
    assert attr(browser, "plan", "data-holds") == "true"
    assert page_errors(browser) == []
