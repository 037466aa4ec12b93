// The job page's Layers panel: a job's layer checks as a heatmap, the latest one as a table, named layers flagged.

import { api } from "./api.js";
import { TERMINAL, errorBanner, fmtNumber, fmtPercent, h } from "./dom.js";
import { METRICS, heatLegend, heatmap, sampleColumns } from "./heatmap.js";
import { PlanBox } from "./plan.js";

const REDRAW_MS = 100; // checks that arrive together are drawn once
const UNDERFLOW = "underflow begins here";
const OVERFLOW = "near overflow";
const DIAGNOSIS_FLAGS = { layer_underflow: UNDERFLOW, activation_overflow_risk: OVERFLOW };
const COLUMNS = ["Layer", "Kind", "Gradient values", "Zero %", "Excess zeros", "Grad norm", "Largest |g|",
  "Smallest non-zero |g|", "Gradient error vs float32", "Excess zeros reaching its output", "Activation dtype", "Activation max",
  "Headroom (doublings)", "Subnormal %"];

// The job page scrolled to one layer's row: the link a diagnosis or a comparison gives.
export function layersHref(jobId, layer) {
  return `#/jobs/${encodeURIComponent(jobId)}/layers/${encodeURIComponent(layer)}`;
}

export function layerRowId(layer) {
  return `layer-${layer.replace(/\s/g, "_")}`;
}

const power = (log2) => (log2 === null || log2 === undefined ? "–" : `2^${fmtNumber(log2, 3)}`);
const count = (n) => n.toLocaleString("en-US");

function headroomText(l) {
  if (l.activation_finite === false) return "overflowed";
  const v = l.activation_headroom_log2;
  if (v === null || v === undefined) return "–";
  return v <= 0 ? `${fmtNumber(v, 3)} (overflowed)` : fmtNumber(v, 3);
}

function gradientCells(l) {
  if (!l.values) return [h("td", { class: "muted", colspan: 7 }, "nothing to train")];
  const finite = l.grads_finite !== false;
  return [
    h("td", { class: "num" }, count(l.values)),
    h("td", { class: "num" }, fmtPercent(l.zero_fraction)),
    h("td", { class: "num", "data-testid": "layer-excess" }, fmtPercent(l.excess_zero_fraction)),
    h("td", { class: "num" }, finite ? fmtNumber(l.grad_norm) : "non-finite"),
    h("td", { class: "num" }, finite ? power(l.grad_max_log2) : "non-finite"),
    h("td", { class: "num" }, power(l.grad_min_log2)),
    h("td", { class: "num" }, fmtNumber(l.grad_rel_error, 2)),
  ];
}

// The gradient backpropagation brings to the layer's output: where its zeros start, underflow begins.
function signalCell(l) {
  return h("td", { class: "num" }, l.signal_values ? fmtPercent(l.signal_excess_zero_fraction) : "–");
}

// What each named layer is flagged for: the latest check's own findings, the summary's and its diagnoses'.
function flagsOf(latest, summary) {
  const flags = new Map();
  const flag = (layer, label) => {
    if (!layer) return;
    if (!flags.has(layer)) flags.set(layer, new Set());
    flags.get(layer).add(label);
  };
  flag(latest?.underflow_layer, UNDERFLOW);
  flag(latest?.overflow_layer, OVERFLOW);
  flag(summary?.underflow_layer, UNDERFLOW);
  flag(summary?.overflow_layer, OVERFLOW);
  for (const d of summary?.diagnoses ?? []) {
    flag(d.layer, DIAGNOSIS_FLAGS[d.code] ?? `diagnosis: ${d.code.replaceAll("_", " ")}`);
  }
  return flags;
}

// The first check that named an underflow layer tried its step again at doubling loss scales: what that found.
function recoveryText(checks) {
  const c = checks.find((check) => check.recovery);
  if (!c) return null;
  const at = `At step ${c.step}, tried again at doubling loss scales, ${c.underflow_layer}'s gradients`;
  const scale = fmtNumber(c.recovery_scale);
  if (c.recovery === "recovered") {
    return `${at} came back at a loss scale of ${scale} (excess zeros ${fmtPercent(c.recovery_excess_zero_fraction)}, `
      + `gradient error vs float32 ${fmtNumber(c.recovery_grad_rel_error, 2)}).`;
  }
  if (c.recovery === "overflows_first") return `${at} did not come back before the step overflowed, at ${scale}.`;
  return `${at} stayed lost up to ${scale}, the largest scale at which they fit ${c.compute_dtype}.`;
}

