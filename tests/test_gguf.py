"""GGUF both ways: `tinyserve export MODEL OUT --format gguf` writes what transformers' own GGUF reader
loads as the same model (logits within 1e-4 in float32), and `tinyserve store add FILE.gguf NAME` reads a
file back into the model it was made from; what llama.cpp or our decoder cannot express is refused by
name. (llama-server's greedy tokens on these files: bench/check_gguf.py, run by hand.)"""

import json

import numpy as np
import pytest
import torch

from model_store.gguf_files import GGUFError, export_gguf, gguf_architecture
from model_store.ingest import add_checkpoint
from model_store.store import STORE_ROOT, CheckpointError, load_gpt
from models.quantize import GroupQuantLinear
from models.tokenizer import eos_id
from server.cli import main as tinyserve
from tests.test_export import checkpoint

TEXT = "The castle was built in 1066 , and its walls still stand ."


def family(folder, kind: str, tokenizer, bos: bool = False, **overrides):
    """A small random transformers model of `kind` saved with the byte-level BPE `tokenizer`."""
    import transformers
    from tokenizers import processors

    vocab, eos = tokenizer.get_vocab_size(), eos_id(tokenizer)
    common = dict(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos)
    if kind != "gpt2":
        common.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=128)  # fmt: skip
    else:
        common.update(n_embd=64, n_layer=2, n_head=4)  # GPT-2's 1,024 positions: transformers' reader assumes them
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(kind, **common, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # spread the logits, and biases and norms that are not zeros and ones
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(folder)
    if bos:  # starts every text with <|endoftext|>, as a Llama tokenizer starts with <s>
        tokenizer = type(tokenizer).from_str(tokenizer.to_str())
        token = tokenizer.id_to_token(eos)
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{token} $A", special_tokens=[(token, eos)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=tokenizer.id_to_token(eos))
    fast.save_pretrained(folder, **({"bos_token": tokenizer.id_to_token(eos)} if bos else {}))
    if bos:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": tokenizer.id_to_token(eos)}))
    return model


FAMILIES = {  # name -> (transformers model type, config overrides, llama.cpp architecture)
    "llama": ("llama", dict(num_key_value_heads=2), "llama"),
    "llama-biases": ("llama", dict(attention_bias=True, tie_word_embeddings=True), "llama"),
    "mistral": ("mistral", dict(num_key_value_heads=1, sliding_window=None), "llama"),
    "qwen2": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True), "qwen2"),
    "qwen3": ("qwen3", dict(num_key_value_heads=2), "qwen3"),
    "qwen3-wide-heads": ("qwen3", dict(num_key_value_heads=2, head_dim=32), "qwen3"),
    "gpt2": ("gpt2", {}, "gpt2"),
    "gpt-neox": ("gpt_neox", dict(rotary_pct=0.5), "gptneox"),
    "llama3-rope": ("llama", dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                    low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)), "llama"),
}  # fmt: skip
# transformers reads these files; it drops a Llama's biases, takes a model named *mistral* for its own mistral
# architecture, reads no head width (key_length), no rope_freqs and no gptneox
READ_BY_TRANSFORMERS = ["llama", "qwen2", "qwen3", "gpt2"]


def stored_family(tmp_path, name, tokenizer, bos=False):
    kind, overrides, _ = FAMILIES[name]
    model = family(tmp_path / "src" / name, kind, tokenizer, bos, **overrides)
    return model, add_checkpoint(tmp_path / "src" / name, name, tmp_path / "store")


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("name", READ_BY_TRANSFORMERS)
def test_an_exported_family_is_the_same_model_in_transformers_gguf_reader(tmp_path, tiny_tokenizer, name):
    from transformers import AutoModelForCausalLM

    theirs, folder = stored_family(tmp_path, name, tiny_tokenizer)
    out = export_gguf(folder, tmp_path / f"{name}.gguf")
    read = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32).eval()
    ids = tiny_tokenizer.encode(TEXT).ids
    want = logits(theirs, ids)
    assert want.abs().max() > 1
    torch.testing.assert_close(logits(read, ids), want, rtol=0, atol=1e-4)
    assert gguf_architecture(load_gpt(folder)[0].config) == FAMILIES[name][2]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_gguf_file_enters_the_store_as_the_model_it_was_made_from(tmp_path, tiny_tokenizer, name):
    theirs, folder = stored_family(tmp_path, name, tiny_tokenizer)
    out = export_gguf(folder, tmp_path / f"{name}.gguf")
    back, tokenizer = load_gpt(add_checkpoint(out, f"{name}-gguf", tmp_path / "store"))
    ids = tiny_tokenizer.encode(TEXT).ids
    torch.testing.assert_close(logits(back, ids), logits(theirs, ids), rtol=0, atol=1e-4)
    assert tokenizer.encode(TEXT).ids == ids and tokenizer.decode(ids) == TEXT


