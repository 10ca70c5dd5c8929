"""The one table of SLURM_* variables (slurmagent/slurm/env.py): its readers, and that the
package reads a SLURM_* variable nowhere else."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from slurmagent.run.agent_step import agent_env
from slurmagent.slurm import env as slurm_env

PACKAGE = Path(__file__).resolve().parents[2] / "slurmagent"
TABLE_MODULE = PACKAGE / "slurm" / "env.py"


def test_num_nodes_prefers_the_new_name_and_counts_one_outside_a_job() -> None:
    assert slurm_env.num_nodes({"SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "2"}) == 4
    assert slurm_env.num_nodes({"SLURM_NNODES": "2"}) == 2
    assert slurm_env.num_nodes({"SLURM_JOB_NUM_NODES": "", "SLURM_NNODES": "3"}) == 3
    assert slurm_env.num_nodes({}) == 1
    with pytest.raises(ValueError):
        slurm_env.num_nodes({"SLURM_JOB_NUM_NODES": "two"})


def test_job_id_takes_the_old_name_only_when_asked() -> None:
    assert slurm_env.job_id({"SLURM_JOB_ID": "42", "SLURM_JOBID": "7"}, old_name=True) == "42"
    assert slurm_env.job_id({"SLURM_JOBID": "7"}, old_name=True) == "7"
    assert slurm_env.job_id({"SLURM_JOBID": "7"}) is None
    assert slurm_env.job_id({"SLURM_JOB_ID": ""}) is None
    assert slurm_env.job_id({}) is None


def test_array_task_id_needs_both_halves() -> None:
    assert slurm_env.array_task_id({"SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}) == "40_3"
    assert slurm_env.array_task_id({"SLURM_ARRAY_JOB_ID": "40"}) is None
    assert slurm_env.array_task_id({"SLURM_ARRAY_TASK_ID": "3"}) is None


@pytest.mark.parametrize("raw, expected", [("3", 3), ("0", 0), ("", 0), (None, 0), ("x", 0), ("-2", 0)])
def test_restart_count_is_never_negative_nor_an_error(raw, expected) -> None:
    env = {} if raw is None else {"SLURM_RESTART_COUNT": raw}
    assert slurm_env.restart_count(env) == expected


def test_node_name_is_slurmds_else_the_short_host_name() -> None:
    assert slurm_env.node_name({"SLURMD_NODENAME": "a3-7"}, "vm.zone.internal") == "a3-7"
    assert slurm_env.node_name({}, "vm-1.us-central1-a.c.proj.internal") == "vm-1"
    assert slurm_env.node_name({"SLURMD_NODENAME": ""}, "plain") == "plain"
    assert slurm_env.slurmd_node({}) is None and slurm_env.slurmd_node({"SLURMD_NODENAME": "n1"}) == "n1"


def test_node_list_step_and_node_index() -> None:
    assert slurm_env.node_list({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODELIST": "old"}) == "n[1-2]"
    assert slurm_env.node_list({"SLURM_NODELIST": "n[3-4]"}) == "n[3-4]"
    assert slurm_env.node_list({}) == ""
    assert (slurm_env.step_num_tasks({}), slurm_env.step_num_tasks({"SLURM_STEP_NUM_TASKS": "8"})) == (1, 8)
    assert (slurm_env.node_index({}), slurm_env.node_index({"SLURM_NODEID": "5"})) == (0, 5)
    assert slurm_env.step_id({"SLURM_STEP_ID": "batch"}) == "batch" and slurm_env.step_id({}) is None
    assert slurm_env.job_exit_code({"SLURM_JOB_EXIT_CODE": "256"}) == "256"
    assert slurm_env.conf({"SLURM_CONF": "/etc/x.conf"}) == "/etc/x.conf" and slurm_env.conf({}) is None


def test_every_name_is_in_the_table() -> None:
    names = {v for k, v in vars(slurm_env).items() if k.isupper() and isinstance(v, str) and k != "TYPE_CHECKING"}
    assert names == set(slurm_env.VARIABLES)
    assert all(n.startswith(("SLURM_", "SLURMD_")) for n in names)


def test_the_agent_step_keeps_every_variable_slurmagent_reads() -> None:
    # the node agents read their node index, job and node count from the step's environment
    env = {name: "1" for name in slurm_env.VARIABLES} | {"SLURM_NTASKS": "8", "SLURM_LABELIO": "1"}
    assert agent_env(env) == {name: "1" for name in slurm_env.VARIABLES}


# --- no SLURM_* read outside the table -------------------------------------------------------


def slurm_reads(source: str) -> list[str]:
    """`X.get("SLURM_...")`, `X.getenv("SLURM_...")`, `X["SLURM_..."]`, `"SLURM_..." in X` in `source`."""
    found = []

    def slurm_name(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(("SLURM_", "SLURMD_")):
            return node.value
        return None

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("get", "getenv", "pop", "setdefault") and slurm_name(node.args[0]):
                found.append(f"{node.lineno}: {slurm_name(node.args[0])}")
        elif isinstance(node, ast.Subscript) and slurm_name(node.slice):
            found.append(f"{node.lineno}: {slurm_name(node.slice)}")
        elif isinstance(node, ast.Compare) and slurm_name(node.left) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            found.append(f"{node.lineno}: {slurm_name(node.left)}")
    return found


def test_the_scanner_finds_reads() -> None:
    src = ('import os\nenv = os.environ\na = env.get("SLURM_JOB_ID")\nb = os.getenv("SLURMD_NODENAME")\n'
           'c = env["SLURM_NNODES"]\nd = "SLURM_X" in env\ne = f"{env[\'SLURM_STEP_ID\']}"\n'
           'f = env.get(NAME)\ng = "SLURM_JOB_ID is a message"\n')
    assert slurm_reads(src) == ["3: SLURM_JOB_ID", "4: SLURMD_NODENAME", "5: SLURM_NNODES", "6: SLURM_X",
                                "7: SLURM_STEP_ID"]


def test_no_module_reads_a_slurm_variable_outside_the_table() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == TABLE_MODULE or "devtools" in path.parts:  # the dev harness stands outside
            continue
        reads = slurm_reads(path.read_text())
        if reads:
            offenders[str(path.relative_to(PACKAGE))] = reads
    assert offenders == {}


def test_the_table_imports_nothing() -> None:
    # the healthy prolog imports it: it must not pull in a module of its own
    probe = "import sys; before = set(sys.modules); import slurmagent.slurm.env; print(sorted(set(sys.modules) - before))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=PACKAGE.parent, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(["slurmagent", "slurmagent.slurm", "slurmagent.slurm.env"])
