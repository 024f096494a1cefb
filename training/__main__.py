"""Command line: `python -m training COMMAND --help`, COMMAND one of tokenizer, gpt, eval, complete, eos,
card, esperberto, kurtosis, experiments, pilots."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import get_args

from transformers import HfArgumentParser

from training import SHARED_DATA, WIKITEXT2
from training.data import DocMode

DOC_MODES = get_args(DocMode)


def add_tokenizer_parser(sub) -> None:
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a corpus's train split")
    p.add_argument("--data", default=str(WIKITEXT2), help="corpus folder with train.txt, or HF dataset id")
    p.add_argument(
        "--doc-mode",
        default="wikitext",
        choices=DOC_MODES,
        help="how the text splits into documents",
    )
    p.add_argument("--detokenize", action="store_true", help="undo WikiText's tokenisation first, as in training")
    from models.gpt import GPTConfig

    p.add_argument(
        "--vocab-size", type=int, default=GPTConfig.vocab_size, help="BPE vocabulary size, special tokens included"
    )
    p.add_argument("--out", required=True, help="where to write tokenizer.json")


def add_gpt_parser(sub) -> None:
    from models.gpt import GPTConfig
    from training.trainer import TrainConfig
    from training.variants import VARIANTS

    p = sub.add_parser(
        "gpt",
        dataclass_types=[TrainConfig, GPTConfig],
        help="train the from-scratch GPT (resumes if OUT/checkpoint.pt exists)",
    )
    p.add_argument(
        "--variant",
        default="dot",
        choices=list(VARIANTS),
        help="attention preset of training/variants.py, applied over the model flags; dual variants split "
        "--n-head into self + relational heads",
    )


def add_experiments_parser(sub) -> None:
    from training.experiments import ExperimentConfig

    sub.add_parser(
        "experiments",
        dataclass_types=[ExperimentConfig],
        help="train every attention variant on a corpus, write docs/experiments/",
    )


def add_pilots_parser(sub) -> None:
    p = sub.add_parser("pilots", help="the pilot table of the runs training/pilots.sh wrote")
    p.add_argument("runs", nargs="?", default="runs/pilots", help="the pilots' folder")
    p.add_argument("--names", nargs="+", required=True, help="pilots in table order, the baseline first")


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="token/word-level perplexity of a checkpoint, and per-sentence loss")
    p.add_argument("checkpoint", help="model-store checkpoint folder")
    p.add_argument("--data", default=str(WIKITEXT2), help="corpus folder with valid.txt/test.txt")
    p.add_argument("--splits", default="valid,test", help="comma-separated splits to evaluate")
    p.add_argument(
        "--doc-mode",
        default="wikitext",
        choices=DOC_MODES,
        help="document splitting, as in training",
    )
    p.add_argument("--detokenize", action="store_true", help="undo WikiText's tokenisation, as in training")
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride (default context/2)")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights' dtype (as served)"
    )
    p.add_argument("--sentence", action="append", default=[], help="also score this sentence (repeatable)")


def add_complete_parser(sub) -> None:
    p = sub.add_parser("complete", help="complete a prompt with a checkpoint")
    p.add_argument("checkpoint", help="model-store checkpoint folder")
    p.add_argument("prompt", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=60, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set reaching p")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating tokens")
    p.add_argument(
        "--eos-bias", type=float, default=0.0, help="added to the end-of-text logit (negative = longer outputs)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed")


def add_eos_parser(sub) -> None:
    p = sub.add_parser("eos", help="completion length and the share that ends by itself, per EOS bias")
    p.add_argument("checkpoint", help="model-store checkpoint folder")
    p.add_argument("--prompt", default="The castle was built in", help="the prompt every completion continues")
    p.add_argument("--seeds", type=int, default=20, help="completions per bias")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--biases", type=float, nargs="+", default=[4.0, 0.0, -4.0, -8.0], help="EOS biases to compare")


def add_card_parser(sub) -> None:
    p = sub.add_parser("card", help="rewrite a run's model card (samples, EOS table) into its exported checkpoint")
    p.add_argument("run", help="the run folder (run_config.json, metrics.json)")
    p.add_argument("checkpoint", help="the model-store checkpoint the run exported")
    p.add_argument("--note", default="", help="Markdown for a Notes section (how it compares with its predecessor)")


def add_esperberto_parser(sub) -> None:
    from training.esperberto.train import MLMTrainConfig

    sub.add_parser(
        "esperberto",
        dataclass_types=[MLMTrainConfig],
        help="train an EsperBERTo masked LM (softmax0 or softmax1); resumes",
    )


def add_kurtosis_parser(sub) -> None:
    p = sub.add_parser("kurtosis", help="the softmax0 vs softmax1 study: kurtosis tables, attention mass, histograms")
    p.add_argument("models", nargs="+", help="EsperBERTo checkpoint folders (e.g. both variants)")
    p.add_argument("--data", default=str(SHARED_DATA / "esperanto"), help="corpus; its held-out lines are measured")
    p.add_argument("--holdout-every", type=int, default=50, help="as in training: every N-th line is held out")
    p.add_argument("--block-size", type=int, default=128, help="tokens per block, as in training")
    p.add_argument("--max-blocks", type=int, default=None, help="measure at most this many held-out blocks")
    p.add_argument("--out", required=True, help="folder for kurtosis.md, kurtosis.json and the PNGs")


def build_parser() -> HfArgumentParser:
    parser = HfArgumentParser(prog="python -m training", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)  # each one an HfArgumentParser too
    add_tokenizer_parser(sub)
    add_gpt_parser(sub)
    add_eval_parser(sub)
    add_complete_parser(sub)
    add_eos_parser(sub)
    add_card_parser(sub)
    add_esperberto_parser(sub)
    add_kurtosis_parser(sub)
    add_experiments_parser(sub)
    add_pilots_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.command_line = "python -m training " + shlex.join(sys.argv[1:] if argv is None else argv)
    runners = {
        "tokenizer": run_tokenizer,
        "gpt": run_gpt,
        "eval": run_eval,
        "complete": run_complete,
        "eos": run_eos,
        "card": run_card,
        "esperberto": run_esperberto,
        "kurtosis": run_kurtosis,
        "experiments": run_experiments,
        "pilots": run_pilots,
    }
    runners[args.command](args)


def run_tokenizer(args) -> None:
    from training.data import prepare_text, read_split, split_documents
    from training.tokenizer import train_bpe

    text = prepare_text(read_split(args.data, "train"), args.detokenize)
    tok = train_bpe(split_documents(text, args.doc_mode), vocab_size=args.vocab_size)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out)
    print(f"wrote {args.out} ({tok.get_vocab_size()} tokens)")


def configs(args, *types) -> tuple:
    """The config dataclasses a subcommand's flags fill (its parser was built from the same types)."""
    return HfArgumentParser(list(types)).parse_dict(vars(args), allow_extra_keys=True)


