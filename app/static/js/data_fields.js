// The job form's data fields: the dataset (synthetic or one of the caller's uploads, from
// GET /datasets) and held-out evaluation (a validation split and its metrics); and the words
// for how often a synthetic set repeats, shared with the job page.

import { api } from "./api.js";
import { fmtRate, h } from "./dom.js";

export const SYNTHETIC_SAMPLES = 4096; // mpjobs/contract/spec.py SyntheticDataset.samples's default
// mpjobs/contract/evaluation.py METRICS: the Keras metric names validation.metrics takes.
export const METRICS = ["accuracy", "sparse_categorical_accuracy", "categorical_accuracy", "binary_accuracy",
  "mae", "mse", "auc"];

// The rows a job trains on once `validation.split` is held out (worker/engine/data.py split_rows).
export function trainingRows(samples, validation) {
  const split = validation?.split;
  if (typeof split !== "number" || !(split > 0 && split < 1)) return samples;
  const held = Math.max(1, Math.min(samples - 1, Math.floor(split * samples + 0.5)));
  return samples - held;
}

// "The synthetic set's 4,096 rows repeat every 128 steps at batch 32 ...": null when no full batch fits.
export function repeatText(samples, batchSize, validation) {
  const rows = trainingRows(samples, validation);
  if (!(rows >= 1 && batchSize >= 1)) return null;
  const steps = Math.floor(rows / batchSize);
  if (steps < 1) return null;
  const held = rows === samples ? "" : ` (${fmtRate(samples - rows)} held out)`;
  return `The synthetic set's ${fmtRate(rows)} training rows${held} repeat every ${fmtRate(steps)} `
    + `step${steps === 1 ? "" : "s"} at batch ${fmtRate(batchSize)} (rows // batch size; the partial batch `
    + `is dropped), so from step ${fmtRate(steps)} on the model sees rows it has trained on and the loss `
    + "drops sharply there: memorisation, not a precision effect.";
}

function datasetLabel(d) {
  const shape = (a) => `[${a.shape.join(", ")}] ${a.dtype}`;
  return `${d.id.slice(0, 12)} · x ${shape(d.x)} · y ${shape(d.y)} · ${fmtRate(d.bytes)} bytes`;
}

// Fills the dataset select from GET /datasets; "synthetic" stays first and chosen.
export async function loadDatasets(form) {
  const select = form.querySelector("[data-field='dataset.kind']");
  const note = form.querySelector("[data-testid=datasets-note]");
  try {
    const page = await api.get("/datasets");
    const chosen = select.value;
    select.replaceChildren(h("option", { value: "synthetic" }, `synthetic (${fmtRate(SYNTHETIC_SAMPLES)} rows)`),
      ...page.datasets.map((d) => h("option", { value: `uploaded:${d.id}`, "data-dataset-id": d.id,
        title: d.id }, datasetLabel(d))));
    if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
    note.textContent = page.datasets.length ? "" : "No uploaded datasets: `mpjobs upload data.npz` adds one.";
  } catch (error) {
    note.textContent = `Uploaded datasets could not be listed: ${error.message || error}`;
  }
  showRepeat(form);
}

// The spec's `dataset` and `validation` from the form (undefined: the field is left out).
export function readData(form, numberValue) {
  const kind = form.querySelector("[data-field='dataset.kind']").value;
  const dataset = kind.startsWith("uploaded:") ? { kind: "uploaded", id: kind.slice("uploaded:".length) } : undefined;
  if (!form.querySelector("[data-field='validation.enabled']").checked) return { dataset, validation: undefined };
  const metrics = [...form.querySelectorAll("[data-metric]")].filter((c) => c.checked).map((c) => c.value);
  return { dataset, validation: { split: numberValue(form, "validation.split"), metrics } };
}

export function showRepeat(form) {
  const note = form.querySelector("[data-testid=synthetic-repeat-hint]");
  const synthetic = form.querySelector("[data-field='dataset.kind']").value === "synthetic";
  const batch = Number(form.querySelector("[data-field='training.batch_size']").value);
  const { validation } = readData(form, (f, path) => {
    const text = f.querySelector(`[data-field="${path}"]`).value.trim();
    return text === "" ? null : Number(text);
  });
  const text = synthetic ? repeatText(SYNTHETIC_SAMPLES, batch, validation) : null;
  note.hidden = !text;
  note.textContent = text ?? "";
}

function showValidation(form) {
  const on = form.querySelector("[data-field='validation.enabled']").checked;
  form.querySelector("[data-testid=validation-fields]").hidden = !on;
}

// The dataset select and the held-out evaluation fields; `field(path, label, control, hint)` is the form's.
export function dataFields(field, number) {
  const metrics = h("fieldset", { class: "metrics", "data-field": "validation.metrics", id: "f-validation-metrics",
    tabindex: "-1" },
  h("legend", {}, "Metrics"),
  METRICS.map((m) => h("label", { class: "check" },
    h("input", { type: "checkbox", value: m, "data-metric": m }), ` ${m}`)));
  return [
    field("dataset.kind", "Dataset", h("select", {}, h("option", { value: "synthetic" },
      `synthetic (${fmtRate(SYNTHETIC_SAMPLES)} rows)`))),
    h("p", { class: "hint", "data-testid": "datasets-note" }),
    h("p", { class: "hint repeat-note", "data-testid": "synthetic-repeat-hint", hidden: true }),
    h("label", { class: "check" }, h("input", { type: "checkbox", "data-field": "validation.enabled",
      "data-testid": "validation-enabled" }), " Held-out evaluation"),
    h("div", { class: "validation-fields", "data-testid": "validation-fields", hidden: true },
      field("validation.split", "Validation split", number(0.2, { min: 0, max: 1, step: "any" }),
        "share of the rows held out, never trained on"),
      metrics,
      h("p", { class: "field-error", id: "f-validation-metrics-error", "data-testid": "error-validation.metrics",
        role: "alert", hidden: true })),
  ];
}

// Wires the fields once the form holds them.
export function wireDataFields(form) {
  const repeat = () => showRepeat(form);
  for (const path of ["dataset.kind", "training.batch_size", "validation.split"]) {
    form.querySelector(`[data-field='${path}']`).addEventListener("input", repeat);
    form.querySelector(`[data-field='${path}']`).addEventListener("change", repeat);
  }
  form.querySelector("[data-field='validation.enabled']").addEventListener("change", () => {
    showValidation(form);
    repeat();
  });
  showValidation(form);
  loadDatasets(form);
}
