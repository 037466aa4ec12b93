// The dashboard's router: one view at a time in <main>, chosen by the URL hash.

import { apiKey, forgetKey } from "./api.js";
import { comparisonView, comparisonsView } from "./comparisons.js";
import { h } from "./dom.js";
import { jobView } from "./job.js";
import { jobsView } from "./jobs.js";

const ROUTES = [
  [/^#?\/?$/, "jobs", jobsView],
  [/^#\/jobs\/?$/, "jobs", jobsView],
  [/^#\/jobs\/([^/]+)$/, "jobs", jobView],
  [/^#\/jobs\/([^/]+)\/layers\/?([^/]*)$/, "jobs", jobView], // "" when no layer is named: the panel itself
  [/^#\/comparisons\/?$/, "comparisons", comparisonsView],
  [/^#\/comparisons\/([^/]+)$/, "comparisons", comparisonView],
];

const main = document.getElementById("view");
let leave = null;

function route() {
  leave?.();
  leave = null;
  main.replaceChildren();
  const hash = location.hash;
  for (const [pattern, section, view] of ROUTES) {
    const match = hash.match(pattern);
    if (!match) continue;
    for (const link of document.querySelectorAll("[data-nav]")) {
      if (link.dataset.nav === section) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    main.dataset.view = view.name;
    leave = view(main, ...match.slice(1).map(decodeURIComponent));
    return;
  }
  main.dataset.view = "notFound";
  main.append(h("section", { class: "panel" }, h("h1", {}, "Not found"),
    h("p", {}, "No such page. ", h("a", { href: "#/jobs" }, "Go to the jobs."))));
}

function showKeyButton() {
  document.getElementById("forget-key").hidden = apiKey() === null;
}

document.getElementById("forget-key").addEventListener("click", () => {
  forgetKey();
  location.reload();
});
document.addEventListener("mpjobs:key", showKeyButton);
window.addEventListener("hashchange", route);
showKeyButton();
route();
