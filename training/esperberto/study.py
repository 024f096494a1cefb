"""The "Attention Is Off By One" study on EsperBERTo: outliers and where attention goes.

- Excess kurtosis, E[(x-mu)^4] / E[(x-mu)^2]^2 - 3, of the attention-output parameters of every layer
  (dense weight and bias, LayerNorm weight and bias) and of its activations (dense, dropout,
  LayerNorm output), as mean +- std across layers: the original study's tables.
- Activations are captured with forward hooks over all held-out blocks and all their positions,
  accumulated as exact moments: the original measured only the first sample of each batch and
  averaged per-pass kurtosis values.
- What softmax1 is for: the attention mass each head puts on "nothing" (1 - row sum) and on the
  first token (<s>), per layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import RobertaForMaskedLM  # noqa: E402

PARAMS = {  # column name -> parameter of each layer's attention.output
    "Dense Weight": "dense.weight",
    "Dense Bias": "dense.bias",
    "LayerNorm Weight": "LayerNorm.weight",
    "LayerNorm Bias": "LayerNorm.bias",
}
ACTIVATIONS = {"Dense": "dense", "Dropout": "dropout", "Output (LayerNorm)": "LayerNorm"}


def excess_kurtosis(x: torch.Tensor) -> float:
    """Excess (Fisher) kurtosis of all elements, in float64; 0 for a normal distribution."""
    x = x.detach().double().flatten()
    d = x - x.mean()
    return ((d**4).mean() / (d**2).mean() ** 2 - 3.0).item()


@dataclass
class Moments:
    """Streaming power sums, so kurtosis covers every element of every batch exactly."""

    n: int = 0
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    sample: list[np.ndarray] = field(default_factory=list)  # a thinned copy for histograms

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().double().flatten()
        self.n += x.numel()
        for k in range(4):
            self.sums[k] += (x ** (k + 1)).sum().item()
        self.sample.append(x[:: max(1, x.numel() // 4096)].float().cpu().numpy())

    def kurtosis(self) -> float:
        m1, m2, m3, m4 = (s / self.n for s in self.sums)
        var = m2 - m1**2
        c4 = m4 - 4 * m1 * m3 + 6 * m1**2 * m2 - 3 * m1**4
        return c4 / var**2 - 3.0


def attention_output(model: RobertaForMaskedLM, layer: int) -> torch.nn.Module:
    return model.roberta.encoder.layer[layer].attention.output


def parameter_kurtosis(model: RobertaForMaskedLM) -> dict[str, list[float]]:
    """Per-layer excess kurtosis of each attention-output parameter."""
    n = model.config.num_hidden_layers
    return {
        col: [excess_kurtosis(attention_output(model, i).get_parameter(p)) for i in range(n)]
        for col, p in PARAMS.items()
    }


@torch.no_grad()
def activation_study(model: RobertaForMaskedLM, blocks: torch.Tensor, batch_size: int = 32) -> dict:
    """Kurtosis of attention-output activations and attention mass on nothing / the first token.

    Runs in eval mode, where dropout is the identity: its column equals the dense column (the
    original study's hooks ran during training, where dropout was active).
    """
    model.eval()
    impl = model.config._attn_implementation
    if model.config.attention_variant == "softmax0":
        model.set_attn_implementation("eager")  # the fused kernel returns no weights
    n_layer = model.config.num_hidden_layers
    moments = {col: [Moments() for _ in range(n_layer)] for col in ACTIVATIONS}
    hooks = []
    for i in range(n_layer):
        for col, name in ACTIVATIONS.items():
            module = getattr(attention_output(model, i), name)
            hooks.append(module.register_forward_hook(lambda _m, _in, out, acc=moments[col][i]: acc.add(out)))
    nothing = torch.zeros(n_layer, model.config.num_attention_heads, dtype=torch.float64)
    first = torch.zeros_like(nothing)
    rows = 0
    try:
        for start in range(0, len(blocks), batch_size):
            ids = blocks[start : start + batch_size].to(next(model.parameters()).device)
            out = model(input_ids=ids, output_attentions=True)
            for layer, w in enumerate(out.attentions):  # (B, H, T, S), no padding in blocks
                w = w.double()
                nothing[layer] += (1 - w.sum(-1)).sum(dim=(0, 2)).cpu()
                first[layer] += w[..., 0].sum(dim=(0, 2)).cpu()
            rows += ids.shape[0] * ids.shape[1]
    finally:
        for h in hooks:
            h.remove()
        model.set_attn_implementation(impl)
    return {
        "activations": {col: [m.kurtosis() for m in moments[col]] for col in ACTIVATIONS},
        "activation_elements": moments["Dense"][0].n,
        "nothing_mass": (nothing / rows).tolist(),  # [layer][head]
        "first_token_mass": (first / rows).tolist(),
        "_samples": {col: np.concatenate([s for m in moments[col] for s in m.sample]) for col in ACTIVATIONS},
    }


def mean_std(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {np.std(values):.3f}"


def write_report(results: dict[str, dict], out: Path, models: dict[str, RobertaForMaskedLM], note: str = "") -> str:
    """Markdown tables (the original study's layout) + JSON + histogram PNGs in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# EsperBERTo: softmax0 vs softmax1",
        "",
        note,
        "",
        "## Excess kurtosis of attention-output weights (mean ± std across layers)",
        "",
        "| Model | " + " | ".join(PARAMS) + " |",
        "|---" * (len(PARAMS) + 1) + "|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(mean_std(r["parameters"][c]) for c in PARAMS) + " |")
    lines += [
        "",
        "## Excess kurtosis of attention-output activations (mean ± std across layers)",
        "",
        "| Model | " + " | ".join(ACTIVATIONS) + " |",
        "|---" * (len(ACTIVATIONS) + 1) + "|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(mean_std(r["activations"][c]) for c in ACTIVATIONS) + " |")
    lines += [
        "",
        "## Where attention goes (mean over heads and query positions)",
        "",
        "| Model | layer | mass on nothing (1 − row sum) | mass on first token `<s>` | max head on nothing |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for layer, (nm, fm) in enumerate(zip(r["nothing_mass"], r["first_token_mass"], strict=True)):
            lines.append(f"| {name} | {layer} | {np.mean(nm):.3f} | {np.mean(fm):.3f} | {max(nm):.3f} |")
    columns = [*PARAMS, *ACTIVATIONS]
    header = "| Model | layer | " + " | ".join(columns) + " |"
    lines += ["", "## Per layer", "", header, "|---" * (2 + len(columns)) + "|"]
    for name, r in results.items():
        for layer in range(len(r["parameters"]["Dense Weight"])):
            vals = [r["parameters"][c][layer] for c in PARAMS] + [r["activations"][c][layer] for c in ACTIVATIONS]
            lines.append(f"| {name} | {layer} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    lines += [
        "",
        "![parameter histograms](kurtosis_parameters.png)",
        "",
        "![activation histograms](kurtosis_activations.png)",
        "",
    ]
    report = "\n".join(lines)
    (out / "kurtosis.md").write_text(report)
    (out / "kurtosis.json").write_text(
        json.dumps({n: {k: v for k, v in r.items() if not k.startswith("_")} for n, r in results.items()}, indent=2)
        + "\n"
    )
    plot_histograms(models, results, out)
    return report


def plot_histograms(models: dict[str, RobertaForMaskedLM], results: dict[str, dict], out: Path) -> None:
    """Overlaid per-variant histograms of the attention-output parameters and activations."""
    params = {
        f"attention.output.{p}": {
            name: torch.cat(
                [
                    attention_output(m, i).get_parameter(p).detach().flatten().float()
                    for i in range(m.config.num_hidden_layers)
                ]
            ).numpy()
            for name, m in models.items()
        }
        for p in PARAMS.values()
    }
    activations = {
        f"activations: {col}": {name: r["_samples"][col] for name, r in results.items()} for col in ACTIVATIONS
    }
    save_histogram_grid(params, out / "kurtosis_parameters.png", bins=80)
    save_histogram_grid(activations, out / "kurtosis_activations.png", bins=100)


def save_histogram_grid(panels: dict[str, dict[str, np.ndarray]], path: Path, bins: int) -> None:
    """One log-scale panel per title, one overlaid histogram per variant."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, series) in zip(axes, panels.items(), strict=True):
        for name, values in series.items():
            ax.hist(values, bins=bins, alpha=0.5, label=name, density=True)
        ax.set_title(title, fontsize=9)
        ax.set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
