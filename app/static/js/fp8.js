// The job page's FP8 scaling panel: each FP8 layer's tensors at the latest step as a table, and their range use
// over the steps as a chart. Drawn from the step records' `fp8` rows (mpjobs/contract/fp8.py), paged and live.

import { PALETTE } from "./charts.js";
import { fmtNumber, fmtPercent, h } from "./dom.js";

const REDRAW_MS = 100; // records that arrive together are drawn once
const MAX_POINTS = 20_000; // past this, keep every other step, as the step charts do
const HEIGHT = 260;
const SATURATING = "saturating";
const UNDERFLOWING = "underflowing";

// mpjobs/contract/fp8.py FORMATS: each tensor's format, its largest value and its smallest normal.
const E4M3 = { name: "float8_e4m3fn", max: 448, smallestNormal: 2 ** -6, normalText: "2^-6" };
const E5M2 = { name: "float8_e5m2", max: 57344, smallestNormal: 2 ** -14, normalText: "2^-14" };
export const FORMATS = { inputs: E4M3, kernel: E4M3, outputs_grad: E5M2 };
const DASH = { inputs: [], kernel: [10, 5], outputs_grad: [2, 4] }; // a layer's colour, a tensor's dash
const COLUMNS = ["Layer", "Tensor", "Format", "Scale", "Amax", "Range use", "Lag", "Peak age"];

const keyOf = (row) => `${row.layer}|${row.tensor}`;
const finite = (value) => (value === null || value === undefined ? "non-finite" : fmtNumber(value));

// The summary's FP8 layers in a line. Mirrors mpjobs/cli/words.py fp8_summary_words.
export function fp8SummaryText(fp8) {
  return `${fp8.layers.join(", ") || "no layer"} in FP8 (amax history of ${fp8.amax_history_length} steps); `
    + `kept their policy: ${fp8.kept.join(", ") || "none"}`;
}

// history_max / amax, as Fp8Tensor.lag defines it: none without an amax, or with an amax of 0.
export function lag(row) {
  if (row.amax === null || row.amax === undefined || row.history_max === null || row.history_max === undefined
    || row.amax <= 0) return null;
  return row.history_max / row.amax;
}

// Saturating: the step's largest |x| past what the format holds at the scale in force (range use above 1).
// Underflowing: even its largest |x| under the format's smallest normal at that scale (Fp8Tensor.underflowing).
export function marksOf(row) {
  const use = row.range_use;
  if (use === null || use === undefined) return [];
  if (use > 1) return [SATURATING];
  const format = FORMATS[row.tensor];
  return use * format.max < format.smallestNormal && (row.amax ?? 0) > 0 ? [UNDERFLOWING] : [];
}

function markTitle(mark, row) {
  const format = FORMATS[row.tensor];
  return mark === SATURATING
    ? `amax is past ${format.max} × the scale, the most ${format.name} holds at it: its largest values were clipped`
    : `even amax is under ${format.name}'s smallest normal (${format.normalText}) at this scale`;
}

// log2(range use): 0 is the format's largest value at the scale in force; null leaves a gap.
const log2Use = (row) => (row.range_use > 0 ? Math.log2(row.range_use) : null);

function keepEveryOther(values) {
  let kept = 0;
  for (let i = 0; i < values.length; i += 2) values[kept++] = values[i];
  values.length = kept;
}

// A horizontal line at log2(range use) = 0, over the plot area.
function drawFull(u) {
  const y = Math.round(u.valToPos(0, "y", true));
  const { left, top, width, height } = u.bbox;
  if (y < top || y > top + height) return;
  const ctx = u.ctx;
  ctx.save();
  ctx.strokeStyle = "rgba(185, 28, 28, 0.8)";
  ctx.lineWidth = Math.max(1, devicePixelRatio);
  ctx.setLineDash([6 * devicePixelRatio, 4 * devicePixelRatio]);
  ctx.beginPath();
  ctx.moveTo(left, y);
  ctx.lineTo(left + width, y);
  ctx.stroke();
  ctx.restore();
}

export class Fp8Panel {
  constructor() {
    this.steps = []; // the steps with FP8 rows, in order
    this.series = new Map(); // "layer|tensor" -> log2(range use) per step in `steps`
    this.rows = []; // [{layer, tensor}] in the records' order: the chart's series
    this.latest = null; // the latest record with FP8 rows
    this.checked = null; // the latest whose rows carry the exact counts
    this.timer = null;
    this.plot = null;
    this.plotKeys = "";
    this.caption = h("p", { class: "meta", "data-testid": "fp8-caption" });
    this.tableBox = h("div", { class: "table-wrap" });
    this.chartBox = h("figure", { class: "chart", "data-testid": "chart-fp8-range", "data-series": "0",
      "data-points": "0", "aria-label": "FP8 range use over steps" });
    this.observer = new ResizeObserver(() => this.plot?.setSize({ width: this.width(), height: HEIGHT }));
    this.observer.observe(this.chartBox);
    this.element = h("section", { class: "fp8", id: "fp8", "data-testid": "fp8-panel", hidden: true,
      "data-steps": 0, "data-step": "" },
    h("h2", {}, "FP8 scaling"),
    h("p", { class: "muted" }, "Each FP8 layer's inputs and kernel (float8_e4m3fn, largest 448) and output "
      + "gradient (float8_e5m2, largest 57344), divided by their scale before the cast. Range use is amax / "
      + "(format max × scale): above 1 the step's largest values were clipped (saturating); far below 1 its small "
      + "values fall under the format's smallest. Lag is the history's largest amax over this step's, which the "
      + "scale follows."),
    this.caption, this.tableBox, this.chartBox);
  }

