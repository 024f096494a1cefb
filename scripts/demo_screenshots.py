"""Retake the README's demo-page screenshots on the shipped models (headless Debian chromium).

python -m scripts.demo_screenshots [--out docs]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from playwright.sync_api import sync_playwright

from model_store import STORE_ROOT
from scripts.processes import http_server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with http_server(STORE_ROOT) as (base, _), sync_playwright() as p:
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
        page.screenshot(path=args.out / "demo-completion.png")

        page.click("button[data-tab=fillmask]")
        page.fill("#mask-text", "Mi <mask> vin.")
        page.click("#fill")
        page.wait_for_selector(".candidates li")
        page.screenshot(path=args.out / "demo-fill-mask.png")

        page.click("button[data-tab=attention]")
        page.select_option("#att-layer", "2")
        page.select_option("#att-head", "3")
        page.fill("#att-text", "The castle was built by the king in the 12th century.")
        page.click("#show-attention")
        page.wait_for_selector("#heatmap .cell")
        page.hover("#heatmap .cell >> nth=40")
        page.screenshot(path=args.out / "demo-attention.png")

        page.select_option("#att-model", "esperberto-softmax1")
        page.wait_for_function("document.querySelectorAll('#att-layer option').length === 4")
        page.select_option("#att-layer", "3")
        page.select_option("#att-head", "0")
        page.fill("#att-text", "La suno brilas hodiaŭ super la granda urbo.")
        page.click("#show-attention")
        page.wait_for_selector("#heatmap .cell")
        page.hover("#heatmap .cell >> nth=12")
        page.screenshot(path=args.out / "demo-attention-esperberto.png")
        browser.close()
    print(f"wrote {args.out}/demo-{{completion,fill-mask,attention,attention-esperberto}}.png")


if __name__ == "__main__":
    main()