// Each compute dtype's smallest positive value (a subnormal), as worker/numerics/layer_numerics.py has it.
const SMALLEST = { float16: -24, bfloat16: -133, float32: -149 };

export function smallestText(dtype) {
  return dtype in SMALLEST ? `${dtype}'s smallest subnormal is 2^${SMALLEST[dtype]}` : `computed in ${dtype}`;
}

export class LayersPanel {
  // `target`: a layer to scroll to once drawn, "" for the panel itself (#/jobs/<id>/layers/<layer>).
  constructor(jobId, target) {
    this.path = `/jobs/${encodeURIComponent(jobId)}/layers`;
    this.checks = new Map(); // step -> LayerCheck
    this.pagedThrough = 0; // every check up to this step has come from GET /jobs/<id>/layers
    this.loaded = false;
    this.streamed = 0; // checks that arrived on the live stream first
    this.metric = "excess";
    this.job = null;
    this.shownJob = "";
    this.target = target ?? null;
    this.targeted = null; // the layer whose row a link last led to
    this.rows = new Map();
    this.timer = null;
    this.queue = Promise.resolve();
    this.problem = h("div");
    this.body = h("div", {}, h("p", { class: "muted" }, "Loading layer checks…"));
    this.buttons = Object.entries(METRICS).map(([key, m]) => h("button", {
      type: "button", class: "secondary", "data-testid": `layers-metric-${key}`, "aria-pressed": String(key === this.metric),
      onclick: () => this.setMetric(key),
    }, m.label));
    this.controls = h("div", { class: "layer-controls", role: "group", "aria-label": "Heatmap of", hidden: true },
      this.buttons);
    this.plan = new PlanBox(jobId);
    this.element = h("section", { class: "layers", id: "layers", "data-testid": "layers-panel", "data-checks": 0 },
      h("div", { class: "title-row" }, h("h2", {}, "Layers"), this.controls), this.problem, this.body,
      this.plan.element);
  }

  // The job as last polled: its spec says why there may be no checks, its summary names layers.
  setJob(job) {
    this.job = job;
    const signature = JSON.stringify([job.state, job.spec, job.summary?.underflow_layer, job.summary?.overflow_layer,
      (job.summary?.diagnoses ?? []).map((d) => [d.code, d.layer])]);
    if (signature === this.shownJob) return;
    this.shownJob = signature;
    this.schedule();
  }

  // A check is written once per step: one already held (from the other source) changes nothing.
  add(check, source) {
    if (this.checks.has(check.step)) return;
    if (source === "stream") this.streamed += 1;
    this.checks.set(check.step, check);
    this.schedule();
  }

  // Fetches every check after the last one paged in, following next_after; one fetch at a time.
  load(signal) {
    const run = this.queue.then(async () => {
      let after = this.pagedThrough;
      for (;;) {
        const page = await api.get(`${this.path}?after=${after}`);
        for (const check of page.checks) {
          this.add(check, "page");
          this.pagedThrough = Math.max(this.pagedThrough, check.step);
        }
        if (page.next_after === null || signal?.aborted) break;
        after = page.next_after;
      }
      if (!this.loaded || this.problem.childElementCount) this.schedule();
      this.loaded = true;
      this.problem.replaceChildren();
    }).catch((error) => {
      if (!signal?.aborted) this.problem.replaceChildren(errorBanner(error));
    });
    this.queue = run;
    return run;
  }

  setMetric(key) {
    this.metric = key;
    this.buttons.forEach((b, i) => b.setAttribute("aria-pressed", String(Object.keys(METRICS)[i] === key)));
    this.render();
  }

  // Scrolls to a layer's row and marks it (a diagnosis's link), once the row is drawn.
  focusLayer(name) {
    this.target = name;
    this.applyTarget();
  }

  schedule() {
    if (this.timer === null) this.timer = setTimeout(() => this.render(), REDRAW_MS);
  }

  destroy() {
    clearTimeout(this.timer);
  }

  emptyText() {
    const spec = this.job?.spec;
    const training = spec?.training ?? {};
    if (!this.loaded) return "Loading layer checks…";
    if (training.layer_check_every === 0) return "Layer checks are off for this job (training.layer_check_every is 0).";
    if (training.layer_check_every == null && spec?.precision_policy === "float32") {
      return "Layer checks run on the float32 check's steps under float16/bfloat16; this job has none.";
    }
    if (training.layer_check_every == null && training.underflow_check_every === 0) {
      return "Layer checks run on the float32 check's steps, and that check is off for this job "
        + "(training.underflow_check_every is 0).";
    }
    if (this.job && TERMINAL.has(this.job.state)) return "This job recorded no layer checks.";
    return "No layer checks yet: the first is at step 1.";
  }

