"""Model cards for the demo page: what a card may link and how it renders (server/serving/model_card.py)."""

from __future__ import annotations

from server.serving.model_card import card_image, linked_images, render_html

CARD = """# A model

![curve](loss_curve.png) ![up](../other/loss_curve.png) ![web](https://example.com/x.png)
![vector](plot.svg) ![nested](plots/a.png) ![dots](..png)

<img src="x" onerror="alert(1)"> [click](javascript:alert(1)) [docs](https://example.com)
"""


def test_only_plain_image_names_in_the_folder_are_linked():
    assert linked_images(CARD) == {"loss_curve.png"}


def test_render_escapes_html_blocks_javascript_links_and_points_images_at_the_route():
    html = render_html(CARD, lambda name: f"/models/m/card/{name}")
    assert "<h1>A model</h1>" in html
    assert '<img src="/models/m/card/loss_curve.png" alt="curve"' in html
    assert '<img src="../other/loss_curve.png"' in html  # not ours: left as written (the page drops it)
    assert '<img src="x"' not in html and "&lt;img" in html  # raw HTML shown as text
    assert 'href="javascript:' not in html and '<a href="https://example.com">docs</a>' in html


def test_card_image_serves_linked_files_only(tmp_path):
    (tmp_path / "loss_curve.png").write_bytes(b"png")
    (tmp_path / "other.png").write_bytes(b"png")
    assert card_image(tmp_path, CARD, "loss_curve.png") == tmp_path / "loss_curve.png"
    assert card_image(tmp_path, CARD, "other.png") is None  # exists, but the card does not link it
    assert card_image(tmp_path, "![c](missing.png)", "missing.png") is None
    assert card_image(tmp_path, CARD, "../other/loss_curve.png") is None
