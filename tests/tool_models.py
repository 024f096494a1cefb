"""Tiny random Llama checkpoints that call tools, made on the fly: a byte-level vocabulary (so any JSON can be
written) and chat templates written here in two call formats, Hermes / Qwen `<tool_call>` blocks and Llama 3's
JSON, plus one whose template renders no tools."""

from pathlib import Path

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_TEMPLATE = """<s>{%- if tools %}<|start_header_id|>system<|end_header_id|>

Given the following functions, respond with a JSON for a function call, in the format {"name": function name, \
"parameters": dictionary of argument name and its value}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": \
{{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

PLAIN_TEMPLATE = """{% for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

SPECIAL = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|python_tag|>"]  # fmt: skip
MARKERS = ["<tool_call>", "</tool_call>"]  # added tokens, not special ones (as Qwen's tokenizer has them)
VOCAB = 272


def byte_tokenizer(markers: bool = True):
    """Every byte a token (a BPE with no merges over the byte-level alphabet), the special tokens above, and the
    call markers as added tokens (or not: then the model writes them byte by byte)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    if markers:
        tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    return tok


def save_tool_model(folder: Path, template: str, eos: str, markers: bool = True, seed: int = 0) -> None:
    """A random two-layer Llama with the byte tokenizer and `template`, its turns ending at `eos`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = byte_tokenizer(markers)
    assert tok.get_vocab_size() <= VOCAB
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=tok.token_to_id(eos))  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=eos, unk_token="<unk>",
                            chat_template=template).save_pretrained(folder)  # fmt: skip
