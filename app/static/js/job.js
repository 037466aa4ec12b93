// #/jobs/<id>: live charts, layer checks and FP8 scaling over the metrics stream, summary, diagnoses, transitions,
// cancel.

import { api, followMetrics } from "./api.js";
import { JobCharts, OverlayChart } from "./charts.js";
import { SYNTHETIC_SAMPLES, repeatText } from "./data_fields.js";
import { Fp8Panel, fp8SummaryText } from "./fp8.js";
import { LayersPanel, layersHref } from "./layers.js";
import {
  TERMINAL, errorBanner, fmtNumber, fmtPercent, fmtRate, fmtRatioRange, fmtSpeed, fmtTime, h, lossScaleText, poll,
  progressBar, stateBadge,
} from "./dom.js";

const POLL_MS = 2000;
const RAW_HISTORY_MAX = 5000; // longer runs load their history as buckets, not step by step
const HISTORY_POINTS = 1000;
const PAGE = 1000;

function summaryList(summary) {
  if (!summary) return h("p", { class: "muted" }, "No steps yet.");
  const rows = [
    ["Steps done", summary.steps_done],
    ["Final loss (mean of last steps)", fmtNumber(summary.final_loss)],
    ["Skipped steps", summary.skipped_steps],
    ["Loss scale min / max / final",
      [summary.loss_scale_min, summary.loss_scale_max, summary.loss_scale_final].map((v) => fmtNumber(v, 6)).join(" / ")],
    ["Peak zero-gradient fraction", fmtPercent(summary.peak_zero_grad_fraction)],
    ...(summary.float32_checks ? [
      ["Peak excess zeros vs float32", `${fmtPercent(summary.peak_excess_zero_fraction)} (${summary.float32_checks} checked steps)`],
      ["Peak gradient error vs float32", fmtNumber(summary.peak_grad_rel_error, 2)],
    ] : []),
    ...(summary.float32_check_error ? [["Float32 check", summary.float32_check_error]] : []),
    ...(summary.fp8 ? [["FP8 layers", fp8SummaryText(summary.fp8)]] : []),
    ["Throughput (examples/s)", fmtRate(summary.mean_examples_per_sec)
      + (summary.steps_per_call ? `, up to ${summary.steps_per_call} steps per call` : "")],
    ...(summary.validation ? [["Held-out evaluation (final)", evaluationText(summary.validation)]] : []),
    ...(summary.data ? [["Data", `${summary.data.rows} rows trained on (${summary.data.held_out_rows} held out), `
      + `${fmtNumber(summary.data.epochs)} epochs, ${summary.data.dropped_per_epoch} rows of each dropped`]] : []),
  ];
  const ps = summary.precision_speed;
  if (ps) rows.push(["Step time against float32 (this CPU)", precisionSpeedText(ps)]);
  return h("dl", { class: "summary", "data-testid": "summary" },
    rows.map(([k, v]) => [h("dt", {}, k), h("dd", {}, String(v))]));
}

// Mirrors mpjobs/cli/words.py _eval_words.
function evaluationText(e) {
  const metrics = Object.entries(e.metrics).map(([name, value]) => `, ${name} ${fmtNumber(value)}`).join("");
  return `loss ${fmtNumber(e.loss)}${metrics} on ${e.examples} held-out rows at step ${e.step}`;
}

// The held-out evaluations as one chart: the loss and each metric against the step.
function evaluationRuns(evaluations) {
  const names = ["loss", ...Object.keys(evaluations[0]?.metrics ?? {})];
  return names.map((name) => ({ label: name, points: evaluations.map((e) =>
    [e.step, name === "loss" ? e.loss : e.metrics[name]]).filter(([, v]) => v !== null && v !== undefined) }));
}

// Mirrors mpjobs/cli/words.py precision_speed_words.
export function precisionSpeedText(ps) {
  const low = ps.low ?? ps.slowdown;
  const high = ps.high ?? ps.slowdown;
  const rounds = ps.rounds ? `, 95% interval of ${ps.rounds} rounds` : "";
  const noise = ps.noise_low != null && ps.noise_high != null
    ? `; float32 against itself ${fmtRatioRange(ps.noise_low, ps.noise_high)}` : "";
  return `${fmtSpeed(ps.slowdown, low, high, ps.difference ?? "none")} ` +
    `(${fmtNumber(ps.policy_ms, 3)} ms against ${fmtNumber(ps.float32_ms, 3)} ms per step${rounds}${noise})`;
}

