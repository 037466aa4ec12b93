// #/comparisons and #/comparisons/<id>: one spec under several precisions, side by side.

import { api } from "./api.js";
import { OverlayChart } from "./charts.js";
import { precisionSpeedText } from "./job.js";
import { layersHref } from "./layers.js";
import {
  TERMINAL, errorBanner, fmtNumber, fmtPercent, fmtRate, fmtRatio, fmtRatioRange, fmtTime, h, poll, progressBar, stateBadge,
} from "./dom.js";

const POLL_MS = 2000;
const CURVE_POINTS = 1000;

export function comparisonsView(root) {
  const body = h("tbody", { "data-testid": "comparison-rows" });
  const problem = h("div");
  root.append(h("section", { class: "panel" },
    h("h1", {}, "Comparisons"),
    h("p", { class: "muted" }, "Start one with “Compare precisions” on the ", h("a", { href: "#/jobs" }, "job form"), "."),
    problem,
    h("div", { class: "table-wrap" }, h("table", { "data-testid": "comparison-list" },
      h("thead", {}, h("tr", {}, ["Comparison", "State", "Variants", "Verdict", "Created"]
        .map((t) => h("th", { scope: "col" }, t)))),
      body))));
  return poll(async () => {
    try {
      const page = await api.get("/comparisons");
      problem.replaceChildren();
      body.replaceChildren(...page.comparisons.map((c) =>
        h("tr", { "data-testid": "comparison-row", "data-comparison-id": c.id, "data-state": c.state },
          h("td", {}, h("a", { href: `#/comparisons/${encodeURIComponent(c.id)}` }, c.name || c.id)),
          h("td", {}, stateBadge(c.state)),
          h("td", {}, c.variants.map((v) => v.label).join(", ")),
          h("td", {}, c.verdict),
          h("td", { class: "muted" }, fmtTime(c.created_at)))));
      if (!page.comparisons.length) body.append(h("tr", {}, h("td", { colspan: 5, class: "muted" }, "None yet.")));
    } catch (error) {
      problem.replaceChildren(errorBanner(error));
    }
  }, POLL_MS);
}

// Mirrors mpjobs/cli/words.py speed_cell: the baseline job's measurement, median (95% interval).
function speedCell(v) {
  if (v.baseline) return "1 (baseline)";
  const ps = v.speed;
  if (!ps) return v.speed_error ? "not timed" : "–";
  const low = ps.low ?? ps.slowdown;
  const high = ps.high ?? ps.slowdown;
  return `${fmtRatio(ps.slowdown)} (${fmtRatioRange(low, high, "")})`;
}

function speedTitle(v) {
  if (v.speed) return precisionSpeedText(v.speed);
  return v.speed_error ?? "";
}

// The first layer that loses gradients (its summary's underflow_layer), linked to its row on the job page.
function underflowLayerCell(v) {
  const attrs = { class: "layer-cell", "data-testid": "underflow-layer", "data-layer": v.underflow_layer ?? "" };
  if (!v.underflow_layer) {
    const done = TERMINAL.has(v.state) && !v.error;
    return h("td", { ...attrs, class: "layer-cell muted", title: done ? "No layer check found underflow." : null },
      done ? "none" : "–");
  }
  return h("td", attrs, h("a", { href: layersHref(v.job_id, v.underflow_layer), class: "mono" }, v.underflow_layer),
    v.underflow_step ? ` at step ${v.underflow_step}` : "");
}

function signed(value) {
  return value > 0 ? `+${fmtNumber(value)}` : fmtNumber(value);
}

