"""A local copy of lm-eval's `wikitext` task (WikiText-2 test, one document per article, lm-eval's own
detokeniser and word count) read from a corpus folder instead of the Hugging Face hub.

    python -m scripts.lm_eval_wikitext OUT        # writes OUT/wikitext2_local.yaml and its data
    lm_eval --model local-completions --include_path OUT --tasks wikitext2_local ...

The task includes lm-eval's installed wikitext.yaml, so its preprocessing and metrics are lm-eval's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from training import WIKITEXT2
from training.data import read_split, split_documents


def write_task(out: Path, data: str = str(WIKITEXT2), split: str = "test") -> Path:
    import lm_eval

    builtin = Path(lm_eval.__file__).parent / "tasks" / "wikitext" / "wikitext.yaml"
    out.mkdir(parents=True, exist_ok=True)
    pages = (out / f"wikitext2_{split}.jsonl").resolve()
    with pages.open("w") as f:  # the document-level dataset's shape: one raw article per "page"
        for doc in split_documents(read_split(data, split), "wikitext"):
            f.write(json.dumps({"page": doc}) + "\n")
    task = out / "wikitext2_local.yaml"
    task.write_text(
        f"include: {builtin}\ntask: wikitext2_local\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    {split}: {pages}\n"
        f"training_split: null\nvalidation_split: null\ntest_split: {split}\n"
    )
    return task


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder for the task YAML and its JSONL")
    p.add_argument("--data", default=str(WIKITEXT2), help="corpus folder with test.txt (raw WikiText-2)")
    p.add_argument("--split", default="test", choices=["valid", "test"], help="which split to evaluate")
    args = p.parse_args()
    print(write_task(args.out, args.data, args.split))


if __name__ == "__main__":
    main()