def test_our_gpt_leaves_and_comes_back_through_gguf(tmp_path, tiny_tokenizer):
    """Our GPT is written as llama.cpp's gptneox: embedding scaled, head untied, rotary pairs reordered."""
    folder = checkpoint(tmp_path, tiny_tokenizer)
    ours, _ = load_gpt(folder)
    out = export_gguf(folder, tmp_path / "tiny.gguf")
    back, _ = load_gpt(add_checkpoint(out, "tiny-gguf", tmp_path / "store"))
    assert gguf_architecture(ours.config) == "gptneox" and back.config.rope_pairs == "half"
    ids = tiny_tokenizer.encode(TEXT).ids
    torch.testing.assert_close(logits(back, ids), logits(ours, ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "overrides, arch",
    [(dict(norm="rmsnorm", mlp="swiglu", qk_norm=True, bias=False), "qwen3"),
     (dict(norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False), "llama")],
    ids=["qk-norm", "gqa"],
)  # fmt: skip
def test_our_decoders_options_leave_as_the_llama_cpp_architecture_that_computes_them(
    tmp_path, tiny_tokenizer, overrides, arch
):
    """Interleaved rotary pairs written as qwen3's halves reorder the QK-norm weights with the rows."""
    from model_store.store import write_checkpoint
    from tests.conftest import tiny_gpt

    ours = tiny_gpt(seed=5, vocab_size=tiny_tokenizer.get_vocab_size(), eos_token_id=eos_id(tiny_tokenizer),
                    context_length=64, positions="rope", **overrides)  # fmt: skip
    with torch.no_grad():  # norms that are not all ones, so a misplaced channel shows
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.3) if p.dim() == 1 else p.mul_(3.0)
    write_checkpoint(tmp_path / "ours", ours, tiny_tokenizer, card="# ours\n", metrics={}, dtype=torch.float32)
    assert gguf_architecture(ours.config) == arch
    back, _ = load_gpt(add_checkpoint(export_gguf(tmp_path / "ours", tmp_path / "o.gguf"), "o", tmp_path / "store"))
    ids = tiny_tokenizer.encode(TEXT).ids
    torch.testing.assert_close(logits(back, ids), logits(ours, ids), rtol=0, atol=1e-4)


@pytest.mark.slow
def test_the_shipped_gpt_comes_back_from_gguf_with_its_greedy_tokens(tmp_path):
    from models.sampling import SamplingParams

    ours, tokenizer = load_gpt(STORE_ROOT / "gpt-wikitext2")
    out = export_gguf(STORE_ROOT / "gpt-wikitext2", tmp_path / "gpt.gguf")
    back, _ = load_gpt(add_checkpoint(out, "gpt-gguf", tmp_path / "store"))
    x = torch.tensor([tokenizer.encode(TEXT).ids])
    params = SamplingParams(max_new_tokens=32, min_new_tokens=32, temperature=0)
    with torch.no_grad():
        assert back.generate(x, params).tolist() == ours.generate(x, params).tolist()


