// The job spec form: builds a JobSpec, POSTs it to /jobs or /comparisons, and shows the
// server's 422 errors next to the field each one names.
//
// The form has `novalidate`: the server is the one validator, so its bounds and messages
// are the ones shown. The min/max attributes only shape the number inputs.

import { api, ApiError } from "./api.js";
import { dataFields, readData, wireDataFields } from "./data_fields.js";
import { h } from "./dom.js";

const MODELS = ["mlp", "cnn", "conv3d_unet", "transformer"];
const POLICIES = ["float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16"];
const MODES = ["none", "fixed", "dynamic"];

// An error whose loc is just an object (e.g. ["body", "model"]) goes to that object's main field.
const OBJECT_FIELDS = { model: "model.name", loss_scale: "loss_scale.mode", dataset: "dataset.kind" };

function field(path, label, control, hint) {
  const id = `f-${path.replaceAll(".", "-")}`;
  Object.assign(control, { id, name: path });
  control.dataset.field = path;
  control.setAttribute("aria-describedby", `${id}-error`);
  return h("div", { class: "field", "data-field-wrapper": path },
    h("label", { for: id }, label),
    control,
    hint ? h("small", { class: "hint" }, hint) : null,
    h("p", { class: "field-error", id: `${id}-error`, "data-testid": `error-${path}`, role: "alert", hidden: true }));
}

function select(options, selected) {
  return h("select", {}, options.map((o) => h("option", { value: o, selected: o === selected }, o)));
}

function number(value, attrs) {
  return h("input", { type: "number", value, inputmode: "decimal", ...attrs });
}

// loc minus "body" (and "spec" or "variants" for /comparisons) -> the form field it names, or null.
// Discriminated unions put the tag in loc (["loss_scale", "dynamic", "growth_steps"]), so a
// field matches when its path is a subsequence of loc with the same first and last parts.
export function fieldFor(form, loc) {
  const parts = loc.filter((p) => typeof p === "string");
  if (parts[0] === "body") parts.shift();
  // A comparison's spec is the form; so is the scaled variant's loss scale, taken from it.
  if (["spec", "variants"].includes(parts[0]) && form.dataset.target === "comparison") parts.shift();
  if (!parts.length) return null;
  for (const control of form.querySelectorAll("[data-field]")) {
    const path = control.dataset.field.split(".");
    if (path[0] !== parts[0] || path[path.length - 1] !== parts[parts.length - 1]) continue;
    let at = 0;
    for (const part of parts) if (part === path[at]) at += 1;
    if (at === path.length) return control;
  }
  const main = parts.length <= 3 ? OBJECT_FIELDS[parts[0]] : undefined; // ["dataset", "uploaded", "id"] too
  return main ? form.querySelector(`[data-field="${main}"]`) : null;
}

