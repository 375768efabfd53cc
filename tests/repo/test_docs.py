"""The README and docs: every link and picture resolves, the gallery covers every notebook, the
architecture diagram regenerates from its source and says what the committed one says."""

from __future__ import annotations

import importlib.util
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "examples").rglob("*.md"))]
SVG = "{http://www.w3.org/2000/svg}"


def _targets(md: Path) -> list[str]:
    """Relative link and image targets of a markdown file (no URLs, no pure anchors)."""
    text = md.read_text()
    found = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img src="([^"]+)"', text)
    return [t.split("#")[0] for t in found
            if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_pictures_resolve(md):
    missing = [t for t in _targets(md) if not (md.parent / t).exists()]
    assert not missing, f"{md.name} links to missing files: {missing}"


def test_readme_shows_the_pictures_and_every_notebook():
    readme = (ROOT / "README.md").read_text()
    for pic in ("architecture.svg", "demo_table.svg", "demo_plot.png"):
        assert f"docs/images/{pic}" in readme
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"(notebooks/{nb.name})" in readme, f"the gallery lacks {nb.name}"
        assert f"docs/images/notebook_{nb.stem}.png" in readme
    for doc in ("docs/architecture.md", "docs/protocol.md", "docs/extending.md"):
        assert f"]({doc})" in readme


def test_demo_table_picture_is_the_demo_table():
    root = ET.parse(IMAGES / "demo_table.svg").getroot()
    text = " ".join(t.text or "" for t in root.iter(f"{SVG}text")).replace("\xa0", " ")
    for word in ("time s", "model s", "correct", "cpu_bound", "ring", "ina"):
        assert word in text, f"demo_table.svg lacks {word!r}"


def _script(name: str):
    """A script of docs/images/ loaded as a module (they are not part of the package)."""
    spec = importlib.util.spec_from_file_location(f"tb_docs_{name}", IMAGES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _svg_texts(path: Path) -> list[str]:
    return sorted(t.text or "" for t in ET.parse(path).getroot().iter(f"{SVG}text"))


def test_architecture_diagram_regenerates_from_its_source(tmp_path):
    architecture = _script("architecture")
    out = architecture.main(tmp_path / "architecture.svg")
    texts = _svg_texts(out)
    for title, module, _what, _colour in architecture.LAYERS:
        assert any(title in t for t in texts) and (not module or module in texts)
    assert texts == _svg_texts(IMAGES / "architecture.svg"), \
        "docs/images/architecture.svg is stale: run python docs/images/architecture.py"


def test_gallery_figure_choices_name_notebooks():
    make_images = _script("make_images")
    stems = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert set(make_images.FIGURE) <= stems
