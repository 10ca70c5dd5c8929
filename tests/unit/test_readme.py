"""The manual matches the code: generated tables are fresh, the Quick start is two commands,
and no relative link in README.md or docs/ points at nothing.

The generated tables (config schema, XID catalogue) live in the docs/ page that explains them.
Regenerate them with: python tests/unit/test_readme.py --write
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# Each generated block: the page that holds it, and the code that writes it.
PAGES = {
    "xid-table": DOCS / "admin" / "health.md",
    "config-table": DOCS / "admin" / "configuration.md",
}


def generated() -> dict[str, str]:
    from slurmagent.state import config
    from slurmagent.core import xid

    return {"xid-table": xid.table_markdown(), "config-table": config.reference_markdown()}


def _pattern(name: str) -> str:
    return rf"(<!-- BEGIN {name}[^\n]*-->\n)(.*?)(<!-- END {name} -->)"


def block(text: str, name: str) -> str:
    m = re.search(_pattern(name), text, re.S)
    assert m, f"no {name} block"
    return m.group(2).strip()


@pytest.mark.parametrize("name", sorted(PAGES))
def test_generated_table_matches_the_code(name):
    page = PAGES[name]
    table = generated()[name]
    assert block(page.read_text(), name) == table.strip(), \
        f"{page.relative_to(ROOT)}: {name} is stale: run python tests/unit/test_readme.py --write"


def test_each_generated_table_lives_in_one_page():
    for name, page in PAGES.items():
        holders = [p.relative_to(ROOT) for p in manual() if f"<!-- BEGIN {name}" in p.read_text()]
        assert holders == [page.relative_to(ROOT)], (name, holders)


def test_readme_quick_start_is_two_commands():
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("```", 2)[1]
    assert [line for line in quick.splitlines() if line.strip()] == ["make demo", "make test"]


def manual() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M)}


LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def broken_links(pages: list[Path]) -> list[str]:
    """Every relative link that names a missing file, or a heading its page does not have."""
    bad = []
    for page in pages:
        for target in links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}: ({target})"
            if not dest.exists():
                bad.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where}: no heading #{anchor}")
    return bad


def test_every_relative_link_points_to_something():
    assert broken_links(manual()) == []


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "there.md").write_text("# A heading, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a-heading-with-code) [web](https://example.com)\n"
                    "[gone](missing.md) [no anchor](there.md#nope) `[in code](nowhere.md)`\n")
    assert [b.split(": ", 1)[1] for b in broken_links([page])] == [
        "(missing.md): no such file", "(there.md#nope): no heading #nope"]


def write() -> None:
    for name, table in generated().items():
        page = PAGES[name]
        text = page.read_text()
        assert re.search(_pattern(name), text, re.S), f"{page}: no {name} block"
        page.write_text(re.sub(_pattern(name), lambda m: m.group(1) + table.strip() + "\n" + m.group(3),
                               text, flags=re.S))


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    sys.path.insert(0, str(ROOT))
    write()
