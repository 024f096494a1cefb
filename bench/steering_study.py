"""What a steering vector from contrasting prompts does to the shipped GPT: the shift in the log-probability of
target words after neutral prompts, per block and scale, and a completion steered beside the plain one
(docs/LOOKING_INSIDE.md, "Steering"). Through the served routes, in process: POST /inspect/steering-vector makes
the vector, /v1/completions with `echo` and `logprobs` scores each target word after each prompt with `steer`.

    .venv/bin/python bench/steering_study.py [--model gpt-wikitext2] [--scales -2,-1,-0.5,0.5,1,2] [--example-scale 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# war against music, in WikiText's register: the same frame, one topic each
PAIRS = [
    ("The army attacked the city at dawn", "The band performed in the city at dawn"),
    ("The soldiers fought in the battle", "The singers performed on the album"),
    ("During the war, the troops", "During the tour, the musicians"),
    ("The regiment was sent to the front", "The orchestra was sent to the festival"),
    ("He served as a general in the army", "He served as a guitarist in the band"),
    ("The infantry division advanced", "The song reached number one"),
    ("The fleet was destroyed in the attack", "The single was released in the summer"),
    ("Casualties of the battle were heavy", "Reviews of the album were positive"),
]
NEUTRAL = ["In 1923 the", "The town is known for its", "After the death of his father, he", "It was the first",
           "The following year, the", "She was", "The building was used as a", "Its name comes from the"]  # fmt: skip
WAR = [" army", " battle", " war", " troops", " soldiers", " attack"]
MUSIC = [" album", " song", " band", " music", " singer", " tour"]


def single_tokens(client, model: str, words: list[str]) -> list[str]:
    """The words that are one token after a prompt (their ids without the start tokens)."""
    kept = []
    for w in words:
        alone = client.post("/tokenize", json={"model": model, "text": "x"}).json()["tokens"]
        with_word = client.post("/tokenize", json={"model": model, "text": "x" + w}).json()["tokens"]
        if len(with_word) == len(alone) + 1:
            kept.append(w)
    return kept


def mean_logprob(client, model: str, words: list[str], steer: list | None) -> float:
    """The mean over NEUTRAL prompts and `words` of log p(word | prompt), scored with `steer`."""
    values = []
    for prompt in NEUTRAL:
        body = {"model": model, "prompt": [prompt + w for w in words], "max_tokens": 0, "echo": True, "logprobs": 1}
        if steer:
            body["steer"] = steer
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        values += [c["logprobs"]["token_logprobs"][-1] for c in answer.json()["choices"]]
    return statistics.fmean(values)


def main() -> None:
    from fastapi.testclient import TestClient

    from server.api.app import create_app
    from server.config import Settings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-wikitext2")
    parser.add_argument("--scales", default="-2,-1,-0.5,0.5,1,2")
    parser.add_argument("--example-scale", type=float, default=1.0, help="the steered completion's scale")
    args = parser.parse_args()
    scales = [float(s) for s in args.scales.split(",")]
    settings = Settings(store=REPO / "model_store", models=[args.model], dtype="float32")
    with TestClient(create_app(settings)) as client:
        info = client.get(f"/models/{args.model}").json()
        layers = info["layers"]
        pairs = [{"positive": p, "negative": n} for p, n in PAIRS]
        made = client.post("/inspect/steering-vector", json={"model": args.model, "pairs": pairs, "name": "war"})
        assert made.status_code == 200, made.text
        war, music = single_tokens(client, args.model, WAR), single_tokens(client, args.model, MUSIC)
        base = mean_logprob(client, args.model, war, None), mean_logprob(client, args.model, music, None)
        print(f"{args.model}: {layers} blocks; {len(PAIRS)} pairs; targets war {war}, music {music}")
        print(f"plain: mean log p(war word) {base[0]:.3f}, (music word) {base[1]:.3f}\n")
        print("| block | scale | Δ log p(war word) | Δ log p(music word) |")
        print("|---|---|---|---|")
        for block in range(1, layers):
            for scale in scales:
                steer = [{"name": "war", "layer": block, "scale": scale}]
                shift = [
                    mean_logprob(client, args.model, words, steer) - b
                    for words, b in zip((war, music), base, strict=True)
                ]
                print(f"| {block} | {scale:+g} | {shift[0]:+.3f} | {shift[1]:+.3f} |")
        prompt = "The town is known for its"
        for steer in (None, [{"name": "war", "layer": layers // 2, "scale": args.example_scale}]):
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 24, "eos_bias": -1e9}}
            if steer:
                body["parameters"]["steer"] = steer
            text = client.post("/generate", json=body).json()["generated_text"]
            print(f"\n{'steered ' + str(steer[0]) if steer else 'plain'}: {prompt}{text}")


if __name__ == "__main__":
    main()