  render() {
    clearTimeout(this.timer);
    this.timer = null;
    this.element.dataset.checks = String(this.checks.size);
    this.element.dataset.streamed = String(this.streamed);
    this.element.dataset.loaded = String(this.loaded);
    this.element.dataset.jobState = this.job?.state ?? ""; // the job as this drawing knows it
    this.rows = new Map();
    this.controls.hidden = !this.checks.size;
    if (!this.checks.size) {
      this.body.replaceChildren(h("p", { class: "muted", "data-testid": "layers-empty" }, this.emptyText()));
      this.applyTarget();
      return;
    }
    const checks = [...this.checks.values()].sort((a, b) => a.step - b.step);
    const latest = checks.at(-1);
    this.plan.show(checks.find((c) => c.plan));
    const shown = sampleColumns(checks).length;
    const kinds = new Map(checks.flatMap((c) => c.layers.map((l) => [l.name, l.kind])));
    const recovery = recoveryText(checks);
    const focused = this.body.contains(document.activeElement) ? document.activeElement.dataset.layer : undefined;
    // replaceChildren, unlike h(), writes a null child as the text "null": drop the absent ones.
    this.body.replaceChildren(...[
      h("p", { class: "muted" }, `${checks.length} checks, steps ${checks[0].step}–${latest.step}`,
        shown < checks.length ? ` (${shown} evenly spaced shown)` : "", `. ${METRICS[this.metric].about}`),
      heatmap(checks, this.metric, kinds),
      heatLegend(this.metric),
      recovery ? h("p", { "data-testid": "layers-recovery" }, recovery) : null,
      h("h3", {}, `Latest check: step ${latest.step}`),
      h("p", { class: "meta", "data-testid": "layers-caption" },
        `Computed in ${latest.compute_dtype}, loss scale ${fmtNumber(latest.loss_scale)}; magnitudes as powers of `
        + `two (${smallestText(latest.compute_dtype)}).`),
      this.table(latest)].filter((child) => child !== null));
    this.rows.get(focused)?.focus({ preventScroll: true }); // a live redraw keeps the row a link led to
    this.applyTarget();
  }

  table(check) {
    const flags = flagsOf(check, this.job?.summary);
    const rows = check.layers.map((l) => {
      const labels = [...(flags.get(l.name) ?? [])];
      const row = h("tr", {
        id: layerRowId(l.name), "data-testid": "layer-row", "data-layer": l.name, tabindex: -1,
        class: [labels.length ? "flagged" : "", l.name === this.targeted ? "targeted" : ""].join(" ").trim() || null,
        "data-flags": labels.join("; ") || null,
      },
      h("th", { scope: "row" }, h("span", { class: "mono" }, l.name),
        labels.map((label) => h("span", { class: `flag${label === OVERFLOW ? " flag-overflow" : ""}` }, label))),
      h("td", {}, l.kind),
      gradientCells(l),
      signalCell(l),
      h("td", { class: "mono" }, l.activation_dtype ?? "–"),
      h("td", { class: "num" }, l.activation_finite === false ? "non-finite" : fmtNumber(l.activation_max)),
      h("td", { class: "num", "data-testid": "layer-headroom" }, headroomText(l)),
      h("td", { class: "num" }, fmtPercent(l.activation_subnormal_fraction)));
      this.rows.set(l.name, row);
      return row;
    });
    return h("div", { class: "table-wrap" }, h("table", { class: "layer-table", "data-testid": "layer-table",
      "data-step": check.step },
    h("thead", {}, h("tr", {}, COLUMNS.map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, rows)));
  }

  applyTarget() {
    if (this.target === null || !this.loaded) return;
    const row = this.rows.get(this.target);
    if (!row && this.target !== "" && !this.checks.size && !TERMINAL.has(this.job?.state)) return; // checks to come
    this.target = null;
    if (!row) {
      this.element.scrollIntoView({ block: "start" });
      return;
    }
    this.rows.forEach((r) => r.classList.remove("targeted"));
    this.targeted = row.dataset.layer;
    row.classList.add("targeted");
    row.scrollIntoView({ block: "center" });
    row.focus({ preventScroll: true });
  }
}
