"""`tinyserve`: one command for the product's jobs, each handled by its own module's parser.

tinyserve serve [--port 9000 ...]            python -m server
tinyserve serve-ray [--max-replicas 4 ...]   python -m server.ray_serve (Ray Serve replicas; extra: [ray])
tinyserve train gpt|esperberto|tokenizer ...  python -m training gpt|esperberto|tokenizer
tinyserve eval|complete|eos|kurtosis|...     python -m training eval|complete|eos|kurtosis|experiments
tinyserve export MODEL OUT --format hf|gguf  a store GPT as a GPT-NeoX checkpoint for transformers, or any model
                                             our decoder serves as one GGUF file for llama.cpp and Ollama
tinyserve store add SRC NAME                 a checkpoint folder (ours, transformers') or a GGUF file into the store
tinyserve store add-vector FILE NAME --model M  a llama.cpp control-vector file as M's steering vector NAME
"""

from __future__ import annotations

import argparse
import sys

TRAIN = ("gpt", "esperberto", "tokenizer")
TRAINING_TOOLS = ("eval", "complete", "eos", "kurtosis", "experiments")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tinyserve", description=__doc__.splitlines()[0].split(": ", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("serve", help="serve the model store over HTTP (options: tinyserve serve --help)", add_help=False)
    sub.add_parser("serve-ray", help="serve as Ray Serve replicas (tinyserve serve-ray --help)", add_help=False)
    train = sub.add_parser("train", help="train a model: gpt, esperberto or a tokenizer", add_help=False)
    train.add_argument("what", choices=TRAIN, nargs="?")
    for name in TRAINING_TOOLS:
        sub.add_parser(name, help=f"python -m training {name} (options: tinyserve {name} --help)", add_help=False)
    export_help = "a store model in transformers or GGUF format (tinyserve export --help)"
    sub.add_parser("export", help=export_help, add_help=False)
    sub.add_parser("store", help="manage the model store (tinyserve store add --help)", add_help=False)
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command == "export":
        return export(rest)
    if args.command == "store":
        return store(rest)
    if args.command == "serve":
        from server.__main__ import main as serve

        return serve(rest)
    if args.command == "serve-ray":
        try:
            from server.ray_serve import main as serve_ray
        except ImportError as e:  # Ray is an extra
            parser.error(f"serve-ray needs Ray Serve, the [ray] extra: pip install -e '.[ray]' ({e})")
        return serve_ray(rest)
    from training.__main__ import main as training

    if args.command == "train":
        if args.what is None:
            train.error(f"say what to train: {', '.join(TRAIN)}")
        return training([args.what, *rest])
    return training([args.command, *rest])


def export(argv: list[str]) -> None:
    from pathlib import Path

    import torch

    from model_store.export import ExportError, export_hf
    from model_store.gguf_files import GGUF_TYPES, GGUFError, export_gguf
    from model_store.store import CheckpointError
    from server.config import Settings  # the store is the server's setting: TINYSERVE_STORE

    p = argparse.ArgumentParser(prog="tinyserve export", description="write a store model in another format")
    p.add_argument("model", help="model id in the store (TINYSERVE_STORE)")
    p.add_argument("out", type=Path, help="output folder (hf) or file (gguf)")
    p.add_argument(
        "--format",
        default="hf",
        choices=["hf", "gguf"],
        help="hf: our GPT as a GPT-NeoX checkpoint for transformers; gguf: any model our decoder serves, for llama.cpp",
    )
    p.add_argument("--dtype", default="float32", choices=list(GGUF_TYPES), help="weights' type (q8_0: gguf only)")
    args = p.parse_args(argv)
    folder = Settings().store / args.model
    try:
        if args.format == "gguf":
            print(export_gguf(folder, args.out, GGUF_TYPES[args.dtype]))
        elif args.dtype == "q8_0":
            p.exit(2, "tinyserve export: --dtype q8_0 is for --format gguf\n")
        else:
            print(export_hf(folder, args.out, getattr(torch, args.dtype)))
    except (ExportError, GGUFError, CheckpointError) as e:
        p.exit(2, f"tinyserve export: {e}\n")


def store(argv: list[str]) -> None:
    import json
    from pathlib import Path

    from model_store.control_vectors import ControlVectorError, add_vector
    from model_store.ingest import add_checkpoint
    from model_store.store import CheckpointError, resolve
    from server.config import Settings

    p = argparse.ArgumentParser(prog="tinyserve store", description="manage the model store (TINYSERVE_STORE)")
    sub = p.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add", help="validate a checkpoint folder, copy it into the store, write its manifest")
    add.add_argument(
        "src", type=Path, help="a checkpoint folder (ours, or a transformers save_pretrained folder) or a .gguf file"
    )
    add.add_argument("name", help="its model id in the store")
    vector = sub.add_parser("add-vector", help="a llama.cpp control-vector file as a named steering vector of a model")
    vector.add_argument("src", type=Path, help="a control-vector .gguf (llama.cpp's cvector-generator, repeng)")
    vector.add_argument("name", help="its name: a request's steer names it")
    vector.add_argument("--model", required=True, help="the store model it steers (its width is checked)")
    args = p.parse_args(argv)
    settings = Settings()
    if args.action == "add-vector":
        try:
            folder = resolve(args.model, settings.store)
            print(add_vector(args.src, args.name, folder, json.loads((folder / "config.json").read_text())))
        except (CheckpointError, ControlVectorError, OSError) as e:
            p.exit(2, f"tinyserve store add-vector: {e}\n")
        return
    try:
        print(add_checkpoint(args.src, args.name, settings.store, settings.max_context))
    except CheckpointError as e:
        p.exit(2, f"tinyserve store add: {e}\n")


if __name__ == "__main__":
    main()
