// uPlot charts: a job's four live step charts, and the overlaid loss curves of a comparison.
// uPlot is the global from /static/vendor/uPlot.iife.min.js.

import { h, fmtNumber } from "./dom.js";

const REDRAW_MS = 100; // at most 10 redraws a second, however fast steps arrive
const MAX_POINTS = 20_000; // past this, keep every other point: the chart stays fast on long runs
const HEIGHT = 220;
const SKIP_COLOR = "rgba(220, 38, 38, 0.55)";
export const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563"];

const SUPERSCRIPT = { "-": "⁻", 0: "⁰", 1: "¹", 2: "²", 3: "³", 4: "⁴", 5: "⁵", 6: "⁶", 7: "⁷", 8: "⁸", 9: "⁹" };

function powerOfTwo(value) {
  const exponent = Math.log2(value);
  if (!Number.isInteger(exponent)) return fmtNumber(value, 3);
  return `2${[...String(exponent)].map((c) => SUPERSCRIPT[c]).join("")}`;
}

const LABEL_PX = 16; // a log₂-axis label needs this much height to stay clear of its neighbours

// Ticks of the loss-scale axis: the powers of two the run visited, those it spent the most steps at
// first, as many as fit without overlapping. uPlot's own choice on a wide range (2³² down to 2¹⁷) was
// every fourth power, which left the scale a run spent 280 steps at unlabelled. `stepsAt`: exponent ->
// steps. Before any step: every power in range that fits. The chosen ticks go to `box.dataset.ticks`.
function visitedPowers(stepsAt, box) {
  return (u, axisIndex, min, max) => {
    const [low, high] = [Math.ceil(Math.log2(min)), Math.floor(Math.log2(max))];
    const span = Math.max(Math.log2(max) - Math.log2(min), 1e-9);
    const px = (e) => ((e - Math.log2(min)) / span) * (u.bbox.height / devicePixelRatio);
    let candidates = [...stepsAt().entries()].filter(([e]) => e >= low && e <= high)
      .sort((a, b) => b[1] - a[1] || b[0] - a[0]).map(([e]) => e);
    if (!candidates.length) candidates = Array.from({ length: Math.max(0, high - low + 1) }, (_, i) => high - i);
    const chosen = [];
    for (const e of candidates) {
      if (chosen.every((c) => Math.abs(px(c) - px(e)) >= LABEL_PX)) chosen.push(e);
    }
    chosen.sort((a, b) => a - b);
    box.dataset.ticks = JSON.stringify(chosen);
    return chosen.map((e) => 2 ** e);
  };
}

// Steps are whole numbers: never put a tick at step 2.5.
const STEP_INCREMENTS = [1, 2, 5].flatMap((m) => [0, 1, 2, 3, 4, 5, 6, 7].map((e) => m * 10 ** e))
  .sort((a, b) => a - b);

// Tick labels with as many digits as the tick spacing needs, so a loss of 4.4e-5 is not "0".
function tickLabels(u, splits, axisIndex, space, increment) {
  const largest = Math.max(...splits.map(Math.abs));
  const step = increment || largest || 1;
  if (largest !== 0 && (largest < 1e-3 || largest >= 1e6)) {
    const digits = Math.max(0, Math.floor(Math.log10(largest)) - Math.floor(Math.log10(step)));
    return splits.map((v) => (v === 0 ? "0" : v.toExponential(Math.min(digits, 6))));
  }
  const text = String(Number(step.toPrecision(6))); // 0.25 -> "0.25": two decimals
  const decimals = text.includes("e-") ? Number(text.split("e-")[1]) : (text.split(".")[1] ?? "").length;
  return splits.map((v) => v.toFixed(Math.min(decimals, 8)));
}

function keepEveryOther(values) {
  let kept = 0;
  for (let i = 0; i < values.length; i += 2) values[kept++] = values[i];
  values.length = kept;
}

function width(box) {
  return Math.max(240, box.clientWidth || 600);
}

function resizeWith(box, plot) {
  const observer = new ResizeObserver(() => plot().setSize({ width: width(box), height: HEIGHT }));
  observer.observe(box);
  return observer;
}

