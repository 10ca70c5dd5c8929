"""The package's floors stay as they are built (DESIGN.md, section Layout), read from `ast`:

* an import goes to the same layer or a lower one, never up (the face may import anything);
* a module's layer is its folder's (FOLDER_LAYERS) unless MODULE_LAYERS names it; a folder's
  front (`__init__.py`) holds a docstring only, so a module imports the module it needs;
* a runtime imports no other runtime except `commands/health` (the modules of `run/` are one
  runtime and import each other; each module of `commands/` is one);
* at most 8 modules at the top, 16 in a folder, ~500 lines in a module;
* no import circle, function-local imports included;
* no module imports (or reaches through an imported module) a `_private` name of another;
* a function-local import of a slurmagent module carries a comment saying it is for start-up
  speed (a local import must never be a way to dodge a circle);
* the dev harness (`slurmagent/devtools/`) stands outside the layers: it may import anything,
  and the product imports it only in the `demo` command.

The checker itself is tested on small synthetic packages below, so it can fail.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "slurmagent"

PURE, STATE, ADAPTERS, ACTIONS, RUNTIMES, FACE = range(6)
LAYER_NAMES = ["pure core", "local state", "adapters", "actions", "runtimes", "face"]
# A folder's modules share its layer unless named in MODULE_LAYERS (a folder may hold two layers:
# `slurm/model` is core, `slurm/commands` an adapter). A folder missing here names every module.
FOLDER_LAYERS = {
    "core": PURE, "policy": PURE,
    "state": STATE, "checkpoint": STATE,
    "checkpoint.gcs": ADAPTERS, "gpu": ADAPTERS, "gcp": ADAPTERS, "hang": ADAPTERS,
    "actions": ACTIONS,
    "run": RUNTIMES, "commands": RUNTIMES,
}
MODULE_LAYERS = {
    "errors": PURE, "slurm.model": PURE, "slurm.env": PURE, "slurm.features": PURE, "run.agent_channel": PURE,
    "run.agent_reports": STATE,  # merges node reports into a manifest (the manifest format is local state)
    "slurm.commands": ADAPTERS, "slurm.hookfiles": ADAPTERS, "slurm.job_processes": ADAPTERS,
    "trainer": RUNTIMES,
    "cli": FACE, "cli_bucket": FACE, "cli_check": FACE, "cli_dev": FACE, "entry": FACE, "hookmain": FACE,
    "": FACE,  # the package front: `slurmagent.__version__`, read on first use from state.build
}
SHARED_RUNTIMES = {"commands.health"}
ONE_RUNTIME_FOLDERS = ("run",)  # the modules of `slurmagent run` are one runtime; each command is its own
# (with its parts: `commands/doctor_checks.py` is doctor's, see runtime_of)
MAX_TOP_MODULES, MAX_FOLDER_MODULES, MAX_LINES = 8, 16, 520
DEVTOOLS = "devtools"
DEVTOOLS_ENTRY = ("cli_dev", "demo")  # (module, function): the one product place that imports the harness
STARTUP_WORDS = ("start-up", "startup")


@dataclass(frozen=True)
class Import:
    source: str  # module doing the import, relative to the package ("gcp.compute")
    target: str  # module imported, relative to the package
    names: tuple[str, ...]  # names taken from it (`from x import a, b`)
    line: int
    function: str | None  # the enclosing function, when the import is function-local
    commented: bool  # a comment on the line or just above says why it is local (start-up speed)


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def collect(root: Path, pkg: str) -> tuple[set[str], list[Import], list[str]]:
    """Modules, their imports of package modules, and private names reached through modules."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    modules = set(files)
    imports: list[Import] = []
    private_uses: list[str] = []
    for mod, path in files.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        is_pkg = path.name == "__init__.py"
        bound: dict[str, str] = {}  # local name -> package module it names

        def resolve(level: int, base: str | None) -> str | None:
            if level == 0:
                if base == pkg:
                    return ""
                if base and base.startswith(pkg + "."):
                    return base[len(pkg) + 1:]
                return None
            here = mod.split(".") if mod else []
            if not is_pkg:
                here = here[:-1]
            if level > 1:
                here = here[: len(here) - (level - 1)]
            return ".".join([*here, *([base] if base else [])])

        def visit(node: ast.AST, function: str | None) -> None:
            for child in ast.iter_child_nodes(node):
                fn = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
                if isinstance(child, ast.ImportFrom):
                    target = resolve(child.level, child.module)
                    if target is not None:
                        for alias in child.names:
                            sub = f"{target}.{alias.name}" if target else alias.name
                            real = sub if sub in modules else target
                            imports.append(Import(mod, real, (alias.name,) if real == target else (), child.lineno,
                                                  function, _commented(lines, child)))
                            if real == sub:
                                bound[alias.asname or alias.name] = sub
                elif isinstance(child, ast.Import):
                    for alias in child.names:
                        target = resolve(0, alias.name)
                        if target is not None:
                            imports.append(Import(mod, target, (), child.lineno, function, _commented(lines, child)))
                            if alias.asname:
                                bound[alias.asname] = target
                visit(child, fn)

        visit(tree, None)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                private_uses.append(f"{mod}:{node.lineno}: {node.value.id}.{node.attr} ({bound[node.value.id]})")
    return modules, imports, private_uses


