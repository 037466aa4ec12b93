// #/jobs: the submit form and the live job list.

import { api } from "./api.js";
import { errorBanner, fmtShortTime, fmtTime, h, poll, progressBar, stateBadge } from "./dom.js";
import { specForm } from "./form.js";

const POLL_MS = 1500;
const PAGE = 50;
const MAX_PAGE = 200;

function row(job) {
  const href = `#/jobs/${encodeURIComponent(job.id)}`;
  const diagnoses = job.summary?.diagnoses ?? [];
  return h("tr", { "data-testid": "job-row", "data-job-id": job.id, "data-state": job.state },
    h("td", {}, h("a", { href, "data-testid": "job-link", title: job.id }, job.name || job.id.slice(0, 12)),
      job.name ? h("div", { class: "muted mono", title: job.id }, job.id.slice(0, 12)) : null),
    h("td", {}, stateBadge(job.state)),
    h("td", { class: "mono" }, job.spec.precision_policy),
    h("td", { class: "mono" }, job.spec.loss_scale?.mode ?? "default"),
    h("td", {}, progressBar(job.progress)),
    h("td", {}, diagnoses.length
      ? h("ul", { class: "chips" }, diagnoses.map((d) => h("li", { class: `chip chip-${d.code}`, title: d.message }, d.code)))
      : h("span", { class: "muted" }, "none")),
    h("td", { class: "muted nowrap", title: fmtTime(job.created_at) }, fmtShortTime(job.created_at)));
}

export function jobsView(root) {
  let limit = PAGE;
  let shown = "";
  const body = h("tbody", { "data-testid": "job-rows" });
  const problem = h("div");
  const more = h("button", { type: "button", class: "secondary", "data-testid": "more-jobs", hidden: true,
    onclick: () => { limit = MAX_PAGE; refresh(); } }, `Show up to ${MAX_PAGE}`);
  const table = h("table", { class: "jobs", "data-testid": "job-list" },
    h("caption", { class: "visually-hidden" }, "Jobs, newest first"),
    h("thead", {}, h("tr", {}, ["Job", "State", "Policy", "Loss scale", "Progress", "Diagnoses", "Created"]
      .map((t) => h("th", { scope: "col" }, t)))),
    body);

  const refresh = async () => {
    try {
      const page = await api.get(`/jobs?limit=${limit}`);
      problem.replaceChildren();
      const signature = JSON.stringify(page.jobs);
      if (signature !== shown) {
        shown = signature;
        body.replaceChildren(...page.jobs.map(row));
        if (!page.jobs.length) body.append(h("tr", {}, h("td", { colspan: 7, class: "muted" }, "No jobs yet.")));
      }
      more.hidden = !page.next_cursor || limit >= MAX_PAGE;
      table.dataset.count = String(page.jobs.length);
    } catch (error) {
      problem.replaceChildren(errorBanner(error));
    }
  };

  const form = specForm((kind, resource) => {
    if (kind === "comparison") location.hash = `#/comparisons/${encodeURIComponent(resource.id)}`;
    else refresh();
  });
  root.append(h("div", { class: "split" },
    h("aside", { class: "panel" }, form),
    h("section", { class: "panel", "aria-labelledby": "jobs-title" },
      h("h1", { id: "jobs-title" }, "Jobs"), problem, h("div", { class: "table-wrap" }, table), more)));
  return poll(refresh, POLL_MS);
}