def gpt_train_config(args):
    """The run's TrainConfig (model included) from the parsed `gpt` flags and the --variant preset."""
    from dataclasses import replace

    from models.gpt import GPTConfig
    from training.trainer import TrainConfig
    from training.variants import variant_overrides

    cfg, model = configs(args, TrainConfig, GPTConfig)
    variant = variant_overrides(args.variant)
    if "n_relational_head" in variant:  # dual attention: half of the heads become relational
        variant |= {"n_head": model.n_head // 2, "n_relational_head": model.n_head - model.n_head // 2}
    return replace(cfg, model=GPTConfig.from_dict({**model.to_dict(), **variant}))


def run_gpt(args) -> None:
    from training.trainer import train

    train(gpt_train_config(args), command=args.command_line)


def run_eval(args) -> None:
    import torch

    from model_store import load_gpt
    from training.data import read_split
    from training.evaluate import corpus_perplexity, sentence_scores

    model, tok = load_gpt(Path(args.checkpoint), dtype=getattr(torch, args.dtype))
    result: dict = {}
    for split in args.splits.split(","):
        result[split] = corpus_perplexity(
            model, tok, read_split(args.data, split), args.doc_mode, args.stride, args.detokenize
        ).as_dict()
    if args.sentence:
        result["sentences"] = sentence_scores(model, tok, args.sentence)
    print(json.dumps(result, indent=2))


def run_complete(args) -> None:
    import torch

    from model_store import load_gpt

    model, tok = load_gpt(Path(args.checkpoint))
    from models.sampling import SamplingParams

    ids = torch.tensor([tok.encode(args.prompt, add_special_tokens=False).ids])
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        eos_bias=args.eos_bias,
        seed=args.seed,
    )
    out = model.generate(ids, params)
    print(args.prompt + tok.decode(out[0].tolist()))


def run_eos(args) -> None:
    from model_store import load_gpt
    from training.eos import eos_lengths, eos_table

    model, tok = load_gpt(Path(args.checkpoint))
    rows = eos_lengths(model, tok, args.prompt, tuple(args.biases), args.seeds, args.max_new_tokens)
    print(eos_table(rows, args.prompt, args.seeds, args.max_new_tokens))


def run_card(args) -> None:
    from training.card import rewrite_card

    rewrite_card(Path(args.run), Path(args.checkpoint), args.note)
    print(Path(args.checkpoint) / "README.md")


def run_esperberto(args) -> None:
    from training.esperberto.train import MLMTrainConfig, train_mlm

    (cfg,) = configs(args, MLMTrainConfig)
    train_mlm(cfg, command=args.command_line)


def run_experiments(args) -> None:
    from training.experiments import ExperimentConfig, run_experiments

    (cfg,) = configs(args, ExperimentConfig)
    run_experiments(cfg)


def run_pilots(args) -> None:
    from training.pilots import pilot_table

    print(pilot_table(Path(args.runs), args.names))


def run_kurtosis(args) -> None:
    from model_store import load_mlm
    from training.esperberto.data import encode_blocks, read_corpus, split_lines
    from training.esperberto.study import activation_study, parameter_kurtosis, write_report
    from training.esperberto.train import read_log

    _, valid_lines = split_lines(read_corpus(args.data), args.holdout_every)
    results, models = {}, {}
    for folder in args.models:
        model, tok = load_mlm(Path(folder))
        blocks = encode_blocks(valid_lines, tok, args.block_size)[: args.max_blocks]
        name = model.config.attention_variant
        models[name] = model
        metrics = Path(folder) / "metrics.json"
        results[name] = {
            "checkpoint": Path(folder).name,
            "blocks": len(blocks),
            "heldout": json.loads(metrics.read_text()).get("heldout") if metrics.exists() else None,
            "_log": read_log(Path(folder) / "heldout_log.jsonl"),
            "parameters": parameter_kurtosis(model),
        }
        results[name].update(activation_study(model, blocks))
    note = (
        f"Measured by `{args.command_line}` on {len(blocks)} held-out blocks of {args.block_size} tokens "
        "(every position of every block; eval mode). Std is across layers (numpy, ddof=0)."
    )
    print(write_report(results, Path(args.out), models, note))


if __name__ == "__main__":
    main()