def _commented(lines: list[str], node: ast.stmt) -> bool:
    """A start-up comment on the import's own lines, or on the comment/import lines just above."""
    candidates = lines[node.lineno - 1: node.end_lineno or node.lineno]
    i = node.lineno - 2
    while i >= 0 and lines[i].strip().startswith(("#", "from ", "import ")):
        candidates.append(lines[i])
        i -= 1
    comments = [line.split("#", 1)[1].lower() for line in candidates if "#" in line]
    return any(w in c for c in comments for w in STARTUP_WORDS)


def layer_of(mod: str, packages: set[str] = frozenset()) -> int | None:
    """A module's layer: named in MODULE_LAYERS, else its folder's (a folder front holds nothing: pure)."""
    if mod in MODULE_LAYERS:
        return MODULE_LAYERS[mod]
    if mod == "" or mod in packages:
        return PURE
    parts = mod.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        folder = ".".join(parts[:cut])
        if folder in FOLDER_LAYERS:
            return FOLDER_LAYERS[folder]
    return None


def runtime_of(mod: str) -> str:
    for folder in ONE_RUNTIME_FOLDERS:
        if mod.startswith(folder + "."):
            return folder
    if mod.startswith("commands."):  # commands/<cmd>_<part>.py: a part of <cmd>, split off for length
        return "commands." + mod.split(".", 1)[1].split("_", 1)[0]
    return mod


def cycles(modules: set[str], imports: list[Import]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        if imp.source in graph and imp.target in graph:
            graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def violations(root: Path, pkg: str = "slurmagent") -> list[str]:
    modules, imports, private_uses = collect(root, pkg)
    out = [f"private name reached: {p}" for p in private_uses]
    product = {m for m in modules if not (m == DEVTOOLS or m.startswith(DEVTOOLS + "."))}
    packages = {module_name(p, root) for p in root.rglob("__init__.py")}
    for m in sorted(product):
        if layer_of(m, packages) is None:
            out.append(f"{m}: in no layer (add its folder to DESIGN.md's table and FOLDER_LAYERS here)")
    for init in sorted(p for p in root.rglob("__init__.py") if p.parent != root):  # the package's own: __version__
        body = ast.parse(init.read_text()).body
        if body[1:] or (body and not (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant))):
            out.append(f"{module_name(init, root) or pkg}: a folder's front holds a docstring only (import the module itself)")
    for imp in imports:
        where = f"{imp.source}:{imp.line}"
        if imp.source not in product:
            continue  # the dev harness may import anything
        if imp.target == DEVTOOLS or imp.target.startswith(DEVTOOLS + "."):
            if (imp.source, imp.function) != DEVTOOLS_ENTRY:
                out.append(f"{where}: imports the dev harness {imp.target} (only the demo command may)")
            continue
        private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
        if private:
            out.append(f"{where}: imports private {', '.join(private)} from {imp.target}")
        if imp.function is not None and not imp.commented:
            out.append(f"{where}: function-local import of {imp.target} in {imp.function}() without a comment "
                       "saying it is for start-up speed")
        src, dst = layer_of(imp.source, packages), layer_of(imp.target, packages)
        if src is None or dst is None or src == FACE:
            continue
        if dst > src:
            out.append(f"{where}: upward import of {imp.target} ({LAYER_NAMES[dst]}) from {LAYER_NAMES[src]}")
        elif src == dst == RUNTIMES and imp.target not in SHARED_RUNTIMES and runtime_of(imp.source) != runtime_of(imp.target):
            out.append(f"{where}: runtime {imp.source} imports runtime {imp.target} (only health is shared)")
    for comp in cycles(product, imports):
        out.append(f"import circle: {' -> '.join(comp)}")
    return out


