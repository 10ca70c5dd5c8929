"""The recipe pages show code that runs: every ```python block under a `<!-- recipe: examples/F.py NAME -->`
line in docs/user/recipes/ is the `# recipe: NAME` .. `# recipe: end` region of that example, byte for
byte (dedented), so a page and the file tests/cluster/test_recipes_slurm.py runs cannot drift.

    python tests/unit/test_recipes.py --write     # regenerate the blocks after editing an example
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "user" / "recipes"
INCLUDE = re.compile(r"<!-- recipe: (examples/[\w./-]+\.py) (\w+) -->\n```python\n(.*?)```\n", re.S)
BEGIN = re.compile(r"^\s*# recipe: (\w+)\s*$")
END = re.compile(r"^\s*# recipe: end\s*$")


def regions(path: Path) -> dict[str, str]:
    """NAME -> the dedented lines between `# recipe: NAME` and `# recipe: end` in ``path``."""
    out: dict[str, str] = {}
    name, lines = None, []
    for line in path.read_text().splitlines(keepends=True):
        if name is None:
            m = BEGIN.match(line)
            if m and m.group(1) != "end":
                name, lines = m.group(1), []
        elif END.match(line):
            out[name] = textwrap.dedent("".join(lines))
            name = None
        else:
            lines.append(line)
    assert name is None, f"{path}: `# recipe: {name}` has no `# recipe: end`"
    return out


def includes(page: Path) -> list[tuple[str, str, str]]:
    """(example path, region name, the block as the page has it) for each include of ``page``."""
    return INCLUDE.findall(page.read_text())


def render(page: Path) -> str:
    """The page with every included block replaced by its region as the example has it now."""
    def block(m: re.Match) -> str:
        code = regions(ROOT / m.group(1))[m.group(2)]
        return f"<!-- recipe: {m.group(1)} {m.group(2)} -->\n```python\n{code}```\n"

    return INCLUDE.sub(block, page.read_text())


def pages() -> list[Path]:
    return sorted(PAGES.glob("*.md"))


def recipe_examples() -> list[str]:
    """Every example a recipe page includes (tests/cluster/test_recipes_slurm.py runs each)."""
    return sorted({ex for p in pages() for ex, _, _ in includes(p)})


def test_every_recipe_page_includes_example_code():
    assert len(pages()) >= 5
    for page in pages():
        assert includes(page), f"{page.name}: no <!-- recipe: examples/F.py NAME --> block"


def test_every_included_block_is_its_example_region():
    for page in pages():
        for ex, name, _ in includes(page):
            assert (ROOT / ex).is_file(), f"{page.name}: {ex} does not exist"
            assert name in regions(ROOT / ex), f"{page.name}: {ex} has no `# recipe: {name}` region"
        assert render(page) == page.read_text(), (
            f"{page.name} differs from its examples: run python tests/unit/test_recipes.py --write")


def test_every_region_is_shown_on_a_page():
    shown = {(ex, name) for p in pages() for ex, name, _ in includes(p)}
    for path in sorted((ROOT / "examples").glob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name in regions(path):
            assert (rel, name) in shown, f"{rel}: region {name} is on no recipe page"


def test_every_recipe_shows_trainer_saved():
    for page in pages():
        code = "".join(block for _, _, block in includes(page))
        assert "trainer.saved(" in code, f"{page.name}: its code never says a save is whole"


def test_regions_are_dedented_and_closed(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("a = 1\n    # recipe: body\n    def f():\n        return 1\n    # recipe: end\n")
    assert regions(f) == {"body": "def f():\n    return 1\n"}
    f.write_text("# recipe: open\nx = 1\n")
    try:
        regions(f)
    except AssertionError as exc:
        assert "no `# recipe: end`" in str(exc)
    else:
        raise AssertionError("an unclosed region was accepted")


if __name__ == "__main__" and "--write" in sys.argv:
    for p in pages():
        new = render(p)
        if new != p.read_text():
            p.write_text(new)
            print(f"wrote {p.relative_to(ROOT)}")