// A vertical line at every skipped step, drawn over the plot area.
function skipMarkers(skippedSteps) {
  return (u) => {
    const steps = skippedSteps();
    if (!steps.length) return;
    const { left, top, width: w, height } = u.bbox;
    const ctx = u.ctx;
    ctx.save();
    ctx.strokeStyle = SKIP_COLOR;
    ctx.lineWidth = Math.max(1, devicePixelRatio);
    ctx.beginPath();
    let previous = null;
    for (const step of steps) {
      const x = Math.round(u.valToPos(step, "x", true));
      if (x === previous || x < left || x > left + w) continue;
      previous = x;
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
    }
    ctx.stroke();
    ctx.restore();
  };
}

const CHARTS = [
  { key: "loss", title: "Loss (unscaled, per batch)", field: "loss", color: PALETTE[0] },
  { key: "loss-scale", title: "Loss scale (log₂ axis)", field: "loss_scale", color: PALETTE[3], log2: true },
  { key: "grad-norm", title: "Gradient norm (unscaled)", field: "grad_norm", color: PALETTE[2] },
  { key: "zero-grad", title: "Zero-gradient fraction", field: "zero_grad_fraction", color: PALETTE[4],
    range: [0, 1] },
];

// The four charts of a job page. Records are buffered; the charts redraw at most every REDRAW_MS.
export class JobCharts {
  constructor(root) {
    this.steps = [];
    this.series = Object.fromEntries(CHARTS.map((c) => [c.field, []]));
    this.skipped = [];
    this.scaleSteps = new Map(); // exponent -> steps the run spent at that loss scale (powers of two only)
    this.timer = null;
    this.lastDraw = 0;
    const drawSkips = skipMarkers(() => this.skipped);
    this.charts = CHARTS.map((chart) => {
      const box = h("figure", { class: "chart", "data-testid": `chart-${chart.key}`, "data-points": "0",
        "data-skipped": "0", "aria-label": chart.title });
      root.append(box);
      const options = {
        title: chart.title,
        width: width(box),
        height: HEIGHT,
        cursor: { sync: { key: "job" } },
        scales: {
          x: { time: false },
          y: chart.log2 ? { distr: 3, log: 2 } : (chart.range ? { range: chart.range } : {}),
        },
        axes: [
          { label: "step", incrs: STEP_INCREMENTS },
          chart.log2
            ? { size: 64, values: (u, values) => values.map(powerOfTwo),
              splits: visitedPowers(() => this.scaleSteps, box) }
            : { size: 64, values: tickLabels },
        ],
        series: [
          { label: "step" },
          { label: chart.title.split(" (")[0], stroke: chart.color, width: 1.5, spanGaps: false,
            value: (u, v) => (chart.log2 && v !== null ? `${fmtNumber(v, 6)}` : fmtNumber(v)) },
        ],
        hooks: { draw: [drawSkips] },
      };
      const plot = new uPlot(options, [this.steps, this.series[chart.field]], box);
      return { box, plot, observer: resizeWith(box, () => plot) };
    });
  }

  // One StepRecord; a null loss (non-finite) leaves a gap.
  push(record) {
    this.steps.push(record.step);
    for (const field of Object.keys(this.series)) this.series[field].push(record[field] ?? null);
    if (record.skipped) this.skipped.push(record.step);
    this.countScale(record.loss_scale, 1);
    this.schedule();
  }

  countScale(scale, steps) {
    const exponent = scale > 0 ? Math.log2(scale) : NaN;
    if (Number.isInteger(exponent)) this.scaleSteps.set(exponent, (this.scaleSteps.get(exponent) ?? 0) + steps);
  }

  // One bucket of a long run's history (GET /jobs/{id}/metrics?max_points=...), at its last step.
  // Buckets carry no zero-gradient fraction: that chart starts with the live steps.
  pushBucket(bucket) {
    this.steps.push(bucket.last_step);
    this.series.loss.push(bucket.loss.mean);
    this.series.loss_scale.push(bucket.loss_scale.min);
    this.series.grad_norm.push(bucket.grad_norm.mean);
    this.series.zero_grad_fraction.push(null);
    if (bucket.skipped > 0) this.skipped.push(bucket.last_step);
    this.countScale(bucket.loss_scale.min, bucket.steps); // a bucket's steps, at the scale it is drawn at
    if (bucket.loss_scale.max !== bucket.loss_scale.min) this.countScale(bucket.loss_scale.max, 0);
    this.schedule();
  }