def test_the_package_keeps_its_layers():
    assert violations(PACKAGE) == []


def test_every_named_folder_and_module_exists():
    modules = {module_name(p, PACKAGE) for p in PACKAGE.rglob("*.py")}
    assert set(MODULE_LAYERS) <= modules, set(MODULE_LAYERS) - modules
    assert set(FOLDER_LAYERS) <= modules, set(FOLDER_LAYERS) - modules  # a folder's __init__ names it


def test_the_tree_stays_small_enough_to_read():
    """At most 8 modules at the top, 16 in a folder, ~500 lines in a module (DESIGN.md, Layout)."""
    too_big = []
    for folder in [PACKAGE, *(p.parent for p in PACKAGE.rglob("__init__.py"))]:
        mods = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        limit = MAX_TOP_MODULES if folder == PACKAGE else MAX_FOLDER_MODULES
        if len(mods) > limit:
            too_big.append(f"{folder.relative_to(PACKAGE.parent)}: {len(mods)} modules (at most {limit})")
    for p in PACKAGE.rglob("*.py"):
        n = len(p.read_text().splitlines())
        if n > MAX_LINES:
            too_big.append(f"{p.relative_to(PACKAGE.parent)}: {n} lines (at most ~500)")
    assert too_big == []


# --- the checker on synthetic packages ----------------------------------------------------


def package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "slurmagent"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_sees_an_upward_import(tmp_path):
    root = package(tmp_path, {"core/__init__.py": "", "core/reasons.py": "from ..slurm.commands import Slurm\n",
                              "slurm/__init__.py": "", "slurm/commands.py": ""})
    assert any("upward import of slurm.commands (adapters) from pure core" in v for v in violations(root))


def test_checker_sees_a_circle_hidden_in_a_function(tmp_path):
    root = package(tmp_path, {
        "commands/__init__.py": "", "commands/hooks.py": "from ..actions import api\n",
        "actions/__init__.py": "", "actions/api.py": "def f():\n    from ..commands.hooks import x  # start-up speed\n",
    })
    found = violations(root)
    assert "import circle: actions.api -> commands.hooks" in found
    assert any("upward import of commands.hooks (runtimes) from actions" in v for v in found)


def test_checker_sees_runtime_to_runtime_and_private_names(tmp_path):
    root = package(tmp_path, {
        "commands/__init__.py": "",
        "commands/expiry.py": "from .hooks import _spawn\nfrom . import health\n",
        "commands/hooks.py": "", "commands/health.py": "",
        "commands/watch.py": "from ..gpu import kernlog\nkernlog._cursor()\n",
        "gpu/__init__.py": "", "gpu/kernlog.py": "",
        "run/__init__.py": "", "run/main.py": "from .supervisor import Supervisor\n", "run/supervisor.py": "",
    })
    found = violations(root)
    assert any("runtime commands.expiry imports runtime commands.hooks" in v for v in found)
    assert not any("imports runtime commands.health" in v for v in found)
    assert not any("runtime run.main" in v for v in found)  # one runtime in one folder
    assert any("imports private _spawn from commands.hooks" in v for v in found)
    assert any("kernlog._cursor" in v for v in found)


def test_checker_wants_empty_fronts(tmp_path):
    root = package(tmp_path, {"core/__init__.py": '"""Pure."""\nfrom .xid import catalog\n', "core/xid.py": ""})
    assert "core: a folder's front holds a docstring only (import the module itself)" in violations(root)


