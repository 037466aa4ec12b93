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

export function fmtNumber(value, digits = 4) {
  if (value === null || value === undefined) return "–";
  if (value === 0) return "0";
  const abs = Math.abs(value);
  if (Number.isInteger(value) && abs < 1e12) return String(value); // loss scales are exact powers of two
  if (abs >= 1e6 || abs < 1e-3) return value.toExponential(digits - 1);
  return String(Number(value.toPrecision(digits)));
}

export function fmtPercent(value, digits = 1) {
  return value === null || value === undefined ? "–" : `${(value * 100).toFixed(digits)}%`;
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
