// Shareable state: a tab's inputs in the URL's fragment (never the API token), so a link restores the
// form and, for a seeded completion, the output. Examples are such links too.

import { $ } from "./api.js";
import { FIELDS } from "./requests.js";

/** The fragment for a tab's current inputs: tab=complete&prompt=...&seed=7 */
export function stateOf(tab) {
  const params = new URLSearchParams({ tab });
  for (const [key, id] of Object.entries(FIELDS[tab])) {
    if ($(id).value !== "") params.set(key, $(id).value);
  }
  return params.toString();
}

export function linkFor(tab) {
  return `${location.origin}${location.pathname}#${stateOf(tab)}`;
}

/** {tab, values} from a fragment, keeping only the tab's own keys; null when it names no tab. */
export function readState(fragment) {
  const params = new URLSearchParams(fragment.replace(/^#/, ""));
  const tab = params.get("tab");
  if (!Object.hasOwn(FIELDS, tab)) return null;
  const values = {};
  for (const [key, value] of params) if (Object.hasOwn(FIELDS[tab], key)) values[key] = value;
  return { tab, values };
}

function setField(id, value) {
  const el = $(id);
  if (el.tagName === "SELECT" && ![...el.options].some((o) => o.value === value)) return; // not served here
  el.value = value;
  el.dispatchEvent(new Event("input", { bubbles: true }));
}

/** Fill the tab's form; the model goes first so that `afterModel` can rebuild what depends on it. */
export function applyState({ tab, values }, afterModel) {
  const fields = FIELDS[tab];
  if (values.model !== undefined) {
    setField(fields.model, values.model);
    afterModel(tab);
  }
  for (const [key, value] of Object.entries(values)) if (key !== "model") setField(fields[key], value);
}
