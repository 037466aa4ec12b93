// Small DOM and formatting helpers. Text always goes in as text, never as HTML:
// job names and messages come from users.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") el.className = value;
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else el.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

export const TERMINAL = new Set(["succeeded", "failed", "canceled"]);

export function stateBadge(state) {
  return h("span", { class: `state state-${state}`, "data-testid": "state" }, state);
}

export function errorBanner(error) {
  return h("p", { class: "banner error", role: "alert" }, error.message || String(error));
}

// Numbers as the CLI shows them too: each fmt* below has a twin in mpjobs/contract/formats.py, and
// tests/app/test_formatting.py checks that both give the same text for the same values.
// toExponential and toFixed round the exact binary value, ties away from zero; so does the CLI.

// `x` to `digits` significant digits, never in scientific notation, no trailing zeros.
function significant(x, digits) {
  const [mantissa, exponent] = x.toExponential(digits - 1).split("e");
  const figures = mantissa.replace("-", "").replace(".", "");
  const e = Number(exponent);
  let text;
  if (e < 0) text = `0.${"0".repeat(-e - 1)}${figures}`;
  else if (figures.length <= e + 1) text = figures + "0".repeat(e + 1 - figures.length);
  else text = `${figures.slice(0, e + 1)}.${figures.slice(e + 1)}`;
  if (text.includes(".")) text = text.replace(/\.?0+$/, "");
  return (x < 0 ? "-" : "") + text;
}

function whole(x) {
  return Math.abs(x) < 1e21 ? x.toFixed(0) : BigInt(x).toString(); // toFixed turns scientific from 1e21
}

// `digits` significant digits; scientific below 0.001 and from a million up; whole numbers whole.
export function fmtNumber(value, digits = 4) {
  if (value === null || value === undefined) return "–";
  if (value === 0) return "0";
  const abs = Math.abs(value);
  if (Number.isInteger(value) && abs < 1e12) return String(value); // loss scales are exact powers of two
  if (abs >= 1e6 || abs < 1e-3) {
    const [mantissa, exponent] = value.toExponential(digits - 1).split("e");
    return `${String(Number(mantissa))}e${exponent}`;
  }
  return significant(value, digits);
}

// A share (0.00053) as a percentage: two significant digits under 10%, whole from 10% up.
// Only an exact 0 reads "0%", and only 100% or more reads "100%" (99.7% reads "99%").
// With `sign`, a positive value gets a "+", as loss gaps do; a negative one always has its "-".
export function fmtPercent(share, sign = false) {
  if (share === null || share === undefined) return "–";
  const value = share * 100;
  if (value === 0) return "0%";
  const size = Math.abs(value);
  let text = size < 10 ? significant(size, 2) : whole(size);
  if (text === "100" && size < 100) text = "99";
  return `${value < 0 ? "-" : sign ? "+" : ""}${text}%`;
}

// A rate (examples/s): whole, with thousands separators, from 100 up; three significant digits below.
export function fmtRate(value) {
  if (value === null || value === undefined) return "–";
  if (Math.abs(value) >= 100) return whole(value).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  return value === 0 ? "0" : significant(value, 3);
}

// A ratio to float32 (step time, speed): two decimals, or two significant digits under 0.1 (never "0.00×").
export function fmtRatio(value) {
  if (value === null || value === undefined) return "–";
  const fixed = value.toFixed(2);
  return `${Math.abs(Number(fixed)) >= 0.1 || value === 0 ? fixed : significant(value, 2)}×`;
}

// A measured speed against float32 in words, with its interval: twin of mpjobs/contract/formats.py speed_words.
// `slowdown` is step time over float32's; `difference` is the measurement's own call, never re-judged here.
export function fmtSpeed(slowdown, low, high, difference) {
  if (difference === "slower") return `${fmtRatio(slowdown)} slower than float32 (${fmtRatioRange(low, high)})`;
  if (difference === "faster") {
    return `${fmtRatio(1 / slowdown)} faster than float32 (${fmtRatioRange(1 / high, 1 / low)})`;
  }
  return `no measurable speed difference from float32 (step time ${fmtRatioRange(low, high)} float32's)`;
}

// Two ratios as a range, the sign once at the end: twin of mpjobs/contract/formats.py ratio_range.
export function fmtRatioRange(low, high, unit = "×") {
  return `${fmtRatio(low).slice(0, -1)}–${fmtRatio(high).slice(0, -1)}${unit}`;
}

export function fmtTime(iso) {
  if (!iso) return "–";
  const date = new Date(iso);
  return Number.isNaN(date.getTime()) ? iso : date.toLocaleString();
}

// Today's times as a time of day; older ones with their date.
export function fmtShortTime(iso) {
  const date = new Date(iso);
  if (!iso || Number.isNaN(date.getTime())) return "–";
  const today = date.toDateString() === new Date().toDateString();
  return today ? date.toLocaleTimeString() : date.toLocaleDateString();
}

export function lossScaleText(lossScale) {
  if (!lossScale) return "default";
  if (lossScale.mode === "fixed") return `fixed ${fmtNumber(lossScale.scale)}`;
  if (lossScale.mode === "dynamic") {
    return `dynamic from ${fmtNumber(lossScale.initial_scale)}, ×2 every ${lossScale.growth_steps} steps`;
  }
  return lossScale.mode;
}

export function progressBar({ step, total_steps: total }) {
  const share = total ? Math.min(1, step / total) : 0;
  return h("span", { class: "progress", "data-testid": "progress" },
    h("progress", { max: total || 1, value: step, "aria-label": "progress" }),
    h("span", { class: "progress-text" }, `${step} / ${total}`),
    h("span", { class: "visually-hidden" }, ` (${Math.round(share * 100)}%)`));
}

// Calls `fn` now and then every `ms` after it settles, until the returned stop() is called.
export function poll(fn, ms) {
  let stopped = false;
  let timer = null;
  const tick = async () => {
    try {
      await fn();
    } catch (error) {
      console.warn(error);
    } finally {
      if (!stopped) timer = setTimeout(tick, ms);
    }
  };
  tick();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