def test_checker_wants_a_reason_for_a_local_import_and_keeps_the_harness_out(tmp_path):
    root = package(tmp_path, {
        "cli_dev.py": "def demo():\n    from .devtools import demo  # start-up speed\n"
                      "def check():\n    from .devtools import demo  # start-up speed\n",
        "commands/__init__.py": "", "commands/repair.py": "def run():\n    from ..actions import api\n",
        "actions/__init__.py": "", "actions/api.py": "",
        "devtools/__init__.py": "", "devtools/demo.py": "from ..cli import demo\n",
        "mystery.py": "",
    })
    found = violations(root)
    assert any("commands.repair:2: function-local import of actions.api in run()" in v for v in found)
    assert any("cli_dev:4: imports the dev harness" in v for v in found)
    assert not any("cli_dev:2:" in v for v in found)
    assert not any(v.startswith("devtools") for v in found)
    assert "mystery: in no layer (add its folder to DESIGN.md's table and FOLDER_LAYERS here)" in found


@pytest.mark.parametrize("line,ok", [
    ("    from . import actions  # the unhealthy path only, for start-up speed\n", True),
    ("    # the unhealthy path only, for start-up speed\n    from . import actions\n", True),
    ("    from . import actions  # avoids a circle\n", False),
])
def test_checker_reads_the_comment(tmp_path, line, ok):
    root = package(tmp_path, {"commands/__init__.py": "", "commands/hooks.py": f"def f():\n{line.replace('from . import actions', 'from ..actions import api')}",
                              "actions/__init__.py": "", "actions/api.py": ""})
    assert (not any("without a comment" in v for v in violations(root))) is ok


LAYOUT_PAGE = PACKAGE.parent / "docs" / "dev" / "layout.md"
LAYOUT_START, LAYOUT_END = "<!-- layout:start -->", "<!-- layout:end -->"


def first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    line = " ".join(doc.split("\n\n", 1)[0].split())
    return line if len(line) <= 110 else line[:107].rsplit(" ", 1)[0] + " ..."


def layout_tree() -> str:
    """The package tree with each module's layer and the first sentence of its docstring."""
    packages = {module_name(p, PACKAGE) for p in PACKAGE.rglob("__init__.py")}
    rows = ["slurmagent/"]

    def walk(folder: Path, depth: int) -> None:
        pad = "  " * depth
        for p in sorted(folder.glob("*.py")):
            if p.name == "__init__.py":
                continue
            mod = module_name(p, PACKAGE)
            layer = "dev harness" if mod.startswith(DEVTOOLS + ".") else LAYER_NAMES[layer_of(mod, packages)]
            rows.append(f"{pad}{p.name:<{24 - len(pad)}} {layer:<11}  {first_line(p)}")
        for sub in sorted(d for d in folder.iterdir() if (d / "__init__.py").exists()):
            rows.append(f"{pad}{sub.name + '/':<{24 - len(pad)}} {'':<11}  {first_line(sub / '__init__.py')}")
            walk(sub, depth + 1)

    walk(PACKAGE, 1)
    return "```\n" + "\n".join(r.rstrip() for r in rows) + "\n```"


def layout_block(text: str) -> str:
    assert LAYOUT_START in text and LAYOUT_END in text, f"{LAYOUT_PAGE} has no {LAYOUT_START} block"
    return text.split(LAYOUT_START, 1)[1].split(LAYOUT_END, 1)[0].strip()


def test_the_layout_page_shows_the_tree():
    """docs/dev/layout.md shows every module in its folder with its layer (rewrite: --write)."""
    assert layout_block(LAYOUT_PAGE.read_text()) == layout_tree(), \
        f"{LAYOUT_PAGE} is stale: run python tests/unit/test_layers.py --write"


if __name__ == "__main__":
    import sys

    if "--write" in sys.argv:
        text = LAYOUT_PAGE.read_text()
        old = layout_block(text)
        LAYOUT_PAGE.write_text(text.replace(old, layout_tree(), 1))
