"""Command line: `python -m training {tokenizer,gpt,eval,complete,esperberto,kurtosis,experiments,pilots} --help`."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from training import SHARED_DATA

DEFAULT_DATA = str(SHARED_DATA / "wikitext-2-raw")


def add_tokenizer_parser(sub) -> None:
    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a corpus's train split")
    p.add_argument("--data", default=DEFAULT_DATA, help="corpus folder with train.txt (or HF dataset id 'name:config')")
    p.add_argument(
        "--doc-mode",
        default="wikitext",
        choices=["wikitext", "paragraph", "line"],
        help="how the text splits into documents",
    )
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size, special tokens included")
    p.add_argument("--out", required=True, help="where to write tokenizer.json")


def add_gpt_parser(sub) -> None:
    p = sub.add_parser("gpt", help="train the from-scratch GPT (resumes if OUT/checkpoint.pt exists)")
    p.add_argument(
        "--data",
        default=DEFAULT_DATA,
        help="corpus folder with train/valid/test.txt, or HF dataset id 'Salesforce/wikitext:wikitext-2-raw-v1'",
    )
    p.add_argument("--out", required=True, help="run folder: checkpoint.pt, train_log.jsonl, loss_curve.png, model/")
    p.add_argument("--export", default=None, help="also write the final checkpoint to this model-store folder")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer.json to use (default: OUT/tokenizer.json, trained if missing)"
    )
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary size when the tokenizer is trained here")
    p.add_argument(
        "--doc-mode",
        default="wikitext",
        choices=["wikitext", "paragraph", "line"],
        help="how the text splits into documents (an end-of-text token follows each)",
    )
    m = p.add_argument_group("model")
    m.add_argument("--n-layer", type=int, default=6, help="transformer blocks")
    m.add_argument("--n-head", type=int, default=8, help="attention heads per block")
    m.add_argument("--d-model", type=int, default=256, help="residual stream width")
    m.add_argument("--d-ff", type=int, default=None, help="MLP hidden width (default 4 x d-model)")
    m.add_argument("--context-length", type=int, default=256, help="tokens per training window")
    m.add_argument("--dropout", type=float, default=0.1, help="dropout on embeddings and residual branches")
    m.add_argument("--attn-dropout", type=float, default=0.0, help="dropout on attention probabilities")
    m.add_argument("--softmax", default="softmax0", choices=["softmax0", "softmax1"], help="attention normaliser")
    m.add_argument("--no-tie-weights", action="store_true", help="separate LM-head and token-embedding matrices")
    m.add_argument(
        "--variant",
        default="dot",
        help="attention variant of training/variants.py (dot, additive, shared-qk, shared-qkv, zero-mask, softmax1, "
        "learned-pos, rope, dual-relative, dual-symbolic); dual variants split --n-head into self + relational",
    )
    o = p.add_argument_group("optimisation")
    o.add_argument("--batch-size", type=int, default=32, help="windows per process per micro-step")
    o.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimiser step")
    o.add_argument("--max-steps", type=int, default=2000, help="optimiser steps (the cosine schedule ends here)")
    o.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    o.add_argument("--min-lr", type=float, default=1e-4, help="learning rate at the end of the cosine decay")
    o.add_argument("--warmup-steps", type=int, default=100, help="linear warmup steps")
    o.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    o.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    r = p.add_argument_group("run")
    r.add_argument("--eval-interval", type=int, default=200, help="steps between validation-loss checks")
    r.add_argument("--eval-batches", type=int, default=20, help="validation batches per check")
    r.add_argument("--save-interval", type=int, default=200, help="steps between resumable checkpoints")
    r.add_argument("--seed", type=int, default=1337, help="seed for weights and batch order")
    r.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N")
    r.add_argument("--amp", default="auto", choices=["auto", "bf16", "off"], help="bf16 autocast: auto = on CUDA only")
    r.add_argument("--compile", action="store_true", help="torch.compile the model")
    r.add_argument(
        "--stop-at", type=int, default=None, help="end this invocation after this step; rerun the command to resume"
    )
    r.add_argument(
        "--patience", type=int, default=None, help="stop after this many evaluations without a new best valid loss"
    )
    r.add_argument("--no-final-eval", action="store_true", help="skip full valid/test perplexity at the end")


def add_experiments_parser(sub) -> None:
    from training.variants import VARIANTS

    p = sub.add_parser("experiments", help="train every attention variant on a corpus, write docs/experiments/")
    p.add_argument("--corpus", default="wikitext2", choices=["wikitext2", "tinystories"], help="which shared corpus")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="which variants")
    p.add_argument("--steps", type=int, default=400, help="optimiser steps per variant (the same for all)")
    p.add_argument("--runs", default="runs/experiments", help="run folders (a finished run is reused)")
    p.add_argument("--out", default="docs/experiments", help="where the report goes")
    p.add_argument("--export", nargs="*", default=[], help="variants to copy to model_store/gpt-CORPUS-VARIANT")


def add_pilots_parser(sub) -> None:
    p = sub.add_parser("pilots", help="the pilot table of the runs training/pilots.sh wrote")
    p.add_argument("runs", nargs="?", default="runs/pilots", help="the pilots' folder")
    p.add_argument("--names", nargs="+", required=True, help="pilots in table order, the baseline first")


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="token/word-level perplexity of a checkpoint, and per-sentence loss")
    p.add_argument("checkpoint", help="model-store checkpoint folder")
    p.add_argument("--data", default=DEFAULT_DATA, help="corpus folder with valid.txt/test.txt")
    p.add_argument("--splits", default="valid,test", help="comma-separated splits to evaluate")
    p.add_argument(
        "--doc-mode",
        default="wikitext",
        choices=["wikitext", "paragraph", "line"],
        help="document splitting, as in training",
    )
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride (default context/2)")
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


def add_esperberto_parser(sub) -> None:
    p = sub.add_parser("esperberto", help="train an EsperBERTo masked LM (softmax0 or softmax1); resumes")
    p.add_argument("--variant", required=True, choices=["softmax0", "softmax1"], help="attention normaliser")
    p.add_argument(
        "--data", default=str(SHARED_DATA / "esperanto"), help="folder of *.txt, or HF id 'chriswmurphy/esperanto'"
    )
    p.add_argument("--out", required=True, help="run folder (Trainer checkpoints, metrics.json, model/)")
    p.add_argument("--export", default=None, help="also write the final checkpoint to this model-store folder")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer folder shared by both variants (trained there if missing)"
    )
    p.add_argument(
        "--preset",
        default="rotary-small",
        choices=["tiny", "small", "full", "rotary-tiny", "rotary-small"],
        help="architecture and size: rotary-* = ModernBERT (shipped), others RoBERTa (full = the study's 6x768)",
    )
    p.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary (default: the preset's)")
    p.add_argument("--block-size", type=int, default=128, help="tokens per training block, <s> and </s> included")
    p.add_argument("--holdout-every", type=int, default=50, help="every N-th line is held out for evaluation")
    p.add_argument("--batch-size", type=int, default=32, help="blocks per step")
    p.add_argument("--max-steps", type=int, default=3000, help="optimiser steps")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (linear warmup and decay)")
    p.add_argument("--warmup-steps", type=int, default=300, help="linear warmup steps")
    p.add_argument("--mlm-probability", type=float, default=0.25, help="share of tokens masked in training")
    p.add_argument("--eval-steps", type=int, default=250, help="steps between evaluations and checkpoints")
    p.add_argument("--eval-blocks", type=int, default=200, help="held-out blocks scored every --eval-steps")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--seed", type=int, default=42, help="seed for weights, data order and masks")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast instead of fp32")
    p.add_argument(
        "--dropout", type=float, default=0.0, help="dropout everywhere (negative: the architecture's default)"
    )
    p.add_argument(
        "--position-init", default="random", choices=["random", "sinusoidal"], help="initial position embeddings"
    )


def add_kurtosis_parser(sub) -> None:
    p = sub.add_parser("kurtosis", help="the softmax0 vs softmax1 study: kurtosis tables, attention mass, histograms")
    p.add_argument("models", nargs="+", help="EsperBERTo checkpoint folders (e.g. both variants)")
    p.add_argument("--data", default=str(SHARED_DATA / "esperanto"), help="corpus; its held-out lines are measured")
    p.add_argument("--holdout-every", type=int, default=50, help="as in training: every N-th line is held out")
    p.add_argument("--block-size", type=int, default=128, help="tokens per block, as in training")
    p.add_argument("--max-blocks", type=int, default=None, help="measure at most this many held-out blocks")
    p.add_argument("--out", required=True, help="folder for kurtosis.md, kurtosis.json and the PNGs")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_tokenizer_parser(sub)
    add_gpt_parser(sub)
    add_eval_parser(sub)
    add_complete_parser(sub)
    add_esperberto_parser(sub)
    add_kurtosis_parser(sub)
    add_experiments_parser(sub)
    add_pilots_parser(sub)
    args = parser.parse_args(argv)
    args.command_line = "python -m training " + shlex.join(sys.argv[1:] if argv is None else argv)
    runners = {
        "tokenizer": run_tokenizer,
        "gpt": run_gpt,
        "eval": run_eval,
        "complete": run_complete,
        "esperberto": run_esperberto,
        "kurtosis": run_kurtosis,
        "experiments": run_experiments,
        "pilots": run_pilots,
    }
    runners[args.command](args)


def run_tokenizer(args) -> None:
    from training.data import read_split, split_documents
    from training.tokenizer import train_bpe

    tok = train_bpe(split_documents(read_split(args.data, "train"), args.doc_mode), vocab_size=args.vocab_size)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tok.save(args.out)
    print(f"wrote {args.out} ({tok.get_vocab_size()} tokens)")


def run_gpt(args) -> None:
    from training.model import GPTConfig
    from training.trainer import TrainConfig, train
    from training.variants import variant_overrides

    variant = variant_overrides(args.variant)
    if "n_relational_head" in variant:  # dual attention: half of the heads become relational
        variant |= {"n_head": args.n_head // 2, "n_relational_head": args.n_head - args.n_head // 2}
    model = GPTConfig(
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        d_ff=args.d_ff or 4 * args.d_model,
        context_length=args.context_length,
        dropout=args.dropout,
        attn_dropout=args.attn_dropout,
        softmax=args.softmax,
        tie_weights=not args.no_tie_weights,
    )
    model = GPTConfig.from_dict({**model.to_dict(), **variant})
    cfg = TrainConfig(
        data=args.data,
        out=args.out,
        export=args.export,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        doc_mode=args.doc_mode,
        model=model,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        max_steps=args.max_steps,
        lr=args.lr,
        min_lr=args.min_lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        eval_interval=args.eval_interval,
        eval_batches=args.eval_batches,
        save_interval=args.save_interval,
        seed=args.seed,
        device=args.device,
        amp=args.amp,
        compile=args.compile,
        final_eval=not args.no_final_eval,
        stop_at=args.stop_at,
        patience=args.patience,
    )
    train(cfg, command=args.command_line)


def run_eval(args) -> None:
    from model_store import load_gpt
    from training.data import read_split
    from training.evaluate import corpus_perplexity, sentence_scores

    model, tok = load_gpt(Path(args.checkpoint))
    result: dict = {}
    for split in args.splits.split(","):
        result[split] = corpus_perplexity(
            model, tok, read_split(args.data, split), args.doc_mode, args.stride
        ).as_dict()
    if args.sentence:
        result["sentences"] = sentence_scores(model, tok, args.sentence)
    print(json.dumps(result, indent=2))


def run_complete(args) -> None:
    import torch

    from model_store import load_gpt

    model, tok = load_gpt(Path(args.checkpoint))
    from training.sampling import SamplingParams

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


def run_esperberto(args) -> None:
    from training.esperberto.train import MLMTrainConfig, train_mlm

    cfg = MLMTrainConfig(
        data=args.data,
        out=args.out,
        export=args.export,
        variant=args.variant,
        preset=args.preset,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        block_size=args.block_size,
        holdout_every=args.holdout_every,
        batch_size=args.batch_size,
        max_steps=args.max_steps,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        eval_steps=args.eval_steps,
        seed=args.seed,
        bf16=args.bf16,
        dropout=None if args.dropout < 0 else args.dropout,
        mlm_probability=args.mlm_probability,
        eval_blocks=args.eval_blocks,
        threads=args.threads,
        position_init=args.position_init,
    )
    train_mlm(cfg, command=args.command_line)


def run_experiments(args) -> None:
    from training.experiments import ExperimentConfig, run_experiments

    run_experiments(
        ExperimentConfig(
            corpus=args.corpus,
            runs=args.runs,
            out=args.out,
            variants=args.variants,
            max_steps=args.steps,
            export=args.export,
        )
    )


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