  get lastStep() {
    return this.steps.length ? this.steps[this.steps.length - 1] : 0;
  }

  schedule() {
    if (this.timer !== null) return;
    const wait = Math.max(0, REDRAW_MS - (performance.now() - this.lastDraw));
    this.timer = setTimeout(() => requestAnimationFrame(() => this.draw()), wait);
  }

  // Draws now what is buffered (at the end of a run: no redraw is left waiting).
  flush() {
    clearTimeout(this.timer);
    this.draw();
  }

  draw() {
    this.timer = null;
    if (this.destroyed) return;
    this.lastDraw = performance.now();
    if (this.steps.length > MAX_POINTS) {
      keepEveryOther(this.steps);
      Object.values(this.series).forEach(keepEveryOther);
    }
    CHARTS.forEach((chart, i) => {
      const { box, plot } = this.charts[i];
      plot.setData([this.steps, this.series[chart.field]]);
      // Points actually drawn: a series of nulls (nothing plotted) counts zero.
      box.dataset.points = String(this.series[chart.field].filter((v) => v !== null).length);
      box.dataset.skipped = String(this.skipped.length);
    });
  }

  destroy() {
    this.destroyed = true;
    clearTimeout(this.timer);
    for (const { plot, observer } of this.charts) {
      observer.disconnect();
      plot.destroy();
    }
  }
}

// Each run of an overlay gets its own colour, dash pattern and width, the first (float32, drawn
// first) the widest and solid: curves that nearly coincide still show each other through the gaps.
export const DASHES = [[], [10, 5], [2, 4], [14, 4, 3, 4], [6, 3], [1, 2], [18, 6]];
const WIDTHS = [3.5, 2, 2, 1.5, 1.5, 1.5, 1.5];

export function runStyle(i) {
  return { stroke: PALETTE[i % PALETTE.length], dash: DASHES[i % DASHES.length], width: WIDTHS[i % WIDTHS.length] };
}

// Loss curves of several runs in one chart. `update([{label, points: [[step, loss], ...]}])`.
// The series' styles go to `box.dataset.styles` (JSON), for tests and anyone reading the DOM.
export class OverlayChart {
  constructor(root, testid, title) {
    this.box = h("figure", { class: "chart", "data-testid": testid, "data-series": "0", "data-points": "0",
      "aria-label": title });
    root.append(this.box);
    this.title = title;
    this.plot = null;
    this.labels = null;
    this.observer = resizeWith(this.box, () => this.plot || { setSize() {} });
  }

  update(runs) {
    const xs = [...new Set(runs.flatMap((run) => run.points.map(([x]) => x)))].sort((a, b) => a - b);
    const index = new Map(xs.map((x, i) => [x, i]));
    const ys = runs.map((run) => {
      const values = new Array(xs.length).fill(null);
      for (const [x, y] of run.points) values[index.get(x)] = y;
      return values;
    });
    const labels = runs.map((run) => run.label).join("\n");
    if (labels !== this.labels) {
      this.plot?.destroy();
      this.plot = new uPlot({
        title: this.title,
        width: width(this.box),
        height: HEIGHT + 60,
        scales: { x: { time: false } },
        axes: [{ label: "step", incrs: STEP_INCREMENTS }, { size: 64, values: tickLabels }],
        series: [{ label: "step" }, ...runs.map((run, i) => ({
          label: run.label, ...runStyle(i), spanGaps: true, value: (u, v) => fmtNumber(v),
        }))],
      }, [xs, ...ys], this.box);
      this.box.dataset.styles = JSON.stringify(this.plot.series.slice(1).map((s, i) =>
        ({ label: s.label, stroke: runStyle(i).stroke, dash: s.dash ?? [], width: s.width })));
      this.labels = labels;
    } else {
      this.plot.setData([xs, ...ys]);
    }
    this.box.dataset.series = String(runs.length);
    this.box.dataset.points = String(runs.reduce((n, run) => n + run.points.length, 0));
  }

  destroy() {
    this.observer.disconnect();
    this.plot?.destroy();
  }
}