def test_q8_0_blocks_are_read_back_as_written(tmp_path, tiny_tokenizer):
    import gguf

    theirs, folder = stored_family(tmp_path, "llama", tiny_tokenizer)
    out = export_gguf(folder, tmp_path / "q.gguf", "q8_0")
    back, _ = load_gpt(add_checkpoint(out, "q", tmp_path / "store"))
    q8 = gguf.GGMLQuantizationType.Q8_0
    down = theirs.model.layers[1].mlp.down_proj.weight.detach().numpy()  # (64, 128): 4 blocks a row
    want = gguf.quants.dequantize(gguf.quants.quantize(down, q8), q8)
    assert isinstance(back.blocks[1].mlp.proj, GroupQuantLinear)  # the file's blocks, not a float copy
    assert np.array_equal(back.blocks[1].mlp.proj.dequantized(torch.float32).numpy(), want)
    assert not np.array_equal(want, down)  # it was quantized
    ids = tiny_tokenizer.encode(TEXT).ids
    torch.testing.assert_close(logits(back, ids), logits(theirs, ids), rtol=0, atol=0.1 * logits(theirs, ids).std())


def test_a_tokenizer_that_starts_with_bos_still_does_after_gguf(tmp_path, tiny_tokenizer):
    from server.execution.runner import TextCodec

    _, folder = stored_family(tmp_path, "llama", tiny_tokenizer, bos=True)
    out = export_gguf(folder, tmp_path / "bos.gguf")
    _, tokenizer = load_gpt(add_checkpoint(out, "bos", tmp_path / "store"))
    eos = eos_id(tiny_tokenizer)
    assert TextCodec(tokenizer).prefix == [eos]
    assert tokenizer.encode(TEXT).ids == [eos, *tiny_tokenizer.encode(TEXT).ids]


def test_what_gguf_cannot_express_is_refused_by_name(tmp_path, tiny_tokenizer):
    from tests.test_families import save_family

    with pytest.raises(GGUFError, match="softmax='softmax1'"):
        export_gguf(checkpoint(tmp_path, tiny_tokenizer, softmax="softmax1"), tmp_path / "x.gguf")
    with pytest.raises(GGUFError, match="positions='sinusoidal'|positions=sinusoidal"):
        export_gguf(checkpoint(tmp_path, tiny_tokenizer, name="sin", positions="sinusoidal"), tmp_path / "x.gguf")
    save_family(tmp_path / "word", "llama")  # a word-level tokenizer: not byte-level BPE
    with pytest.raises(GGUFError, match="byte-level BPE"):
        export_gguf(add_checkpoint(tmp_path / "word", "word", tmp_path / "store"), tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob("*.part"))


def write_gguf(path, arch: str, tensor_type: str = "F32") -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    qtype = getattr(gguf.GGMLQuantizationType, tensor_type)
    blocks = np.zeros(gguf.quants.quant_shape_to_byte_shape((4, 256), qtype), dtype=np.uint8)  # any type's bytes
    writer.add_tensor("token_embd.weight", blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_we_cannot_serve_is_refused_by_name(tmp_path):
    store = tmp_path / "store"
    for name, arch, tensor_type, named in (
        ("falcon.gguf", "falcon", "F32", "architecture 'falcon'"),
        ("iq2.gguf", "llama", "IQ2_XS", r"tensor types \['IQ2_XS'\] are not read"),
    ):
        write_gguf(tmp_path / name, arch, tensor_type)
        with pytest.raises(CheckpointError, match=named):
            add_checkpoint(tmp_path / name, "x", store)
    (tmp_path / "fake.gguf").write_text("not a model")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        add_checkpoint(tmp_path / "fake.gguf", "x", store)
    assert not (store / "x").exists()


def test_the_command_line_writes_and_reads_gguf(tmp_path, tiny_tokenizer, monkeypatch, capsys):
    checkpoint(tmp_path / "store", tiny_tokenizer, name="tiny")
    monkeypatch.setenv("TINYSERVE_STORE", str(tmp_path / "store"))
    tinyserve(["export", "tiny", str(tmp_path / "tiny.gguf"), "--format", "gguf", "--dtype", "bfloat16"])
    tinyserve(["store", "add", str(tmp_path / "tiny.gguf"), "tiny-bf16"])
    assert json.loads((tmp_path / "store" / "tiny-bf16" / "config.json").read_text())["rope_pairs"] == "half"
    with pytest.raises(SystemExit) as e:
        tinyserve(["export", "tiny", str(tmp_path / "hf"), "--dtype", "q8_0"])
    assert e.value.code == 2 and "q8_0 is for --format gguf" in capsys.readouterr().err


def sentencepiece_vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """A Llama-2-style vocabulary of `size` pieces, as llama.cpp writes one: <unk>, <s>, </s>, the 256 byte
    pieces, then pieces of words (with their scores and token types)."""
    words = "the castle was built in and its walls still stand one zero six , . a b c d e f g h i j k l m n o p r s t u"
    pieces = ["▁", *(c for c in "abcdefghijklmnoprstuw0123456789,."), *(f"▁{w}" for w in words.split())]
    pieces += ["st", "an", "in", "al", "ll", "ui", "lt", "wa", "ca", "le", "th", "he", "ts", "nd", "il", "ti"]
    pieces = list(dict.fromkeys(pieces))
    pieces += [f"▁x{i}" for i in range(size - 259 - len(pieces))]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]  # unknown, control, byte, normal
    return tokens, scores, types


