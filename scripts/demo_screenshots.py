"""Retake the demo-page screenshots (README, docs/API.md) on the shipped models (headless Debian chromium).

python -m scripts.demo_screenshots [--out docs]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from playwright.sync_api import sync_playwright

from model_store import STORE_ROOT
from scripts.processes import http_server


def shoot_attention(page, model: str, layer: int, head: int, text: str, hover_cell: int, path: Path) -> None:
    """A layer's grid of heads and one head enlarged, a cell hovered so that its weight shows."""
    page.select_option("#att-model", model)
    page.wait_for_function(f"document.querySelector('#att-layer option[value=\"{layer}\"]') !== null")
    page.select_option("#att-layer", str(layer))
    page.select_option("#att-head", str(head))
    page.fill("#att-text", text)
    page.click("#show-attention")
    page.wait_for_function(f"document.querySelector('#hover-info').textContent.startsWith('{model} ')")
    page.wait_for_selector("#heatmap .cell")
    page.hover(f"#heatmap .cell >> nth={hover_cell}")
    page.screenshot(path=path, full_page=True)


# the worked example of docs/LOOKING_INSIDE.md: the year the shipped GPT copies
YEAR_CLEAN = "In 1990 , the band released its first album , and in"
YEAR_CORRUPT = "In 2005 , the band released its first album , and in"


def shoot_inside(page, out: Path) -> None:
    """The Look inside tab's three views on the shipped GPT: logit lens, each head's ablation, patching."""
    page.click("button[data-tab=inside]")
    page.select_option("#in-model", "gpt-wikitext2")
    page.fill("#in-text", YEAR_CLEAN)
    for view, fields in (("lens", {}), ("ablate", {"heads": "each"}),
                         ("patch", {"corrupt": YEAR_CORRUPT, "answer": " 1990", "foil": " 2005"})):  # fmt: skip
        page.select_option("#in-view", view)
        for name, value in fields.items():
            page.fill(f"#in-{name}", value)
        page.evaluate("document.querySelector('#inside-result').replaceChildren()")
        page.click("#look")
        page.wait_for_selector("#inside-result table")
        page.locator("#inside").screenshot(path=out / f"demo-inside-{view}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with http_server(STORE_ROOT, ready_after="all") as (base, _), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1200, "height": 860})
        page.goto(base + "/")
        page.wait_for_function("document.querySelectorAll('#gen-model option').length > 0")

        page.fill("#prompt", "The history of the city begins")
        page.fill("#max_new_tokens", "60")
        page.fill("#eos_bias", "-4")
        page.fill("#seed", "11")
        page.click("#generate")
        page.wait_for_function("!['…', '–'].includes(document.querySelector('#finish-reason').textContent)")
        page.screenshot(path=args.out / "demo-completion.png", full_page=True)  # with the API panel

        page.click("button[data-tab=fillmask]")
        page.fill("#mask-text", "Mi <mask> vin.")
        page.click("#fill")
        page.wait_for_selector(".candidates li")
        page.screenshot(path=args.out / "demo-fill-mask.png")

        page.click("button[data-tab=attention]")
        gpt = page.input_value("#att-model")
        shoot_attention(page, gpt, 2, 3, "The castle was built by the king in the 12th century.", 40,
                        args.out / "demo-attention.png")  # fmt: skip
        shoot_attention(page, "esperberto-softmax1", 3, 0, "La suno brilas hodiaŭ super la granda urbo.", 12,
                        args.out / "demo-attention-esperberto.png")  # fmt: skip
        shoot_inside(page, args.out)
        page.click("button[data-tab=card]")
        page.select_option("#card-model", "gpt-wikitext2")
        page.wait_for_function(
            "document.querySelector('#card-body img') && document.querySelector('#card-body img').complete"
        )
        page.screenshot(path=args.out / "demo-card.png")
        browser.close()
    print(f"wrote {args.out}/demo-{{completion,fill-mask,attention,attention-esperberto,inside-*,card}}.png")


if __name__ == "__main__":
    main()
