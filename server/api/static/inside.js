// Looking inside a model: the logit lens (layers x positions, coloured by the top token's probability),
// head ablation (each head's effect as a layers x heads grid whose cells ablate that head when clicked,
// or the next-token change for the heads chosen) and activation patching (layers x positions heatmap).

import { colour } from "./attention.js";

const pct = (p) => `${(p * 100).toFixed(1)}%`;
const top = (list) => list.map((p) => `${JSON.stringify(p.token)} ${pct(p.prob)}`).join(", ");

function cell(tag, text, className) {
  const el = document.createElement(tag);
  el.textContent = text;
  if (className) el.className = className;
  return el;
}

/** A table: a header row of column labels, then one row per label with its cells. */
function grid(columns, rows) {
  const table = document.createElement("table");
  table.className = "inside-grid";
  const head = document.createElement("tr");
  head.append(cell("th", ""), ...columns.map((c) => cell("th", c, "column")));
  table.append(head);
  for (const [label, cells] of rows) {
    const tr = document.createElement("tr");
    tr.append(cell("th", label, "row-label"), ...cells);
    table.append(tr);
  }
  return table;
}

function coloured(text, value, title) {
  const td = cell("td", text, "value");
  td.style.background = colour(value);
  td.style.color = value > 0.6 ? "#111" : "#fff";
  td.dataset.value = value.toFixed(4);
  td.title = title;
  return td;
}

/** POST /inspect/logit-lens: row l = the residual stream after the embedding (0) or after block l - 1. */
export function drawLens(box, info, data) {
  const rows = data.layers.map((layer, l) => [
    l === 0 ? "embedding" : `after block ${l - 1}`,
    layer.map((preds, t) => coloured(preds[0].token, preds[0].prob,
      `after ${JSON.stringify(data.tokens[t])}, ${l === 0 ? "the embedding" : `block ${l - 1}`}: ${top(preds)}`)),
  ]);
  box.replaceChildren(grid(data.tokens, rows));
  info.textContent = `${data.model}: what each layer would predict next (top token, coloured by its probability;`
    + " hover a cell for the top-k). The last row is the model's own prediction.";
}

/** POST /inspect/ablate with heads "each": KL(base || head ablated) per layer and head; a click ablates it. */
export function drawEachHead(box, info, data, onPick) {
  const kl = data.each;
  const most = Math.max(...kl.flat(), 1e-9);
  const rows = kl.map((row, l) => [`layer ${l}`, row.map((v, h) => {
    const td = coloured(v.toFixed(3), v / most, `layer ${l} head ${h}: KL ${v.toFixed(4)} nats; click to ablate it`);
    td.classList.add("pick");
    td.dataset.layer = String(l);
    td.dataset.head = String(h);
    td.tabIndex = 0;
    td.addEventListener("click", () => onPick(l, h));
    td.addEventListener("keydown", (e) => { if (e.key === "Enter") onPick(l, h); });
    return td;
  })]);
  box.replaceChildren(grid(kl[0].map((_, h) => `head ${h}`), rows));
  info.textContent = `${data.model}: how much the next token's distribution changes (KL, nats) when each head`
    + ` alone is zeroed; without ablation: ${top(data.base)}. Click a head to ablate it.`;
}

/** POST /inspect/ablate with chosen heads: the next-token prediction with and without them. */
export function drawAblated(box, info, data, heads) {
  const list = (title, preds) => {
    const section = cell("div", "", "inside-list");
    section.append(cell("h3", title), ...preds.map((p) => cell("p", `${JSON.stringify(p.token)} ${pct(p.prob)}`)));
    return section;
  };
  box.replaceChildren(list("every head", data.base), list(`without ${JSON.stringify(heads)}`, data.ablated));
  info.textContent = `${data.model}: KL(base || ablated) = ${data.kl.toFixed(4)} nats.`;
}

/** POST /inspect/patch: logit(answer) - logit(foil) with the clean residual stream put in at each cell. */
export function drawPatch(box, info, data) {
  const span = data.clean - data.corrupt || 1;
  const rows = data.grid.map((row, l) => [`before block ${l}`, row.map((m, t) => coloured(m.toFixed(2),
    Math.min(1, Math.max(0, (m - data.corrupt) / span)),
    `clean residual before block ${l} at ${JSON.stringify(data.tokens[t])}: ${m.toFixed(3)}`))]);
  box.replaceChildren(grid(data.tokens, rows));
  info.textContent = `${data.model}: logit(answer) - logit(foil) is ${data.clean.toFixed(3)} clean and`
    + ` ${data.corrupt.toFixed(3)} corrupt; a bright cell restores the clean answer from that layer and position.`;
}
