// The API client: JSON requests with the API key, and the SSE stream read with fetch().
//
// EventSource cannot send an Authorization header, so the stream is read with fetch()
// and a ReadableStream, and parsed as Server-Sent Events here.

const KEY_STORAGE = "mpjobs.apiKey";
const RETRY_MIN_MS = 500;
const RETRY_MAX_MS = 10_000;

let keyPrompt = null; // one prompt shared by every request that met a 401

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

export function forgetKey() {
  sessionStorage.removeItem(KEY_STORAGE);
}

export class ApiError extends Error {
  constructor(status, body) {
    const detail = body && typeof body.detail === "string" ? body.detail : `HTTP ${status}`;
    super(detail);
    this.status = status;
    this.body = body;
  }
}

function authHeaders(key) {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// Shows the key dialog; resolves once a key is stored. `refused`: the stored key got a 401.
function askForKey(refused) {
  if (keyPrompt) return keyPrompt;
  keyPrompt = new Promise((resolve) => {
    const dialog = document.getElementById("key-dialog");
    const form = document.getElementById("key-form");
    const input = document.getElementById("key-input");
    const error = document.getElementById("key-error");
    error.hidden = !refused;
    error.textContent = refused ? "The server refused that key. Enter another." : "";
    const onCancel = (event) => event.preventDefault(); // nothing works without a key
    dialog.addEventListener("cancel", onCancel);
    form.addEventListener("submit", () => {
      sessionStorage.setItem(KEY_STORAGE, input.value.trim());
      input.value = "";
      dialog.removeEventListener("cancel", onCancel);
      keyPrompt = null;
      document.dispatchEvent(new Event("mpjobs:key"));
      resolve();
    }, { once: true });
    if (!dialog.open) dialog.showModal();
    input.focus();
  });
  return keyPrompt;
}

// After a 401 for a request sent with `usedKey`: ask, unless the key changed meanwhile.
async function onUnauthorized(usedKey) {
  if (apiKey() !== usedKey) return;
  if (usedKey !== null) forgetKey();
  await askForKey(usedKey !== null);
}

export async function request(method, path, body) {
  for (;;) {
    const key = apiKey();
    const headers = { Accept: "application/json", ...authHeaders(key) };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(path, {
      method, headers, cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (response.status === 401) {
      await onUnauthorized(key);
      continue;
    }
    const text = await response.text();
    let data = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch {
      data = { detail: text };
    }
    if (!response.ok) throw new ApiError(response.status, data);
    return data;
  }
}

export const api = {
  get: (path) => request("GET", path),
  post: (path, body) => request("POST", path, body),
  del: (path) => request("DELETE", path),
};

// Server-Sent Events from a fetch() body: yields {event, id, data}.
async function* parseSse(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let fields = { event: "", id: null };
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const lines = buffer.split("\n");
      buffer = lines.pop();
      for (let line of lines) {
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (data.length) yield { event: fields.event || "message", id: fields.id, data: data.join("\n") };
          fields = { event: "", id: null };
          data = [];
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const name = colon < 0 ? line : line.slice(0, colon);
        let text = colon < 0 ? "" : line.slice(colon + 1);
        if (text.startsWith(" ")) text = text.slice(1);
        if (name === "data") data.push(text);
        else if (name === "event") fields.event = text;
        else if (name === "id") fields.id = text;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
  });
}

// Follows a job's metrics stream from step `after` until its `end` event, reconnecting with
// `?after=<last step seen>` after a network error, a 5xx (waiting its Retry-After) or an `error` event
// (the server ended the stream early, saying why). `onStatus` gets "live" or "reconnecting".
// `onEvent` gets every event: `metrics` (one StepRecord; its id, the step, is where a reconnect
// resumes), `layers` (one LayerCheck; no id, so it never moves the resume point), `state`, `end`.
export async function followMetrics(jobId, { after, signal, onEvent, onStatus }) {
  const path = `/jobs/${encodeURIComponent(jobId)}/metrics/stream`;
  let wait = RETRY_MIN_MS;
  while (!signal.aborted) {
    const key = apiKey();
    try {
      const response = await fetch(`${path}?after=${after}`, {
        headers: { Accept: "text/event-stream", ...authHeaders(key) }, cache: "no-store", signal,
      });
      if (response.status === 401) {
        await onUnauthorized(key);
        continue;
      }
      if (!response.ok) {
        const error = new ApiError(response.status, await response.json().catch(() => null));
        if (response.status === 404 || response.status === 422) throw error;
        const retryAfter = Number(response.headers.get("Retry-After"));
        if (retryAfter > 0) wait = Math.min(Math.max(wait, retryAfter * 1000), RETRY_MAX_MS);
        throw Object.assign(error, { retry: true });
      }
      onStatus("live");
      for await (const event of parseSse(response.body)) {
        wait = RETRY_MIN_MS;
        if (event.event === "error") {
          // The server ended the stream early and said why (too_slow, redis_unavailable, ...): resume.
          let why = {};
          try { why = JSON.parse(event.data); } catch { /* a reason we cannot read is still a reason to resume */ }
          throw Object.assign(new Error(why.detail || "the stream ended early"), { reason: why.reason });
        }
        if (event.event === "metrics" && event.id !== null) after = Number(event.id);
        onEvent(event);
        if (event.event === "end") return "end";
      }
    } catch (error) {
      if (signal.aborted) return "aborted";
      if (error instanceof ApiError && !error.retry) throw error;
    }
    onStatus("reconnecting");
    await sleep(wait, signal);
    wait = Math.min(wait * 2, RETRY_MAX_MS);
  }
  return "aborted";
}