  width() {
    return Math.max(240, this.chartBox.clientWidth || 600);
  }

  // One StepRecord, paged or streamed; one without FP8 rows, or at a step already held, changes nothing.
  push(record) {
    const rows = record.fp8;
    if (!rows?.length || (this.steps.length && record.step <= this.steps.at(-1))) return;
    for (const row of rows) {
      const key = keyOf(row);
      if (!this.series.has(key)) {
        this.series.set(key, new Array(this.steps.length).fill(null));
        this.rows.push({ layer: row.layer, tensor: row.tensor });
      }
    }
    const byKey = new Map(rows.map((row) => [keyOf(row), row]));
    this.steps.push(record.step);
    for (const [key, values] of this.series) values.push(byKey.has(key) ? log2Use(byKey.get(key)) : null);
    this.latest = record;
    if (rows.some((row) => row.saturated_fraction !== null && row.saturated_fraction !== undefined)) {
      this.checked = record;
    }
    this.schedule();
  }

  schedule() {
    if (this.timer === null) this.timer = setTimeout(() => requestAnimationFrame(() => this.render()), REDRAW_MS);
  }

  // Draws now what is buffered (at the end of a run: no redraw is left waiting).
  flush() {
    if (this.timer === null) return;
    clearTimeout(this.timer);
    this.render();
  }

  destroy() {
    this.destroyed = true;
    clearTimeout(this.timer);
    this.observer.disconnect();
    this.plot?.destroy();
  }

  render() {
    this.timer = null;
    if (this.destroyed || !this.latest) return;
    if (this.steps.length > MAX_POINTS) {
      keepEveryOther(this.steps);
      this.series.forEach(keepEveryOther);
    }
    const latest = this.latest;
    this.element.hidden = false;
    this.element.dataset.steps = String(this.steps.length);
    this.element.dataset.step = String(latest.step);
    this.element.dataset.layers = JSON.stringify([...new Set(latest.fp8.map((row) => row.layer))]);
    this.element.dataset.checkedStep = this.checked ? String(this.checked.step) : "";
    const counted = this.checked ? ` The exact shares are of step ${this.checked.step}, the latest checked step.`
      : " No checked step yet: the exact shares come on the float32 check's steps.";
    this.caption.textContent = `Latest step: ${latest.step}.${counted}`;
    this.tableBox.replaceChildren(this.table(latest));
    this.draw();
  }

  table(record) {
    const exact = new Map((this.checked?.fp8 ?? []).map((row) => [keyOf(row), row]));
    const checked = this.checked ? ` (step ${this.checked.step})` : "";
    const rows = record.fp8.map((row) => {
      const marks = marksOf(row);
      const counts = exact.get(keyOf(row));
      const cell = (field, text) => h("td", { class: "num", "data-field": field }, text);
      return h("tr", { "data-testid": "fp8-row", "data-layer": row.layer, "data-tensor": row.tensor,
        "data-flags": marks.join("; ") || null, class: marks.length ? `flagged fp8-${marks[0]}` : null },
      h("th", { scope: "row" }, h("span", { class: "mono" }, row.layer),
        marks.map((mark) => h("span", { class: `flag${mark === UNDERFLOWING ? " flag-fp8-low" : ""}`,
          title: markTitle(mark, row) }, mark))),
      h("td", { class: "mono" }, row.tensor),
      h("td", { class: "mono" }, FORMATS[row.tensor].name),
      cell("scale", finite(row.scale)),
      cell("amax", finite(row.amax)),
      cell("range_use", finite(row.range_use)),
      cell("lag", fmtNumber(lag(row))),
      cell("peak_age", String(row.peak_age)),
      cell("saturated_fraction", fmtPercent(counts?.saturated_fraction)),
      cell("underflow_fraction", fmtPercent(counts?.underflow_fraction)));
    });
    return h("table", { class: "layer-table fp8-table", "data-testid": "fp8-table", "data-step": record.step },
      h("thead", {}, h("tr", {}, [...COLUMNS, `Saturated${checked}`, `Lost to zero${checked}`]
        .map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", {}, rows));
  }

  // log2(range use) of every layer and tensor against the step; the chart is built anew when a series is added.
  draw() {
    const keys = this.rows.map(keyOf).join("\n");
    const data = [this.steps, ...this.rows.map((row) => this.series.get(keyOf(row)))];
    if (keys !== this.plotKeys) {
      this.plot?.destroy();
      const layers = [...new Set(this.rows.map((row) => row.layer))];
      this.plot = new uPlot({
        title: "FP8 range use, log₂ (0: the format's largest value at the scale in force)",
        width: this.width(),
        height: HEIGHT,
        scales: { x: { time: false }, y: { range: (u, min, max) => [Math.min(min ?? -1, -1), Math.max(max ?? 1, 1)] } },
        axes: [{ label: "step" }, { size: 56, label: "log₂ range use" }],
        series: [{ label: "step" }, ...this.rows.map((row) => ({
          label: `${row.layer} ${row.tensor}`, stroke: PALETTE[layers.indexOf(row.layer) % PALETTE.length],
          dash: DASH[row.tensor], width: 1.5, spanGaps: false, value: (u, v) => fmtNumber(v, 3),
        }))],
        hooks: { draw: [drawFull] },
      }, data, this.chartBox);
      this.plotKeys = keys;
    } else {
      this.plot.setData(data);
    }
    this.chartBox.dataset.series = String(this.rows.length);
    this.chartBox.dataset.points = String(data.slice(1).reduce((n, v) => n + v.filter((x) => x !== null).length, 0));
  }
}
