"""The README's generated tables match the code (config schema, XID catalogue).

Regenerate with: python tests/test_readme.py --write
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def generated() -> dict[str, str]:
    from slurmagent.state import config
    from slurmagent.core import xid

    return {"xid-table": xid.table_markdown(), "config-table": config.reference_markdown()}


def block(text: str, name: str) -> str:
    m = re.search(rf"<!-- BEGIN {name}[^\n]*-->\n(.*?)<!-- END {name} -->", text, re.S)
    assert m, f"README has no {name} block"
    return m.group(1).strip()


def test_readme_tables_match_the_code():
    text = README.read_text()
    for name, table in generated().items():
        assert block(text, name) == table.strip(), f"README {name} is stale: run python tests/test_readme.py --write"


def test_readme_quick_start_is_two_commands():
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("```", 2)[1]
    assert [line for line in quick.splitlines() if line.strip()] == ["make demo", "make test"]


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    sys.path.insert(0, str(README.parent))
    text = README.read_text()
    for name, table in generated().items():
        text = re.sub(rf"(<!-- BEGIN {name}[^\n]*-->\n).*?(<!-- END {name} -->)",
                      lambda m: m.group(1) + table.strip() + "\n" + m.group(2), text, flags=re.S)
    README.write_text(text)
