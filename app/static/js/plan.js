// The precision plan of a job (GET /jobs/<id>/plan): which layers to keep in float32, and what loss scale, so that
// its first flagged step matches float32; the search, move by move; the spec fragment and the lines of Keras.
import { api } from "./api.js";
import { fmtNumber, fmtPercent, h } from "./dom.js";

function moveText(move, index) {
  const what = index === 0 ? "the step as it was" : [move.loss_scale ? `loss scale ${fmtNumber(move.loss_scale)}` : "",
    move.pinned.length ? `float32: ${move.pinned.join(", ")}` : ""].filter(Boolean).join(", ");
  const error = move.grad_rel_error === null ? "not finite" : fmtPercent(move.grad_rel_error);
  return `${what}: flagged ${move.flagged.join(", ") || "none"}; gradient error against float32 ${error}`;
}

export class PlanBox {
  constructor(jobId) {
    this.path = `/jobs/${encodeURIComponent(jobId)}/plan`;
    this.asked = false;
    this.element = h("section", { class: "plan", "data-testid": "plan", hidden: true });
  }

  // Called on each redraw of the Layers panel with the check that carries a plan, if any: fetched once.
  async show(check) {
    if (!check || this.asked) return;
    this.asked = true;
    try {
      this.render(await api.get(this.path));
    } catch (error) {
      this.element.hidden = false;
      this.element.replaceChildren(h("p", { class: "error" }, `Precision plan: ${error.message}`));
    }
  }

  render({ plan, spec_fragment: fragment, keras }) {
    this.element.hidden = false;
    this.element.dataset.holds = String(plan.holds);
    this.element.replaceChildren(
      h("h3", {}, `Precision plan (step ${plan.step}, ${plan.evaluated} candidates tried)`),
      h("p", { "data-testid": "plan-message" }, plan.message),
      h("ol", { class: "plan-moves", start: 0 }, plan.moves.map((move, i) => h("li", {}, moveText(move, i)))),
      h("p", { class: "muted" }, "As a spec fragment:"),
      h("pre", { class: "mono", "data-testid": "plan-fragment" }, JSON.stringify(fragment)),
      h("p", { class: "muted" }, "In Keras:"),
      h("pre", { class: "mono", "data-testid": "plan-keras" }, keras));
  }
}