function clearErrors(form) {
  for (const el of form.querySelectorAll(".field-error")) {
    el.hidden = true;
    el.textContent = "";
  }
  for (const el of form.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
  const box = form.querySelector("[data-testid=form-errors]");
  box.hidden = true;
  box.replaceChildren();
}

function showErrors(form, error) {
  const box = form.querySelector("[data-testid=form-errors]");
  const details = Array.isArray(error.body?.detail) ? error.body.detail : [{ loc: [], msg: error.message }];
  let first = null;
  for (const detail of details) {
    const message = String(detail.msg ?? "invalid");
    // A check across fields has no loc but names its field first: "validation.metrics: 'auc' cannot…".
    const named = /^(?:Value error, )?([a-z_]+(?:\.[a-z_]+)+):/.exec(message);
    const control = fieldFor(form, detail.loc || []) ?? (named ? fieldFor(form, named[1].split(".")) : null);
    if (control) {
      const slot = document.getElementById(`${control.id}-error`);
      slot.textContent = slot.textContent ? `${slot.textContent} ${message}` : message;
      slot.hidden = false;
      control.setAttribute("aria-invalid", "true");
      first = first || control;
    } else {
      const where = (detail.loc || []).filter((p) => p !== "body").join(".");
      box.append(h("li", {}, where ? `${where}: ${message}` : message));
      box.hidden = false;
    }
  }
  (first || box).focus?.();
}

// Empty number inputs are sent as null, so the server names the field instead of
// silently applying its default.
function numberValue(form, path) {
  const input = form.querySelector(`[data-field="${path}"]`);
  return input.value.trim() === "" ? null : Number(input.value);
}

function readSpec(form) {
  const value = (path) => form.querySelector(`[data-field="${path}"]`).value;
  const mode = value("loss_scale.mode");
  const lossScale = { mode };
  if (mode === "fixed") lossScale.scale = numberValue(form, "loss_scale.scale");
  if (mode === "dynamic") {
    lossScale.initial_scale = numberValue(form, "loss_scale.initial_scale");
    lossScale.growth_steps = numberValue(form, "loss_scale.growth_steps");
  }
  const spec = {
    model: { name: value("model.name") },
    precision_policy: value("precision_policy"),
    loss_scale: lossScale,
    training: {
      steps: numberValue(form, "training.steps"),
      batch_size: numberValue(form, "training.batch_size"),
      learning_rate: numberValue(form, "training.learning_rate"),
    },
  };
  const name = value("name").trim();
  if (name) spec.name = name;
  const { dataset, validation } = readData(form, numberValue);
  if (dataset) spec.dataset = dataset;
  if (validation) spec.validation = validation;
  return spec;
}

// The default four variants; the form's fixed or dynamic settings go on the scaled float16 one.
function variantsFor(spec) {
  const scaled = ["fixed", "dynamic"].includes(spec.loss_scale.mode) ? spec.loss_scale : { mode: "dynamic" };
  return [
    { precision_policy: "float32" },
    { precision_policy: "mixed_float16", loss_scale: scaled },
    { precision_policy: "mixed_float16", loss_scale: { mode: "none" } },
    { precision_policy: "mixed_bfloat16" },
  ];
}

function showModeFields(form) {
  const mode = form.querySelector("[data-field='loss_scale.mode']").value;
  for (const group of form.querySelectorAll("[data-mode]")) group.hidden = group.dataset.mode !== mode;
}

// `onCreated(kind, resource)`: kind is "job" or "comparison".
export function specForm(onCreated) {
  const status = h("p", { class: "form-status", "data-testid": "submit-status", role: "status" });
  const form = h("form", { class: "spec-form", "data-testid": "spec-form", novalidate: true },
    h("h2", {}, "New job"),
    field("name", "Name (optional)", h("input", { type: "text", maxlength: 200, autocomplete: "off" })),
    field("model.name", "Model", select(MODELS, "mlp")),
    field("precision_policy", "Precision policy", select(POLICIES, "mixed_float16")),
    field("loss_scale.mode", "Loss-scale mode", select(MODES, "dynamic")),
    h("div", { class: "mode-fields", "data-mode": "fixed" },
      field("loss_scale.scale", "Scale", number(1024, { min: 1, step: "any" }))),
    h("div", { class: "mode-fields", "data-mode": "dynamic" },
      field("loss_scale.initial_scale", "Initial scale", number(32768, { min: 1, step: "any" })),
      field("loss_scale.growth_steps", "Growth steps", number(2000, { min: 1, step: 1 }),
        "finite steps in a row before the scale doubles")),
    h("div", { class: "row" },
      field("training.steps", "Steps", number(200, { min: 1, step: 1, required: true })),
      field("training.batch_size", "Batch size", number(32, { min: 1, step: 1, required: true }))),
    field("training.learning_rate", "Learning rate", number(0.001, { min: 0, step: "any", required: true })),
    dataFields(field, number),
    h("ul", { class: "form-errors error", "data-testid": "form-errors", role: "alert", tabindex: "-1", hidden: true }),
    h("div", { class: "actions" },
      h("button", { type: "submit", "data-testid": "submit-job" }, "Submit job"),
      h("button", { type: "button", class: "secondary", "data-testid": "compare-precisions",
        title: "Run this spec under float32, mixed_float16 (dynamic and none) and mixed_bfloat16" },
      "Compare precisions")),
    status);

  const send = async (target) => {
    clearErrors(form);
    status.textContent = "";
    form.dataset.target = target;
    const spec = readSpec(form);
    const buttons = form.querySelectorAll("button");
    buttons.forEach((b) => { b.disabled = true; });
    try {
      if (target === "job") {
        const job = await api.post("/jobs", spec);
        status.replaceChildren("Queued ", h("a", { href: `#/jobs/${encodeURIComponent(job.id)}` }, job.name || job.id), ".");
        onCreated("job", job);
      } else {
        const comparison = await api.post("/comparisons", { name: spec.name ?? null, spec, variants: variantsFor(spec) });
        onCreated("comparison", comparison);
      }
    } catch (error) {
      if (error instanceof ApiError && error.status === 422) showErrors(form, error);
      else showErrors(form, { body: null, message: error.message || String(error) });
    } finally {
      buttons.forEach((b) => { b.disabled = false; });
    }
  };

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    send("job");
  });
  form.querySelector("[data-testid=compare-precisions]").addEventListener("click", () => send("comparison"));
  const mode = form.querySelector("[data-field='loss_scale.mode']");
  mode.addEventListener("change", () => { mode.dataset.touched = "1"; showModeFields(form); });
  // Until the mode is chosen by hand it follows the policy's default, as the API's would:
  // dynamic when the policy computes in float16, none otherwise.
  form.querySelector("[data-field='precision_policy']").addEventListener("change", (event) => {
    if (mode.dataset.touched) return;
    mode.value = event.target.value.endsWith("float16") && !event.target.value.endsWith("bfloat16")
      ? "dynamic" : "none";
    showModeFields(form);
  });
  showModeFields(form);
  wireDataFields(form);
  return form;
}