// The report's held-out verdict when it carries one; else the variant job's final evaluation; else "–".
export function heldOutCell(v, job) {
  const attrs = { class: "held-out", "data-testid": "held-out" };
  const ho = v.held_out;
  if (ho && typeof ho === "object" && ["metric", "value", "low", "high"].every((k) => k in ho)) {
    const difference = ho.difference === undefined || ho.difference === null ? "" : `${signed(ho.difference)}, `;
    return h("td", { ...attrs, "data-source": "report",
      title: ho.float32_value == null ? null : `float32: ${fmtNumber(ho.float32_value)}` },
    `${ho.metric} ${fmtNumber(ho.value)} (${difference}${fmtNumber(ho.low)} to ${fmtNumber(ho.high)})`);
  }
  const e = job?.summary?.validation;
  if (!e) return h("td", { ...attrs, class: "held-out muted", "data-source": "none" }, "–");
  const metrics = Object.entries(e.metrics ?? {}).map(([name, value]) => `${name} ${fmtNumber(value)}`);
  return h("td", { ...attrs, "data-source": "job", title: `on ${e.examples} held-out rows at step ${e.step}` },
    [`loss ${fmtNumber(e.loss)}`, ...metrics].join(", "));
}

function variantRow(v, job) {
  const diagnoses = v.diagnoses ?? [];
  return h("tr", { "data-testid": "variant-row", "data-job-id": v.job_id, "data-state": v.state },
    h("th", { scope: "row" }, h("a", { href: `#/jobs/${encodeURIComponent(v.job_id)}` }, v.label),
      v.baseline ? h("span", { class: "tag" }, "baseline") : null),
    h("td", {}, stateBadge(v.state), h("div", {}, progressBar(v.progress)),
      v.device ? h("div", { class: "muted small" }, v.device) : null),
    h("td", { class: "num" }, fmtNumber(v.final_loss)),
    h("td", { class: "num" }, fmtPercent(v.loss_gap, true)),
    h("td", { class: "num" }, fmtRate(v.examples_per_sec)),
    h("td", { class: "num", "data-testid": "speed", title: speedTitle(v) }, speedCell(v)),
    h("td", { class: "num" }, v.skipped_steps ?? "–"),
    h("td", { class: "num" }, fmtPercent(v.peak_zero_grad_fraction)),
    h("td", { class: "num" }, fmtPercent(v.peak_excess_zero_fraction)),
    underflowLayerCell(v),
    heldOutCell(v, job),
    h("td", { class: "diag-cell" },
      v.error ? h("p", { class: "error" }, `${v.error.reason}: ${v.error.message}`) : null,
      diagnoses.length
        ? h("ul", { class: "diagnoses compact" }, diagnoses.map((d) => h("li", { "data-code": d.code }, d.message)))
        : (v.error ? null : h("span", { class: "muted" }, "none"))));
}

// Each variant's loss minus the baseline's at the steps both have (the baseline itself is 0).
function gapRuns(variants, runs) {
  const base = runs[variants.findIndex((v) => v.baseline)] ?? runs[0];
  const at = new Map(base?.points ?? []);
  return runs.map((run) => ({ label: run.label, points: run.points.filter(([x]) => at.has(x))
    .map(([x, y]) => [x, y - at.get(x)]) }));
}

