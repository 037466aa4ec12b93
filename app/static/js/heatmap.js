// The layers heatmap: layers (rows, input side first) × layer checks (columns, by step), a colour class per cell.

import { fmtNumber, fmtPercent, h } from "./dom.js";

const MAX_COLUMNS = 200; // a longer run shows evenly spaced checks, the first and the latest among them

// A cell: `level` 0 (coolest) to 5 (hottest), or null (no value, drawn hatched); `text` says it in words.
function excessCell(layer) {
  const v = layer.excess_zero_fraction;
  if (v === null || v === undefined) {
    const why = layer.values === 0 ? "nothing to train"
      : layer.grads_finite === false ? "gradient not finite" : "no float32 reference";
    return { level: null, value: null, text: `no value (${why})` };
  }
  const level = v === 0 ? 0 : v < 0.01 ? 1 : v < 0.1 ? 2 : v < 0.5 ? 3 : v < 0.9 ? 4 : 5;
  return { level, value: v, text: `excess zeros ${fmtPercent(v)}` };
}

// Fewer doublings left before the activation dtype's largest value is hotter; overflowed is the hottest.
function headroomCell(layer) {
  const v = layer.activation_headroom_log2;
  if (layer.activation_finite === false) return { level: 5, value: v ?? null, text: "overflowed (non-finite activations)" };
  if (v === null || v === undefined) {
    return { level: null, value: null, text: `no value (${layer.activation_dtype ? "all-zero output" : "output not read"})` };
  }
  const level = v <= 0 ? 5 : v <= 2 ? 4 : v <= 4 ? 3 : v <= 8 ? 2 : v <= 16 ? 1 : 0;
  const words = v <= 0 ? "overflowed" : "of headroom";
  return { level, value: v, text: `${fmtNumber(v, 3)} doublings ${words} (${layer.activation_dtype})` };
}

export const METRICS = {
  excess: {
    label: "Excess zeros",
    about: "Share of each layer's gradient values that are zero under the policy but not in float32.",
    cell: excessCell,
    legend: ["0", "under 1%", "1–10%", "10–50%", "50–90%", "90% or more"],
    none: "no value: nothing to train, or no float32 reference",
    mark: "the check's underflow_layer: where underflow begins",
    marked: (check, name) => check.underflow_layer === name,
  },
  headroom: {
    label: "Activation headroom",
    about: "Doublings each layer's output has left before its dtype's largest value (float16: 65504).",
    cell: headroomCell,
    legend: ["over 16 doublings", "8–16", "4–8", "2–4", "2 or fewer", "overflowed or non-finite"],
    none: "no value: all-zero output, or output not read",
    mark: "the check's overflow_layer: first near overflow",
    marked: (check, name) => check.overflow_layer === name,
  },
};

// At most MAX_COLUMNS checks, evenly spaced, always the first and the latest.
export function sampleColumns(checks) {
  if (checks.length <= MAX_COLUMNS) return checks;
  const last = checks.length - 1;
  return Array.from({ length: MAX_COLUMNS }, (_, i) => checks[Math.round((i * last) / (MAX_COLUMNS - 1))]);
}

// Layer names in model order (input side first): the latest check's, then any only older checks had.
export function layerOrder(checks) {
  const names = checks.at(-1).layers.map((l) => l.name);
  const seen = new Set(names);
  for (const check of checks) {
    for (const l of check.layers) if (!seen.has(l.name)) { seen.add(l.name); names.push(l.name); }
  }
  return names;
}

function heatCell(metric, check, byName, name) {
  const layer = byName.get(name);
  const { level, value, text } = layer ? metric.cell(layer) : { level: null, value: null, text: "not in this check" };
  const marked = metric.marked(check, name);
  return h("td", {
    class: `heat heat-${level ?? "none"}${marked ? " marked" : ""}`, "data-testid": "heat-cell",
    "data-layer": name, "data-step": check.step, "data-level": level ?? "none", "data-value": value ?? "",
    title: `${name} · step ${check.step}: ${text}${marked ? ` · ${metric.mark}` : ""}`,
  });
}

export function heatmap(checks, metricKey, kinds) {
  const metric = METRICS[metricKey];
  const columns = sampleColumns(checks);
  const names = layerOrder(checks);
  const lookups = columns.map((c) => new Map(c.layers.map((l) => [l.name, l])));
  return h("div", { class: "heatmap-wrap" }, h("table", {
    class: "heatmap", "data-testid": "layers-heatmap", "data-metric": metricKey,
    "data-rows": names.length, "data-columns": columns.length,
  },
  h("caption", { class: "visually-hidden" }, `${metric.label} per layer (rows) and check (columns)`),
  h("thead", {}, h("tr", {}, h("th", { scope: "col", class: "heat-corner" }, "Layer \\ step"),
    columns.map((c) => h("th", { scope: "col", class: "heat-step", title: `step ${c.step}` }, c.step)))),
  h("tbody", {}, names.map((name) => h("tr", { "data-testid": "heat-row", "data-layer": name },
    h("th", { scope: "row", class: "heat-name", title: kinds.get(name) ?? "" }, name),
    columns.map((c, i) => heatCell(metric, c, lookups[i], name)))))));
}

export function heatLegend(metricKey) {
  const metric = METRICS[metricKey];
  return h("ul", { class: "heat-legend", "data-testid": "layers-legend", "data-metric": metricKey },
    metric.legend.map((text, level) => h("li", {}, h("span", { class: `swatch heat-${level}` }), text)),
    h("li", {}, h("span", { class: "swatch heat-none" }), metric.none),
    h("li", {}, h("span", { class: "swatch marked" }), metric.mark));
}
