"""The logit lens, head ablation and activation patching (models/inspect_hooks.py) against an independent
computation: transformers' own model with forward hooks, on tiny random GPT-2, GPT-NeoX and Llama
checkpoints and on our GPT (exported as GPT-NeoX)."""

import pytest
import torch

from model_store.export import export_hf
from model_store.store import load_gpt
from models import inspect_hooks
from tests.test_export import checkpoint
from tests.test_families import stored

IDS = [5, 17, 9, 33, 71, 12, 8, 40, 3]


def points(theirs):
    """transformers' layers, final norm, unembedding and each layer's head output projection."""
    if hasattr(theirs, "transformer"):  # GPT-2
        t = theirs.transformer
        return t.h, t.ln_f, theirs.get_output_embeddings(), [b.attn.c_proj for b in t.h]
    if hasattr(theirs, "gpt_neox"):
        n = theirs.gpt_neox
        return n.layers, n.final_layer_norm, theirs.get_output_embeddings(), [b.attention.dense for b in n.layers]
    m = theirs.model  # Llama
    return m.layers, m.norm, theirs.get_output_embeddings(), [b.self_attn.o_proj for b in m.layers]


def replacing_input(fn):
    """A with_kwargs pre-hook that hands a layer's hidden states to fn and passes on what it returns."""

    def hook(module, args, kwargs):
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}

    return hook


def reference_lens(theirs, ids):
    layers, norm, unembedding, _ = points(theirs)
    seen = []
    handles = [layer.register_forward_pre_hook(replacing_input(lambda h: seen.append(h[0]) or h), with_kwargs=True)
               for layer in layers]  # fmt: skip
    handles.append(norm.register_forward_pre_hook(lambda module, args: seen.append(args[0][0])))
    with torch.no_grad():
        theirs(torch.tensor([ids]))
        lens = torch.log_softmax(unembedding(norm(torch.stack(seen))), dim=-1)
    for h in handles:
        h.remove()
    return lens


def reference_ablated(theirs, ids, heads, n_head):
    *_, projections = points(theirs)
    width = projections[0].weight.shape[0 if hasattr(theirs, "transformer") else 1] // n_head

    def zero(layer):
        def hook(module, args):
            z = args[0].clone()
            for lay, head in heads:
                if lay == layer:
                    z[..., head * width : (head + 1) * width] = 0
            return (z,)

        return hook

    handles = [p.register_forward_pre_hook(zero(i)) for i, p in enumerate(projections)]
    with torch.no_grad():
        logits = theirs(torch.tensor([ids])).logits[0, -1]
    for h in handles:
        h.remove()
    return torch.log_softmax(logits, dim=-1)


def reference_patch(theirs, clean, corrupt, answer, foil):
    layers, *_ = points(theirs)
    clean_inputs = []
    handles = [layer.register_forward_pre_hook(replacing_input(lambda h: clean_inputs.append(h[0].clone()) or h),
                                               with_kwargs=True) for layer in layers]  # fmt: skip
    with torch.no_grad():
        theirs(torch.tensor([clean]))
    for h in handles:
        h.remove()
    grid = []
    for lay, layer in enumerate(layers):
        row = []
        for p in range(len(clean)):

            def put(h, lay=lay, p=p):
                h = h.clone()
                h[0, p] = clean_inputs[lay][p]
                return h

            handle = layer.register_forward_pre_hook(replacing_input(put), with_kwargs=True)
            with torch.no_grad():
                logits = theirs(torch.tensor([corrupt])).logits[0, -1]
            handle.remove()
            row.append(float(logits[answer] - logits[foil]))
        grid.append(row)
    return grid


@pytest.fixture
def ours_and_theirs(tmp_path, tiny_tokenizer):
    """Our decoder's copy (float32) and transformers' model of the same checkpoint, by family."""

    def build(family):
        if family == "ours":  # exported as GPT-NeoX: transformers' code, not ours, computes the reference
            from transformers import AutoModelForCausalLM

            folder = checkpoint(tmp_path, tiny_tokenizer)
            export_hf(folder, tmp_path / "hf")
            return load_gpt(folder)[0], AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        theirs, folder = stored(tmp_path, family)
        return load_gpt(folder)[0], theirs

    return build


FAMILIES = ["ours", "gpt2", "gpt-neox", "llama"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logit_lens_equals_transformers_hooks(ours_and_theirs, family):
    ours, theirs = ours_and_theirs(family)
    with torch.no_grad():
        lens = inspect_hooks.logit_lens(ours, torch.tensor([IDS]))
        real = torch.log_softmax(ours(torch.tensor([IDS])).logits[0], dim=-1)
    assert lens.shape == (ours.config.n_layer + 1, len(IDS), ours.config.vocab_size)
    torch.testing.assert_close(lens, reference_lens(theirs, IDS), atol=1e-4, rtol=0)
    torch.testing.assert_close(lens[-1], real, atol=1e-5, rtol=0)  # the last layer is the model's prediction
    assert not torch.allclose(lens[0], lens[-1], atol=1e-2)  # the layers do change the prediction


@pytest.mark.parametrize("family", FAMILIES)
def test_head_ablation_equals_transformers_hooks(ours_and_theirs, family):
    ours, theirs = ours_and_theirs(family)
    L, (H, _) = ours.config.n_layer, inspect_hooks.heads_z(ours)
    ablations = [[], [(0, 1)], [(1, 0), (1, H - 1)], [(L - 1, 2)]]
    keep = torch.ones(len(ablations), L, H)
    for row, heads in enumerate(ablations):
        for lay, head in heads:
            keep[row, lay, head] = 0
    with torch.no_grad():
        got = inspect_hooks.ablated(ours, torch.tensor([IDS]), keep)
    for row, heads in enumerate(ablations):
        torch.testing.assert_close(got[row].float(), reference_ablated(theirs, IDS, heads, H), atol=1e-4, rtol=0)
    assert not torch.allclose(got[0], got[1], atol=1e-4)  # ablating a head changes the prediction


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_patching_equals_transformers_hooks(ours_and_theirs, family):
    ours, theirs = ours_and_theirs(family)
    clean, corrupt, answer, foil = IDS, [*IDS[:3], 99, *IDS[4:]], 7, 11
    x = torch.tensor([corrupt])
    with torch.no_grad():
        streams = inspect_hooks.residual_streams(ours, torch.tensor([clean]))
        run = inspect_hooks.corrupt_run(ours, x)
        grid = []
        for layer in range(ours.config.n_layer):  # in two slices: the second starts past the first positions
            row = []
            for part in (list(range(4)), list(range(4, len(IDS)))):
                logits = inspect_hooks.patched(ours, x, layer, part, streams[layer], run)
                row += (logits[:, answer] - logits[:, foil]).tolist()
            grid.append(row)
    expected = reference_patch(theirs, clean, corrupt, answer, foil)
    torch.testing.assert_close(torch.tensor(grid), torch.tensor(expected), atol=1e-4, rtol=0)
    assert grid[0][3] != pytest.approx(grid[0][2], abs=1e-4)  # patching the changed position matters