export function comparisonView(root, comparisonId) {
  const path = `/comparisons/${encodeURIComponent(comparisonId)}`;
  const title = h("h1");
  const verdict = h("p", { class: "verdict", "data-testid": "verdict", role: "status" });
  const specLine = h("p", { class: "meta" });
  const problem = h("div");
  const body = h("tbody", { "data-testid": "variant-rows" });
  const cancelButton = h("button", { type: "button", class: "danger", "data-testid": "cancel-comparison",
    disabled: true }, "Cancel all");
  const chartBox = h("div");
  const page = h("article", { class: "panel", "data-testid": "comparison-page", "data-comparison-id": comparisonId },
    h("div", { class: "title-row" }, title, cancelButton), specLine, verdict, problem,
    h("div", { class: "table-wrap" }, h("table", { class: "variants", "data-testid": "variants" },
      h("thead", {}, h("tr", {}, ["Variant", "State", "Final loss", "Gap vs float32", "Throughput (ex/s)",
        "Step time vs float32",
        "Skipped steps", "Peak zero-grad", "Excess zeros vs float32", "First layer to lose gradients",
        "Held-out", "Diagnoses"].map((t) => h("th", { scope: "col" }, t)))),
      body)),
    h("h2", {}, "Loss curves"),
    h("p", { class: "muted" }, `Mean loss per bucket of steps (up to ${CURVE_POINTS} points per variant). `
      + "Each variant has its own colour, dash and width; hover for every variant's value at a step. "
      + "Below, each variant's loss minus float32's at the same step: curves that coincide above separate there."),
    chartBox);
  root.append(h("p", {}, h("a", { href: "#/comparisons" }, "← Comparisons")), page);
  const chart = new OverlayChart(chartBox, "chart-comparison-loss", "Loss, all variants");
  const gapChart = new OverlayChart(chartBox, "chart-comparison-loss-gap", "Loss minus float32's, per step");
  const finalCurves = new Map(); // job id -> points, once that job is terminal
  const finalJobs = new Map(); // job id -> job record, once terminal (for its summary.validation)
  let stop = () => {};

  const curve = async (variant) => {
    if (finalCurves.has(variant.job_id)) return finalCurves.get(variant.job_id);
    if (!variant.progress.step) return [];
    const view = await api.get(`/jobs/${encodeURIComponent(variant.job_id)}/metrics?max_points=${CURVE_POINTS}`);
    const points = view.buckets.filter((b) => b.loss.mean !== null).map((b) => [b.last_step, b.loss.mean]);
    if (TERMINAL.has(variant.state)) finalCurves.set(variant.job_id, points);
    return points;
  };

  const jobOf = async (variant) => {
    if (finalJobs.has(variant.job_id)) return finalJobs.get(variant.job_id);
    const job = await api.get(`/jobs/${encodeURIComponent(variant.job_id)}`);
    if (TERMINAL.has(job.state)) finalJobs.set(variant.job_id, job);
    return job;
  };

  const render = async (comparison) => {
    page.dataset.state = comparison.state;
    title.replaceChildren(comparison.name || comparison.id, " ", stateBadge(comparison.state));
    cancelButton.disabled = comparison.state !== "running";
    const spec = comparison.spec.spec ?? comparison.spec; // the ComparisonSpec holds the job spec
    const t = spec.training;
    const tolerance = comparison.spec.tolerance === undefined ? ""
      : ` · a match is within ${fmtPercent(comparison.spec.tolerance)} of float32`;
    specLine.textContent = `${spec.model.name ?? "keras_json"} · ${t.steps} steps of ${t.batch_size}, `
      + `${t.optimizer} at ${t.learning_rate}${tolerance} · created ${fmtTime(comparison.created_at)}`;
    verdict.textContent = comparison.verdict;
    const needJobs = spec.validation && comparison.variants.some((v) => !v.held_out);
    const jobs = needJobs ? await Promise.all(comparison.variants.map(jobOf)) : [];
    body.replaceChildren(...comparison.variants.map((v, i) => variantRow(v, jobs[i])));
    const curves = await Promise.all(comparison.variants.map(curve));
    const runs = comparison.variants.map((v, i) => ({ label: v.label, points: curves[i] }));
    chart.update(runs);
    gapChart.update(gapRuns(comparison.variants, runs));
    if (comparison.state === "done" && comparison.variants.every((v) => finalCurves.has(v.job_id) || !v.progress.step)) {
      stop();
    }
  };

  cancelButton.addEventListener("click", async () => {
    cancelButton.disabled = true;
    try {
      await render(await api.del(path));
    } catch (error) {
      problem.replaceChildren(errorBanner(error));
    }
  });

  stop = poll(async () => {
    try {
      await render(await api.get(path));
      problem.replaceChildren();
    } catch (error) {
      problem.replaceChildren(errorBanner(error));
    }
  }, POLL_MS);

  return () => {
    stop();
    chart.destroy();
    gapChart.destroy();
  };
}
