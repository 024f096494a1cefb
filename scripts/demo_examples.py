"""Write the demo page's examples (server/api/static/examples.json): shared links, run in the page itself
on the shipped models, with the output the page showed. Rerun after shipping a new checkpoint.

python -m scripts.demo_examples
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from urllib.parse import urlencode

from playwright.sync_api import Page, sync_playwright

from model_store import STORE_ROOT
from scripts.processes import http_server

OUT = Path(__file__).resolve().parent.parent / "server" / "api" / "static" / "examples.json"

SAMPLING = {"model": "gpt-wikitext2", "temperature": 0.8, "top_k": 40, "top_p": 0.95, "max_new_tokens": 128}
EXAMPLES = {
    "complete": [
        (
            "Ends with its paragraph (EOS bias 0)",
            {**SAMPLING, "prompt": "The castle was built in", "eos_bias": 0, "seed": 3},
        ),
        ("Goes on (EOS bias -8)", {**SAMPLING, "prompt": "The castle was built in", "eos_bias": -8, "seed": 3}),
        (
            "Short answer (EOS bias +4)",
            {**SAMPLING, "prompt": "The song was released as a single", "eos_bias": 4, "seed": 1},
        ),
        (
            "Greedy",
            {
                **SAMPLING,
                "prompt": "The history of the city begins",
                "temperature": 0,
                "max_new_tokens": 40,
                "eos_bias": 0,
            },
        ),
    ],
    "fillmask": [
        ("Mi <mask> vin.", {"text": "Mi <mask> vin.", "top_k": 5}),
        ("La <mask> brilas.", {"text": "La <mask> brilas.", "top_k": 5}),
        ("Two masks", {"text": "La <mask> estas en la <mask>.", "top_k": 3}),
    ],
    "attention": [
        (
            "softmax1: heads that attend to nothing",
            {
                "model": "esperberto-softmax1",
                "layer": 3,
                "head": 0,
                "text": "La suno brilas hodiaŭ super la granda urbo.",
            },
        ),
        (
            "GPT, last layer",
            {
                "model": "gpt-wikitext2",
                "layer": 3,
                "head": 0,
                "text": "The castle was built by the king in the 12th century.",
            },
        ),
    ],
}


def output_of(page: Page, tab: str) -> str:
    """What the page shows once the example has run, in one line."""
    if tab == "complete":
        page.wait_for_function(  # eager steps while the server still compiles: minutes, not seconds
            "!['…', '–'].includes(document.querySelector('#finish-reason').textContent)", timeout=300_000
        )
        text = page.text_content("#completion .generated").strip().replace("\n", " ")
        return f"{text} [{page.text_content('#finish-reason')}, {page.text_content('#gen-count')} tokens]"
    if tab == "fillmask":
        page.wait_for_selector(".candidates li", timeout=120_000)
        columns = page.query_selector_all(".candidates")
        return " | ".join(
            f"{c.get_attribute('data-model')}: "
            + ", ".join(li.text_content().strip() for li in c.query_selector_all("ol")[0].query_selector_all("li")[:3])
            for c in columns
        )
    page.wait_for_selector("#head-grid .head-cell", timeout=120_000)
    return page.text_content("#hover-info").replace(" Hover a cell or a token.", "")


def main() -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    result: dict[str, list[dict]] = {}
    with http_server(STORE_ROOT) as (base, _), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        for tab, examples in EXAMPLES.items():
            for title, state in examples:
                link = "#" + urlencode({"tab": tab, **state})
                page = browser.new_page()
                page.goto(base + "/" + link)
                result.setdefault(tab, []).append({"title": title, "link": link, "output": output_of(page, tab)})
                print(tab, title, "->", result[tab][-1]["output"][:100])
                page.close()
        browser.close()
    OUT.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
