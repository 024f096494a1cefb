"""Transformers checkpoints of every mapped family on our decoder: logits within 1e-4 of transformers'
in float32 and its greedy tokens (solo and batched), prompts encoded as the checkpoint's tokenizer does,
and what the decoder cannot compute exactly refused by name."""

import json

import pytest
import torch

from model_store.ingest import add_checkpoint
from model_store.store import CheckpointError, load_gpt
from models.sampling import SamplingParams
from server.engine.core import GenerationEngine
from server.execution.decoder.runner import GPTRunner
from server.execution.runner import TextCodec

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, bos_token_id=1, eos_token_id=2)  # fmt: skip


def families() -> dict:
    import transformers as T

    llama3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=16)  # fmt: skip
    gemma3 = dict(COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                  sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  rope_parameters={"full_attention": dict(rope_type="linear", rope_theta=1e5, factor=2.0),
                                   "sliding_attention": dict(rope_type="default", rope_theta=1e4)})  # fmt: skip
    gpt2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=2, eos_token_id=2)
    return {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(COMMON, num_key_value_heads=2)),
        "llama-biases-tied": (T.LlamaConfig, T.LlamaForCausalLM, dict(COMMON, num_key_value_heads=1,
                              attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),  # fmt: skip
        "llama3-rope": (T.LlamaConfig, T.LlamaForCausalLM, dict(COMMON, num_key_value_heads=2, rope_parameters=llama3)),
        "llama-linear-rope": (T.LlamaConfig, T.LlamaForCausalLM,
                              dict(COMMON, rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=4.0))),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(COMMON, num_key_value_heads=2, sliding_window=None)),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(COMMON, num_key_value_heads=2, tie_word_embeddings=True)),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(COMMON, num_key_value_heads=2, head_dim=16)),
        "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, gemma3),
        "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, gpt2),
        "gpt-neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict(COMMON, rotary_pct=0.5)),
        "gpt-neox-sequential": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM,
                                dict(COMMON, rotary_pct=0.25, use_parallel_residual=False, hidden_act="gelu_fast")),
    }  # fmt: skip