def with_sentencepiece_tokenizer(src, out, size: int) -> None:
    """The GGUF file `src` again, its tokenizer replaced by a SentencePiece one of `size` pieces."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if not name.startswith(("GGUF.", "general.architecture", "tokenizer.")):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub)
    tokens, scores, types = sentencepiece_vocabulary(size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def sentencepiece_file(tmp_path, tokenizer):
    """tmp_path/sp.gguf: the tests' tiny Llama with a Llama-2-style vocabulary of 400 pieces; returns the model."""
    model, folder = stored_family(tmp_path, "llama", tokenizer)
    with_sentencepiece_tokenizer(export_gguf(folder, tmp_path / "bpe.gguf"), tmp_path / "sp.gguf", 400)
    return model


def test_a_sentencepiece_gguf_enters_the_store_encoding_as_transformers_reads_it(tmp_path, tiny_tokenizer):
    """A Llama-2-style file (tokenizer.ggml.model 'llama': SentencePiece BPE with byte fallback, BOS first):
    the store's tokenizer, as the server encodes a text, gives the ids transformers gives reading the same
    file, BOS included, and decodes them back to the text; the weights are the file's."""
    from transformers import AutoTokenizer

    from server.execution.runner import TextCodec

    theirs = sentencepiece_file(tmp_path, tiny_tokenizer)
    back, tokenizer = load_gpt(add_checkpoint(tmp_path / "sp.gguf", "sp", tmp_path / "store"))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
    codec = TextCodec(tokenizer)
    for text in (TEXT, "walls stand", "Ünïcode ☃ falls back to bytes"):
        ids = codec.encode(text)
        assert ids == reference(text)["input_ids"] and ids[0] == 1
        assert codec.decode(ids) == text
    assert len(codec.encode("the castle")) < len("the castle")  # pieces, not one byte a token
    ids = tiny_tokenizer.encode(TEXT).ids
    torch.testing.assert_close(logits(back, ids), logits(theirs, ids), rtol=0, atol=1e-4)


def test_a_sentencepiece_tokenizer_leaves_through_gguf_and_comes_back(tmp_path, tiny_tokenizer):
    """A store folder with a SentencePiece BPE tokenizer (here: one read from a Llama-2-style file) is exported
    as llama.cpp's 'llama' vocabulary, each piece scored by its merge's rank: transformers reads the file's
    tokenizer as ours, and the store reads it back with the same ids, BOS first."""
    from transformers import AutoTokenizer

    from server.execution.runner import TextCodec

    sentencepiece_file(tmp_path, tiny_tokenizer)
    first = add_checkpoint(tmp_path / "sp.gguf", "sp", tmp_path / "store")
    out = export_gguf(first, tmp_path / "again.gguf")
    _, tokenizer = load_gpt(add_checkpoint(out, "again", tmp_path / "store"))
    ours, back = TextCodec(load_gpt(first)[1]), TextCodec(tokenizer)
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file="again.gguf")
    for text in (TEXT, "walls stand", "the castle still stands", "Ünïcode ☃"):
        ids = ours.encode(text)
        assert back.encode(text) == ids == reference(text)["input_ids"] and ids[0] == 1
        assert back.decode(ids) == text