// A diagnosis that names a layer links to that layer's row in the Layers panel.
function diagnosesList(summary, jobId, layers) {
  const diagnoses = summary?.diagnoses ?? [];
  if (!diagnoses.length) return h("p", { class: "muted", "data-testid": "diagnoses" }, "Nothing to report.");
  const layerLink = (name) => h("p", { class: "diag-layer" }, "Layer ", h("a", {
    href: layersHref(jobId, name), class: "mono", "data-testid": "diagnosis-layer", "data-layer": name,
    onclick: (event) => { event.preventDefault(); layers.focusLayer(name); },
  }, name));
  return h("ul", { class: "diagnoses", "data-testid": "diagnoses" }, diagnoses.map((d) =>
    h("li", { "data-code": d.code },
      h("strong", {}, d.code.replaceAll("_", " ")),
      d.first_step ? h("span", { class: "muted" }, ` from step ${d.first_step}`) : null,
      h("p", {}, d.message),
      d.layer ? layerLink(d.layer) : null)));
}

function transitionsTable(transitions) {
  return h("table", { class: "transitions", "data-testid": "transitions" },
    h("thead", {}, h("tr", {}, ["State", "At", "Message"].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, transitions.map((t) =>
      h("tr", {}, h("td", {}, stateBadge(t.state)), h("td", {}, fmtTime(t.at)), h("td", {}, t.message)))));
}

// "dense_1 in float32 · ": the layers the spec runs in another policy (docs/numerics.md, "Per-layer policies").
function pinsText(pins) {
  const entries = Object.entries(pins ?? {});
  if (!entries.length) return null;
  return h("span", { "data-testid": "layer-policies" },
    entries.map(([name, policy]) => `${name} in ${policy}`).join(", "), " · ");
}

function specLine(job) {
  const { spec } = job;
  const t = spec.training;
  return h("p", { class: "meta" },
    h("span", { class: "mono" }, spec.model.name ?? "keras_json"), " · ",
    h("span", { class: "mono", "data-testid": "policy" }, spec.precision_policy), " · ",
    pinsText(spec.layer_policies),
    "loss scale ", h("span", { class: "mono" }, lossScaleText(spec.loss_scale)), " · ",
    `${t.steps} steps of ${t.batch_size}, ${t.optimizer} at ${t.learning_rate}`,
    job.worker ? ` · ${job.worker.device.kind ?? ""} worker ${job.worker.host}:${job.worker.pid}` +
      (job.worker.gpus?.length ? ` (GPU ${job.worker.gpus.join(",")})` : "") : "");
}

// `layersTarget`: from #/jobs/<id>/layers/<layer>, the layer to scroll to ("" for the Layers panel).
export function jobView(root, jobId, layersTarget) {
  const path = `/jobs/${encodeURIComponent(jobId)}`;
  const controller = new AbortController();
  const header = h("div", { class: "job-header" });
  const details = h("div", { class: "job-details" });
  const chartsBox = h("div", { class: "charts", "data-testid": "charts" });
  const stream = h("span", { class: "muted", "data-testid": "stream-status" }, "loading history…");
  const repeatNote = h("p", { class: "legend-note repeat-note", "data-testid": "synthetic-repeat", hidden: true });
  const page = h("article", { class: "panel job-page", "data-testid": "job-page", "data-job-id": jobId },
    header, h("p", { class: "legend-note" }, "Red vertical lines mark skipped steps. ", stream), repeatNote, chartsBox);
  const layers = new LayersPanel(jobId, layersTarget);
  const fp8 = new Fp8Panel(); // shown once a record has FP8 rows
  page.append(layers.element, fp8.element, details);
  root.append(h("p", {}, h("a", { href: "#/jobs" }, "← Jobs")), page);
  const charts = new JobCharts(chartsBox);
  let job = null;
  const evaluations = new Map(); // step -> EvalRecord, from the pages and the stream alike
  let evalChart = null;
  const addEvaluations = (records) => {
    records.forEach((e) => evaluations.set(e.step, e));
    if (!evaluations.size) return;
    evalChart ??= new OverlayChart(chartsBox, "chart-validation", "Held-out evaluation (loss and metrics)");
    evalChart.update(evaluationRuns([...evaluations.values()].sort((a, b) => a.step - b.step)));
  };
  const loadEvaluations = async () => {
    for (let after = 0; after !== null;) {
      const page = await api.get(`${path}/evaluations?after=${after}&limit=${PAGE}`);
      addEvaluations(page.evaluations);
      after = page.next_after;
    }
  };

  const cancelButton = h("button", { type: "button", class: "danger", "data-testid": "cancel-job", disabled: true },
    "Cancel");
  cancelButton.addEventListener("click", async () => {
    cancelButton.disabled = true;
    try {
      render(await api.del(path));
    } catch (error) {
      actionProblem.replaceChildren(errorBanner(error));
      cancelButton.disabled = false;
    }
  });
  const title = h("h1");
  const facts = h("div");
  const actionProblem = h("div");
  header.append(h("div", { class: "title-row" }, title, cancelButton), actionProblem, facts);

  let shown = "";
  const render = (next) => {
    const signature = JSON.stringify(next);
    if (signature === shown) return; // keeps text selections alive between polls
    shown = signature;
    job = next;
    page.dataset.state = job.state;
    cancelButton.disabled = TERMINAL.has(job.state);
    title.replaceChildren(job.name || job.id, " ", stateBadge(job.state));
    facts.replaceChildren(specLine(job), progressBar(job.progress));
    const data = job.spec.dataset ?? { kind: "synthetic", samples: SYNTHETIC_SAMPLES };
    const repeat = data.kind === "synthetic"
      ? repeatText(data.samples ?? SYNTHETIC_SAMPLES, job.spec.training.batch_size, job.spec.validation) : null;
    repeatNote.hidden = !repeat;
    repeatNote.textContent = repeat ?? "";
    layers.setJob(job);
    details.replaceChildren(h("div", {},
      job.error ? h("div", { class: "banner error", role: "alert", "data-testid": "job-error" },
        h("strong", {}, job.error.reason.replaceAll("_", " ")), ": ", job.error.message) : null,
      job.waiting_reason ? h("p", { class: "banner", "data-testid": "waiting" }, job.waiting_reason) : null,
      h("div", { class: "columns" },
        h("section", {}, h("h2", {}, "Summary"), summaryList(job.summary)),
        h("section", {}, h("h2", {}, "Diagnoses"), diagnosesList(job.summary, jobId, layers))),
      h("section", {}, h("h2", {}, "Transitions"), transitionsTable(job.transitions))));
  };

  const refresh = async () => render(await api.get(path));

  const push = (record) => {
    charts.push(record);
    fp8.push(record);
  };

  // Raw steps for short runs; min/mean/max buckets for long ones (and, for an FP8 job, its last page of raw
  // steps: buckets carry no FP8 rows). Returns the last step loaded.
  const loadHistory = async (doneSteps) => {
    if (doneSteps > RAW_HISTORY_MAX) {
      const view = await api.get(`${path}/metrics?max_points=${HISTORY_POINTS}`);
      view.buckets.forEach((b) => charts.pushBucket(b));
      if (job.spec.fp8) {
        const last = await api.get(`${path}/metrics?after=${Math.max(0, view.total_steps - PAGE)}&limit=${PAGE}`);
        last.points.filter((p) => p.step <= view.total_steps).forEach((p) => fp8.push(p));
      }
      return view.total_steps;
    }
    let after = 0;
    for (;;) {
      const metrics = await api.get(`${path}/metrics?after=${after}&limit=${PAGE}`);
      metrics.points.forEach(push);
      if (metrics.next_after === null || controller.signal.aborted) return charts.lastStep;
      after = metrics.next_after;
    }
  };

  let stopPolling = () => {};
  (async () => {
    try {
      await refresh();
      if (controller.signal.aborted) return; // the view was left while the job loaded
      stopPolling = poll(refresh, POLL_MS);
      const after = await loadHistory(job.progress.step);
      await layers.load(controller.signal);
      if (job.spec.validation) await loadEvaluations();
      let connections = 0;
      const ended = await followMetrics(jobId, {
        after,
        signal: controller.signal,
        onStatus: (s) => {
          stream.textContent = s === "live" ? "Live." : "Reconnecting…";
          // A check written while the stream was down, or on its way as it opened, comes from the pages.
          if (s === "live" && connections++) layers.load(controller.signal);
        },
        onEvent: (event) => {
          if (event.event === "metrics") push(JSON.parse(event.data));
          else if (event.event === "layers") layers.add(JSON.parse(event.data), "stream");
          else if (event.event === "evaluation") addEvaluations([JSON.parse(event.data)]);
          else if (event.event === "state" || event.event === "end") refresh().catch(() => {});
        },
      });
      if (ended === "end") {
        charts.flush();
        fp8.flush();
        await layers.load(controller.signal);
        stream.textContent = "Run ended.";
        stopPolling();
        await refresh();
      }
    } catch (error) {
      if (!controller.signal.aborted) page.prepend(errorBanner(error));
    }
  })();

  return () => {
    controller.abort();
    stopPolling();
    charts.destroy();
    evalChart?.destroy();
    layers.destroy();
    fp8.destroy();
  };
}
