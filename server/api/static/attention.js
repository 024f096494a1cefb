// The attention explorer: every head of a layer as a small heatmap (bertviz's model view, one layer),
// one head enlarged with its tokens (head view), and for softmax1 the share of each head's mass that
// goes to "nothing" (1 - the row sum, averaged over the query tokens).

const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

function rgb(w) {
  const x = Math.min(1, Math.max(0, w)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const t = x - i;
  return VIRIDIS[i].map((v, k) => Math.round(v + t * (VIRIDIS[i + 1][k] - v)));
}

export function colour(w) {
  const [r, g, b] = rgb(w);
  return `rgb(${r}, ${g}, ${b})`;
}

/** Mean mass on nothing per head: 0 for softmax (rows sum to 1), up to 1 for softmax1. */
export function nothingShare(rowSum) {
  return Math.max(0, 1 - rowSum);
}

function thumbnail(matrix) {
  const n = matrix.length;
  const canvas = document.createElement("canvas");
  canvas.width = n;
  canvas.height = n;
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(n, n);
  matrix.forEach((row, q) => row.forEach((w, k) => {
    const [r, g, b] = rgb(w);
    image.data.set([r, g, b, 255], (q * n + k) * 4);
  }));
  ctx.putImageData(image, 0, 0);
  return canvas;
}

/** The grid of heads of one layer; `onPick(head)` enlarges one. `data`: POST /attention for one layer. */
export function drawHeadGrid(container, data, selected, onPick) {
  const heads = data.attention[0][0];
  const softmax1 = data.attention_variant === "softmax1";
  const cells = heads.map((matrix, h) => {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "head-cell";
    button.dataset.head = String(h);
    button.setAttribute("aria-pressed", String(h === selected));
    const share = nothingShare(data.row_sums[0][h]);
    const caption = document.createElement("span");
    caption.textContent = softmax1 ? `head ${data.heads[h]} · ${(share * 100).toFixed(0)}% on nothing` : `head ${data.heads[h]}`;
    if (softmax1) button.dataset.nothing = share.toFixed(4);
    button.setAttribute("aria-label", `layer ${data.layers[0]}, ${caption.textContent}: enlarge`);
    button.append(thumbnail(matrix), caption);
    button.addEventListener("click", () => onPick(h));
    return button;
  });
  container.replaceChildren(...cells);
}

/** One head, with token labels; hovering a token or a cell highlights its row and column. */
export function drawHeatmap(grid, info, tokens, matrix) {
  grid.style.gridTemplateColumns = `max-content repeat(${tokens.length}, 1.6rem)`;
  const cells = [document.createElement("span")];
  const highlight = (q, k) => {
    for (const el of grid.querySelectorAll(".hl")) el.classList.remove("hl");
    for (const el of grid.querySelectorAll(`[data-q="${q}"], [data-k="${k}"]`)) el.classList.add("hl");
  };
  tokens.forEach((t, k) => {
    const key = document.createElement("span");
    key.className = "key";
    key.textContent = t;
    key.dataset.k = String(k);
    key.addEventListener("mouseenter", () => highlight(k, k));
    cells.push(key);
  });
  matrix.forEach((row, q) => {
    const label = document.createElement("span");
    label.className = "query";
    label.textContent = tokens[q];
    label.dataset.q = String(q);
    label.title = `attends to nothing: ${(nothingShare(row.reduce((a, b) => a + b, 0)) * 100).toFixed(1)}%`;
    label.addEventListener("mouseenter", () => highlight(q, q));
    cells.push(label);
    row.forEach((w, k) => {
      const cell = document.createElement("span");
      cell.className = "cell";
      cell.style.background = colour(w);
      cell.dataset.weight = w.toFixed(4);
      cell.dataset.q = String(q);
      cell.dataset.k = String(k);
      const text = `${JSON.stringify(tokens[q])} → ${JSON.stringify(tokens[k])}: ${w.toFixed(4)}`;
      cell.title = text;
      cell.addEventListener("mouseenter", () => {
        info.textContent = text;
        highlight(q, k);
      });
      cells.push(cell);
    });
  });
  grid.replaceChildren(...cells);
}
