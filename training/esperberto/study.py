"""The "Attention Is Off By One" study on EsperBERTo: outliers and where attention goes.

- Excess kurtosis, E[(x-mu)^4] / E[(x-mu)^2]^2 - 3, of the attention-output parameters of every layer
  (dense weight and bias, LayerNorm weight and bias) and of its activations (dense, dropout,
  LayerNorm output), as mean +- std across layers: the original study's tables. In ModernBERT
  (pre-LN) the same roles are the attention's output projection `attn.Wo`, its `attn.out_drop`, and
  the LayerNorm that next reads the residual stream, `mlp_norm` (MODULES).
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

from models.esperberto.model import MaskedLM  # noqa: E402
from training.report import plot_mlm_curves  # noqa: E402

# role -> module of layer {i}, per architecture: the original study's attention.output submodules
MODULES = {
    "RobertaForMaskedLM": {
        "dense": "roberta.encoder.layer.{i}.attention.output.dense",
        "dropout": "roberta.encoder.layer.{i}.attention.output.dropout",
        "LayerNorm": "roberta.encoder.layer.{i}.attention.output.LayerNorm",
    },
    "ModernBertForMaskedLM": {
        "dense": "model.layers.{i}.attn.Wo",
        "dropout": "model.layers.{i}.attn.out_drop",
        "LayerNorm": "model.layers.{i}.mlp_norm",
    },
}
PARAMS = {  # column name -> (role, parameter)
    "Dense Weight": ("dense", "weight"),
    "Dense Bias": ("dense", "bias"),
    "LayerNorm Weight": ("LayerNorm", "weight"),
    "LayerNorm Bias": ("LayerNorm", "bias"),
}
ORIGINAL_LOSS = {"softmax0": 4.46, "softmax1": 4.44}  # shared/reference/README.md, section 1
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


def module_name(model: MaskedLM, role: str, layer: int) -> str:
    return MODULES[type(model).__name__][role].format(i=layer)


def study_module(model: MaskedLM, role: str, layer: int) -> torch.nn.Module:
    """The module playing `role` (dense, dropout, LayerNorm) after layer `layer`'s attention."""
    return model.get_submodule(module_name(model, role, layer))


def study_parameter(model: MaskedLM, column: str, layer: int) -> torch.Tensor:
    role, name = PARAMS[column]
    return study_module(model, role, layer).get_parameter(name)


def parameter_kurtosis(model: MaskedLM) -> dict[str, list[float]]:
    """Per-layer excess kurtosis of each attention-output parameter."""
    n = model.config.num_hidden_layers
    return {col: [excess_kurtosis(study_parameter(model, col, i)) for i in range(n)] for col in PARAMS}


@torch.no_grad()
def activation_study(model: MaskedLM, blocks: torch.Tensor, batch_size: int = 32) -> dict:
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
            module = study_module(model, name, i)
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


def write_report(results: dict[str, dict], out: Path, models: dict[str, MaskedLM], note: str = "") -> str:
    """Markdown tables (the original study's layout) + JSON + histogram PNGs in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# EsperBERTo: softmax0 vs softmax1",
        "",
        note,
        "",
        "Modules measured (layer i): "
        + "; ".join(
            f"{role} = `{MODULES[arch][role]}`"
            for arch in sorted({type(m).__name__ for m in models.values()})
            for role in MODULES[arch]
        ),
        "",
        "## Training loss",
        "",
        "Ours: held-out MLM loss of the checkpoint (its metrics.json: the whole held-out split, 15 % masks).",
        "The original's: its final training loss (6 × 768 RoBERTa, one epoch of 473 MB, one A10G GPU).",
        "",
        "| Model | held-out MLM loss | top-1 | top-5 | order gap | the original study's loss |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        h = r.get("heldout") or {}
        figures = [
            f"{h[k]:.3f}" if k in h else "—" for k in ("mlm_loss", "top1_accuracy", "top5_accuracy", "order_gap")
        ]
        lines.append(f"| {name} | " + " | ".join(figures) + f" | {ORIGINAL_LOSS.get(name, '—')} |")
    lines += [
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
    logs = {name: r["_log"] for name, r in results.items() if r.get("_log")}
    if logs:
        plot_mlm_curves(logs, out / "heldout_curves.png")
        lines += ["", "## Training curves (fixed held-out slice)", "", "![held-out curves](heldout_curves.png)"]
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


def plot_histograms(models: dict[str, MaskedLM], results: dict[str, dict], out: Path) -> None:
    """Overlaid per-variant histograms of the attention-output parameters and activations."""
    params = {
        f"attention output: {col}": {
            name: torch.cat(
                [study_parameter(m, col, i).detach().flatten().float() for i in range(m.config.num_hidden_layers)]
            ).numpy()
            for name, m in models.items()
        }
        for col in PARAMS
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