def byte_tokenizer(bos: bool):
    """A word-level tokenizer over VOCAB ids; with bos, its post-processor starts a text with <s> (as Llama's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    return tok


def stored(tmp_path, name: str, bos: bool = False):
    """The family's tiny model (transformers') and its folder in a scratch store, added as a user would."""
    theirs = save_family(tmp_path / "src" / name, name, bos)
    return theirs, add_checkpoint(tmp_path / "src" / name, name, tmp_path / "store")


def save_family(folder, name: str, bos: bool = False):
    from transformers import PreTrainedTokenizerFast

    config_class, model_class, kwargs = families()[name]
    torch.manual_seed(0)
    model = model_class(config_class(**kwargs)).eval()
    with torch.no_grad():  # transformers' init gives near-uniform logits: spread them so greedy tokens are clear
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(bos), bos_token="<s>", eos_token="</s>").save_pretrained(
        folder
    )
    return model


@pytest.mark.parametrize("name", list(families()))
def test_a_mapped_family_gives_transformers_logits(tmp_path, name):
    theirs, folder = stored(tmp_path, name)
    ours, _ = load_gpt(folder)
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(ids).logits
        got = ours(ids).logits
        cached = ours(ids, input_pos=torch.arange(40).expand(2, 40), cache=ours.new_cache(2)).logits
    assert want.abs().max() > 1  # not a flat distribution
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    torch.testing.assert_close(cached, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "gpt2", "gpt-neox"])
def test_a_mapped_family_serves_generates_greedy_tokens_solo_and_batched(tmp_path, name):
    theirs, folder = stored(tmp_path, name)
    model, tokenizer = load_gpt(folder)
    engine = GenerationEngine(GPTRunner(model, tokenizer, 4), max_batch_size=4, max_queue=8)
    prompts = [[5, 9, 17, 33], [40, 41, 7, 8, 99, 12, 3, 64, 21]]
    params = SamplingParams(max_new_tokens=20, temperature=0, eos_bias=float("-inf"))
    want = [
        theirs.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False)[0, len(p) :].tolist()
        for p in prompts
    ]
    engine.start()
    try:
        solo = [[e.id for e in engine.generate(p, params)[0]] for p in prompts]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            batched = list(pool.map(lambda p: [e.id for e in engine.generate(p, params)[0]], prompts))
    finally:
        engine.stop()
    assert solo == want and batched == want


def test_prompts_are_encoded_as_the_checkpoints_tokenizer_does(tmp_path):
    from transformers import PreTrainedTokenizerFast

    bos, plain = stored(tmp_path, "llama", bos=True)[1], stored(tmp_path, "qwen2")[1]
    for folder, prefix in ((bos, [1]), (plain, [])):
        _, tokenizer = load_gpt(folder)
        codec = TextCodec(tokenizer)
        assert codec.prefix == prefix
        assert codec.encode("w5 w9 w17") == PreTrainedTokenizerFast.from_pretrained(folder)("w5 w9 w17")["input_ids"]


def test_what_the_decoder_cannot_compute_exactly_is_refused_by_name(tmp_path):
    save_family(tmp_path / "src", "mistral")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    for change, named in (
        ({"sliding_window": 16}, "sliding_window 16"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ):
        (tmp_path / "src" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CheckpointError, match=named):
            add_checkpoint(tmp_path / "src", "x", tmp_path / "store")
        assert not (tmp_path / "store" / "x").exists()


def test_a_long_context_is_capped_for_the_static_cache(tmp_path):
    folder = stored(tmp_path, "llama")[1]
    model, _ = load_gpt(folder, max_context=32)
    assert model.config.context_length == 32 and load_gpt(folder)[0].config.context_length == 64


def test_the_kv_pool_fits_its_budget_and_a_request_may_use_the_whole_context(tmp_path):
    """kv_cache_mb sizes one pool of blocks that every request draws on (no context split over slots): a request
    may hold up to the model's context, or the pool's positions where they are fewer."""
    from server.execution.decoder.runner import GPTRunner, pool_blocks
    from server.execution.loader import load_runner

    folder = stored(tmp_path, "llama")[1]
    model, _ = load_gpt(folder)
    per_block = 16 * 2 * 2 * (2 * 8) * 4  # positions x layers x (keys, values) x (2 KV heads x 8 channels) x float32
    assert pool_blocks(model, 4, 10 * per_block) == 10 and pool_blocks(model, 4, None) == 4 * 4 + 1
    with pytest.raises(ValueError, match="kv_cache_mb: a pool of 2 blocks"):
        pool_blocks(model, 4, per_block)
    runner = load_runner("decoder", folder, torch.device("cpu"), torch.float32, 64, kv_cache_mb=1)
    assert runner.facts.context_length == 64 and runner.facts.kv_cache_bytes <= 2**20
    assert runner.facts.kv_blocks == 2**20 // per_block
    engine = GenerationEngine(runner, max_batch_size=64)
    engine.submit(list(range(3, 60)), SamplingParams(), lambda e: None)  # 57 of the 64 positions: one request may
    with pytest.raises(ValueError, match="context is 64"):
        engine.submit(list(range(3, 67)), SamplingParams(), lambda e: None)
    small = GPTRunner(model, None, 4, blocks=3)  # two usable blocks: 32 positions, fewer than the context
    assert small.facts.context_length == 32


def test_derived_options_are_derived_again_when_a_config_changes():
    """Training builds variants with from_dict({**config.to_dict(), ...}): a head count, width or bias
    left to its default follows the change instead of keeping the old value."""
    from dataclasses import replace

    from models.config import GPTConfig

    base = GPTConfig(n_head=8, d_model=64)
    dual = GPTConfig.from_dict({**base.to_dict(), "n_head": 2, "n_relational_head": 2})
    assert dual.kv_heads == 2 and dual.head_dim == 16
    wider = replace(base, d_model=128, bias=False)
    assert wider.head_dim == 16 and not wider.has_bias("qkv") and wider.rotated_channels == 16


def test_a_mapped_family_is_not_exported_as_our_gpt(tmp_path):
    from model_store.export import ExportError, export_hf

    folder = stored(tmp_path, "llama")[1]
    with pytest.raises(ExportError, match="norm='rmsnorm'"):
        export_hf(folder, tmp_path / "out")


def test_the_transformers_runner_starts_prompts_as_its_tokenizer_does(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from server.execution.runner import TextCodec

    save_family(tmp_path, "llama", bos=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    codec = TextCodec(tokenizer.backend_tokenizer)  # the one codec, over transformers' own tokenizer
    assert codec.prefix == [1] and codec.encode("w5 w9") == tokenizer("w5 w9")["input_ids"]
    assert codec.decode(tokenizer("w5 w9")["input_ids"]) == tokenizer.decode(
        tokenizer("w5 w9")["input_ids"], skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


@pytest.mark.parametrize("name", list(families()))
def test_a_checkpoint_read_into_its_huge_page_block_is_the_same_model(tmp_path, name):
    """Read straight into the block it is served from (model_store/placement.py): the same weights, each a storage of
    its own; a family's renamed and joined tensors (q/k/v, gate/up: a span of the block, no copy) all in the block."""
    from server.execution.huge_pages import HugePageBlock, on_huge_pages

    _, folder = stored(tmp_path, name)  # float32 files: cast to bf16 on the way in
    plain, _ = load_gpt(folder, dtype=torch.bfloat16)
    block = HugePageBlock()
    placed, _ = load_gpt(folder, dtype=torch.bfloat16, arena=block)
    want, got = dict(plain.named_parameters()), dict(placed.named_parameters())
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == len(got)
    held = {k for k, t in got.items() if block.holds(t)}
    if name.startswith(("llama", "mistral", "qwen")):
        assert held == set(got)
    else:  # what a mapping computes (a transpose, a norm's +1) is not read into the block
        assert held < set(got)
    moved = on_huge_pages(placed, block)  # the rest, into a block of their own
    assert moved < sum(t.nbytes for t in got.values()) and all(torch.equal(want[k], got[k]) for k in want)
