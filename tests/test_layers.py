"""The package's floors stay as they are built (DESIGN.md, section Layout), read from `ast`:

* an import goes to the same layer or a lower one, never up (the face may import anything);
* a runtime imports no other runtime except `health` (the modules of one runtime, as the
  `run`/`sbatch` group in RUNTIME_GROUPS, import each other);
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

PACKAGE = Path(__file__).resolve().parent.parent / "slurmagent"

PURE, STATE, ADAPTERS, ACTIONS, RUNTIMES, FACE = range(6)
LAYER_NAMES = ["pure core", "local state", "adapters", "actions", "runtimes", "face"]
LAYERS = {
    PURE: ["snapshot", "checks", "xid", "reasons", "nodes", "policy", "repair_policy", "kernel_xid", "hostlist", "timefmt", "errors",
           "agent_channel"],
    STATE: ["fsutil", "config", "journal", "metrics", "decisionlog", "expiry_state", "repair_state", "host",
            "checkpoint", "checkpoint_errors", "checkpoint_names", "checkpoint_hash", "checkpoint_cache",
            "checkpoint_manifest", "private_dirs", "checkpoint_cut", "ckpt_report"],
    ADAPTERS: ["nvml", "nvml_deadline", "kernlog", "kernlog_changes", "slurm", "gcp.metadata", "gcp.events", "gcp.compute",
               "gcp.storage", "gcp.transfer", "gcp.bucket", "gcp.manifest_store", "gcp.sync_run", "gcp.upload", "gcp.packs",
               "gcp.sync", "gcp.restore", "gcp.verify"],
    ACTIONS: ["actions", "action_handlers", "eviction"],
    RUNTIMES: ["health", "hooks", "healthcheck", "watch", "expiry", "repair", "status", "wrapper", "run_setup",
               "child_process", "own_requeue", "runner", "allocation", "agent_step", "node_agent", "uncommitted", "cut_store", "identity",
               "restore_failure", "trainer", "doctor", "install", "job_status"],
    FACE: ["cli", "entry", "hookmain"],
}
PACKAGES = {"": PURE, "gcp": PURE}  # the package __init__ files: nothing in them
RUNTIME_GROUPS = {"runner": "run", "wrapper": "run", "run_setup": "run", "child_process": "run",
                  "allocation": "run", "agent_step": "run", "node_agent": "run", "uncommitted": "run", "own_requeue": "run",
                  "cut_store": "run", "identity": "run", "restore_failure": "run",
                  "status": "status", "job_status": "status"}  # one runtime in several modules
SHARED_RUNTIMES = {"health"}
DEVTOOLS = "devtools"
DEVTOOLS_ENTRY = ("cli", "demo")  # (module, function): the one product place that imports the harness
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


def layer_of(mod: str) -> int | None:
    if mod in PACKAGES:
        return PACKAGES[mod]
    for layer, names in LAYERS.items():
        if mod in names:
            return layer
    return None


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
    for m in sorted(product):
        if layer_of(m) is None:
            out.append(f"{m}: in no layer (add it to DESIGN.md's table and to LAYERS here)")
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
        src, dst = layer_of(imp.source), layer_of(imp.target)
        if src is None or dst is None or src == FACE:
            continue
        if dst > src:
            out.append(f"{where}: upward import of {imp.target} ({LAYER_NAMES[dst]}) from {LAYER_NAMES[src]}")
        elif src == dst == RUNTIMES and imp.target not in SHARED_RUNTIMES and \
                RUNTIME_GROUPS.get(imp.source, imp.source) != RUNTIME_GROUPS.get(imp.target, imp.target):
            out.append(f"{where}: runtime {imp.source} imports runtime {imp.target} (only health is shared)")
    for comp in cycles(product, imports):
        out.append(f"import circle: {' -> '.join(comp)}")
    return out


def test_the_package_keeps_its_layers():
    assert violations(PACKAGE) == []


def test_every_layer_module_exists():
    modules = {module_name(p, PACKAGE) for p in PACKAGE.rglob("*.py")}
    named = {m for names in LAYERS.values() for m in names}
    assert named <= modules, named - modules


# --- the checker on synthetic packages ----------------------------------------------------


def package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "slurmagent"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_sees_an_upward_import(tmp_path):
    root = package(tmp_path, {"reasons.py": "from .slurm import Slurm\n", "slurm.py": ""})
    assert any("upward import of slurm (adapters) from pure core" in v for v in violations(root))


def test_checker_sees_a_circle_hidden_in_a_function(tmp_path):
    root = package(tmp_path, {
        "hooks.py": "from . import actions\n",
        "actions.py": "def f():\n    from .hooks import x  # start-up speed\n",
    })
    found = violations(root)
    assert "import circle: actions -> hooks" in found
    assert any("upward import of hooks (runtimes) from actions" in v for v in found)


def test_checker_sees_runtime_to_runtime_and_private_names(tmp_path):
    root = package(tmp_path, {
        "expiry.py": "from .hooks import _spawn\nfrom . import health\n",
        "hooks.py": "", "health.py": "",
        "watch.py": "from . import kernlog\nkernlog._cursor()\n", "kernlog.py": "",
    })
    found = violations(root)
    assert any("runtime expiry imports runtime hooks" in v for v in found)
    assert not any("runtime expiry imports runtime health" in v for v in found)
    assert any("imports private _spawn from hooks" in v for v in found)
    assert any("kernlog._cursor" in v for v in found)


def test_checker_wants_a_reason_for_a_local_import_and_keeps_the_harness_out(tmp_path):
    root = package(tmp_path, {
        "cli.py": "def demo():\n    from .devtools import demo  # start-up speed\n"
                  "def check():\n    from .devtools import demo  # start-up speed\n",
        "repair.py": "def run():\n    from . import actions\n", "actions.py": "",
        "devtools/__init__.py": "", "devtools/demo.py": "from ..cli import demo\n",
        "mystery.py": "",
    })
    found = violations(root)
    assert any("repair:2: function-local import of actions in run()" in v for v in found)
    assert any("cli:4: imports the dev harness" in v for v in found)
    assert not any("cli:2:" in v for v in found)
    assert not any(v.startswith("devtools") for v in found)
    assert "mystery: in no layer (add it to DESIGN.md's table and to LAYERS here)" in found


@pytest.mark.parametrize("line,ok", [
    ("    from . import actions  # the unhealthy path only, for start-up speed\n", True),
    ("    # the unhealthy path only, for start-up speed\n    from . import actions\n", True),
    ("    from . import actions  # avoids a circle\n", False),
])
def test_checker_reads_the_comment(tmp_path, line, ok):
    root = package(tmp_path, {"hooks.py": f"def f():\n{line}", "actions.py": ""})
    assert (not any("without a comment" in v for v in violations(root))) is ok


def test_readme_layout_matches_the_tree():
    """README's "Code layout" table names every module of its layer, and nothing else."""
    import re

    text = (PACKAGE.parent / "README.md").read_text()
    section = text.split("## Code layout", 1)[1].split("\n## ", 1)[0]
    rows = {row.split("|")[1].strip(): row.split("|")[2] for row in section.splitlines()
            if row.startswith("| ") and not row.startswith("| layer")}
    for layer, names in LAYERS.items():
        named = {n.replace("/", ".") for n in re.findall(r"`([a-z_/]+)`", rows[LAYER_NAMES[layer]])}
        assert named == set(names), (LAYER_NAMES[layer], named ^ set(names))
    devtools = {module_name(p, PACKAGE) for p in (PACKAGE / DEVTOOLS).glob("*.py") if p.name != "__init__.py"}
    assert all(f"`{m.split('.')[-1]}`" in section for m in devtools)
