"""Hostile input: values a job or a non-root user controls never reach a shell, never widen an
scontrol call, and never make a root hook read or replay something the user wrote.

scontrol is `[slurm] scontrol` = a recording script that appends its argv as JSON: every call
the product makes is checked element by element. Each hostile value would create MARK if any
shell ever saw it.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_hostile_slurm.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from support import REPO, healthy_snapshot_dict, write_json, xid_snapshot_dict
from slurmagent.state import host
from slurmagent.gpu import kernlog

XID79 = "slurmagent: xid 79 on gpu 3 (fallen off the bus)"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown, setpriv and the root-only checks")
DRAIN_N1 = ["update", "NodeName=n1", "State=DRAIN", f"Reason={XID79}"]

# Each would run `touch MARK` (or widen an scontrol call) if it met a shell or a hostlist.
HOSTILE = [
    "42; touch {mark}",
    "$(touch {mark})",
    "`touch {mark}`",
    "42\ntouch {mark}",
    "42' ; touch '{mark}",
    '42" && touch "{mark}',
    "42 | touch {mark}",
    "42,7",
    "n[1-3]",
    "n1 State=RESUME",
    "../../../{name}",
    "-h",
]

RECORDER = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open({log!r}, "a") as fh:
    fh.write(json.dumps(args) + "\\n")
nodes = {{"n1": "IDLE", "n2": "IDLE", "n3": "IDLE"}}
reasons = {{}}
if os.path.exists({nodes!r}):
    with open({nodes!r}) as fh:
        for name, (state, reason) in json.load(fh).items():
            nodes[name], reasons[name] = state, reason
if args[:3] == ["-o", "show", "node"]:
    names = [args[3]] if len(args) > 3 else list(nodes)
    if any(n not in nodes for n in names):
        print("Node " + names[0] + " not found", file=sys.stderr)
        sys.exit(1)
    for n in names:
        print(f"NodeName={{n}} State={{nodes[n]}} Gres=gpu:8 Reason={{reasons.get(n, '(null)')}}")
elif args[:3] == ["-o", "show", "job"]:
    print(f"JobId={{args[3]}} JobState=FAILED Restarts=0 Requeue=1")
"""


class Node:
    """A node's config + replay files + a recording scontrol, all under tmp_path."""

    def __init__(self, tmp_path: Path, **repair: object):
        self.tmp = tmp_path
        self.mark = tmp_path / "MARK"
        self.calls_log = tmp_path / "scontrol.jsonl"
        self.nodes_file = tmp_path / "nodes.json"
        self.scontrol = tmp_path / "bin" / "scontrol"
        self.scontrol.parent.mkdir()
        self.scontrol.write_text(RECORDER.format(python=sys.executable, log=str(self.calls_log),
                                                 nodes=str(self.nodes_file)))
        self.scontrol.chmod(0o755)
        self.snapshot = tmp_path / "snap.json"
        self.kern = tmp_path / "kern.log"
        self.kern.touch()
        (tmp_path / "slurm.conf").write_text("SchedulerParameters=nohold_on_prolog_fail\n")
        self.set_snapshot(xid_snapshot_dict(79, gpu=3))
        self.config = self.write_config(tmp_path / "config.toml", **repair)

    def write_config(self, path: Path, scontrol: Path | None = None, hooks: str = "",
                     endpoint: str = "http://127.0.0.1:9", **repair: object) -> Path:
        extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in {"max_drained_fraction": 1.0, **repair}.items())
        path.write_text(f'state_dir = "{self.tmp}/state/%n"\n'
                        f'[health]\nsnapshot = "{self.snapshot}"\nexpected_gpus = 8\nkernel_log = "{self.kern}"\n'
                        f'[hooks]\nsyslog = false\n{hooks}'
                        f'[slurm]\nscontrol = "{scontrol or self.scontrol}"\nconf = "{self.tmp}/slurm.conf"\n'
                        f'[gcp]\nproject = "p"\nzone = "z"\ncompute_endpoint = "{endpoint}"\n'
                        f'[repair]\n{extra}')
        path.chmod(0o644)
        return path

    def set_snapshot(self, data: dict) -> None:
        write_json(self.snapshot, data)

    def state(self, node: str = "n1") -> Path:
        return self.tmp / "state" / node

    def calls(self) -> list[list[str]]:
        if not self.calls_log.exists():
            return []
        return [json.loads(line) for line in self.calls_log.read_text().splitlines()]

    def slurmagent(self, *args: str, env: dict[str, str] | None = None, config: Path | None = None,
                   user: int | None = None) -> subprocess.CompletedProcess:
        # the environment slurmd gives a hook: no PATH, nothing from the job
        e = {"SLURMAGENT_CONFIG": str(config or self.config), "PYTHONPATH": str(REPO), **(env or {})}
        pre = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
        return subprocess.run([*pre, sys.executable, "-m", "slurmagent.entry", *args], env=e, capture_output=True,
                              text=True, timeout=60, cwd="/")


@pytest.fixture
def node(tmp_path) -> Node:
    return Node(tmp_path)


def hostile(template: str, node: Node) -> str:
    return template.format(mark=node.mark, name="escaped")


def test_recorder_sees_a_plain_epilog_requeue(node):
    """The control case: a well-formed job id does reach `scontrol requeue`, as one element."""
    proc = node.slurmagent("epilog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42", "SLURM_JOB_EXIT_CODE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert node.calls() == [["-o", "show", "node"], DRAIN_N1, ["requeue", "42"]]


@pytest.mark.parametrize("template", HOSTILE)
def test_hostile_job_id_and_exit_code_never_reach_scontrol(node, template):
    value = hostile(template, node)
    proc = node.slurmagent("epilog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": value,
                                          "SLURM_JOB_EXIT_CODE": value.replace("42", "1")})
    assert proc.returncode == 0, proc.stderr
    # the node is still drained with our clean reason; no requeue with a value we cannot trust
    assert node.calls() == [["-o", "show", "node"], DRAIN_N1]
    assert f"ignoring SLURM_JOB_ID {value!r}: not a job id" in proc.stderr
    assert f"unhealthy: {XID79}" in proc.stderr
    assert not node.mark.exists()
    decision = json.loads((node.state() / "hooks.log").read_text().splitlines()[-1])
    assert decision["verdict"] == "unhealthy" and "job" not in decision and decision["reason"] == XID79


@pytest.mark.parametrize("template", HOSTILE)
@pytest.mark.parametrize("policy", ["open", "closed"])
def test_hostile_node_name_is_refused_before_any_scontrol_call_or_path(node, template, policy):
    value = hostile(template, node)
    config = node.write_config(node.tmp / f"{policy}.toml", hooks=f'on_internal_error = "{policy}"\n')
    before = sorted(node.tmp.rglob("*"))
    proc = node.slurmagent("prolog", env={"SLURMD_NODENAME": value, "SLURM_JOB_ID": "42"}, config=config)
    assert proc.returncode == (1 if policy == "closed" else 0), proc.stderr
    assert node.calls() == []  # not even a `show node`: `n[1-3]` would have drained all three
    assert f"SLURMD_NODENAME {value!r} is not a Slurm node name" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not node.mark.exists()
    assert sorted(node.tmp.rglob("*")) == before  # no state dir, decision log or journal for that name
    assert not (node.tmp.parent.parent / "escaped").exists()  # where `../../../escaped` would lead


def test_hostile_node_name_for_root_commands_is_a_usage_error(node):
    for value in ("n[1-3]", "../x", "n1 State=RESUME", "n1,n2"):
        proc = node.slurmagent("healthcheck", env={"SLURMD_NODENAME": value})
        assert proc.returncode == 2 and proc.stderr == f"slurmagent: not a Slurm node name: {value!r} " \
                                                      "(--node or $SLURMD_NODENAME)\n", proc.stderr
    assert node.calls() == []


@pytest.mark.parametrize("template", HOSTILE[:7] + ["abc", "12;7", "n[1-3]"])
def test_release_held_refuses_a_non_numeric_job_id(node, template):
    value = hostile(template, node)
    proc = node.slurmagent("release-held", value, "--deadline", "1")
    assert proc.returncode == 2, proc.stderr
    assert "not a job id" in proc.stderr
    assert node.calls() == [] and not node.mark.exists()


# --- a non-root user cannot steer the root hooks ---------------------------------------------


def user_config(node: Node, how: str) -> Path:
    """A config that makes the hooks run the user's 'scontrol' (which would create MARK)."""
    evil = node.tmp / "evil-scontrol"
    evil.write_text(f"#!/bin/sh\ntouch {node.mark}\n")
    evil.chmod(0o755)
    d = node.tmp / "userdir"
    d.mkdir()
    cfg = node.write_config(d / "config.toml", scontrol=evil)
    if how == "file owned by nobody":
        os.chown(cfg, 65534, 65534)
    elif how == "dir owned by nobody":
        os.chown(d, 65534, 65534)
    elif how == "dir writable by all":
        d.chmod(0o777)
    elif how == "file group-writable":
        cfg.chmod(0o664)
    elif how == "symlink to a file owned by nobody":
        target = node.tmp / "user-owned.toml"
        shutil.copy(cfg, target)
        os.chown(target, 65534, 65534)
        cfg.unlink()
        cfg.symlink_to(target)
    return cfg


UNSAFE = ["file owned by nobody", "dir owned by nobody", "dir writable by all", "file group-writable",
          "symlink to a file owned by nobody"]


@needs_root
@pytest.mark.parametrize("how", UNSAFE)
def test_root_hook_refuses_a_config_a_user_controls(node, how):
    cfg = user_config(node, how)
    proc = node.slurmagent("prolog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"}, config=cfg)
    assert proc.returncode == 0  # internal error, fail open: not "GPU unhealthy"
    assert "internal error (not a GPU fault): config" in proc.stderr and "refused" in proc.stderr, proc.stderr
    assert not node.mark.exists()  # the user's scontrol never ran
    proc = node.slurmagent("healthcheck", env={"SLURMD_NODENAME": "n1"}, config=cfg)
    assert "refused" in proc.stderr and not node.mark.exists(), proc.stderr


@pytest.fixture
def cli(monkeypatch, capsys):
    from slurmagent.cli import main

    def run(*args: str, uid: int = 0) -> tuple[int, str, str]:
        monkeypatch.setattr(os, "geteuid", lambda: uid)
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_repair_refuses_non_root_unless_a_root_owned_config_allows_it(node, cli, tmp_path):
    code, out, err = cli("--config", str(node.config), "repair", uid=1000)
    assert code == 2 and out == ""
    assert err == ("slurmagent: repair must run as root (uid 1000): it drains nodes, requeues jobs and recreates "
                   "VMs; use --dry-run, or set [repair] allow_non_root = true in a root-owned config\n")
    assert node.calls() == []
    code, out, err = cli("--config", str(node.config), "repair", "--dry-run", uid=1000)
    assert code == 0 and "nothing to repair" in out, err

    allowed = node.write_config(tmp_path / "allow.toml", allow_non_root=True)
    code, out, err = cli("--config", str(allowed), "repair", uid=1000)
    assert code == 0 and "nothing to repair" in out, err
    assert ["-o", "show", "node"] in node.calls()

    os.chown(allowed, 65534, 65534)  # the user's own file cannot grant it
    code, _, err = cli("--config", str(allowed), "repair", uid=1000)
    assert code == 2 and "repair must run as root" in err


@needs_root
def test_repair_as_the_real_nobody_user_is_refused(node):
    d = Path(tempfile.mkdtemp(prefix="sa-hostile-", dir="/tmp"))
    try:
        d.chmod(0o755)
        cfg = node.write_config(d / "config.toml")
        proc = node.slurmagent("--config", str(cfg), "repair", "n1", user=65534)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("slurmagent: repair must run as root (uid 65534)")
        assert len(proc.stderr.splitlines()) == 1
    finally:
        shutil.rmtree(d)
    assert node.calls() == []


# --- state a user could have written is not trusted by root -----------------------------------


def plant_drain_of_n2(node: Node) -> Path:
    pending = node.state("n1") / "journal" / "pending"
    pending.mkdir(parents=True, mode=0o700)
    entry = {"id": "f" * 32, "kind": "drain", "created": time.time(), "attempts": 0, "last_error": "",
             "payload": {"node": "n2", "reason": "slurmagent: planted"}}
    path = pending / f"{time.time_ns():020d}-drain-ffffffffffff.json"
    path.write_text(json.dumps(entry))
    return path


@needs_root
@pytest.mark.parametrize("how", ["trusted (control)", "journal owned by nobody", "pending writable by all"])
def test_planted_journal_entries_are_not_replayed(node, how):
    node.set_snapshot(healthy_snapshot_dict(hostname="n1"))
    planted = plant_drain_of_n2(node)
    journal = planted.parent.parent
    if how == "journal owned by nobody":
        for p in (journal, planted.parent, planted):
            os.chown(p, 65534, 65534)
    elif how == "pending writable by all":
        planted.parent.chmod(0o777)
    proc = node.slurmagent("prolog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"})
    assert proc.returncode == 0, proc.stderr
    drains_of_n2 = [c for c in node.calls() if c[:2] == ["update", "NodeName=n2"]]
    if how.startswith("trusted"):
        assert drains_of_n2 == [["update", "NodeName=n2", "State=DRAIN", "Reason=slurmagent: planted"]]
        return
    assert drains_of_n2 == []
    assert f"refusing to replay {planted.parent}" in proc.stderr, proc.stderr
    assert planted.exists()  # left alone for the admin to look at


PCI_GPU3 = "0000:48:00"


@needs_root
@pytest.mark.parametrize("owner", [0, 65534])
def test_a_cursor_a_user_moved_past_an_xid_does_not_hide_it(node, owner):
    node.set_snapshot(healthy_snapshot_dict(hostname="n1"))
    node.kern.write_text(f"[ 12.0] NVRM: Xid (PCI:{PCI_GPU3}): 79, pid=1, name=x, GPU has fallen off the bus.\n")
    state = node.state("n1")
    state.mkdir(parents=True)
    cursor = kernlog.cursor_path(state)
    cursor.write_text(json.dumps({"boot_id": host.boot_id(), "source": f"file:{node.kern}",
                                  "position": node.kern.stat().st_size}))
    os.chown(cursor, owner, owner)
    proc = node.slurmagent("prolog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"})
    if owner == 0:  # the control: a root-written cursor says the XID was judged already
        assert proc.returncode == 0 and node.calls() == [], proc.stderr
        return
    assert proc.returncode == 1, proc.stderr
    assert f"ignoring kernel-log cursor {cursor}: owned by uid 65534" in proc.stderr
    assert node.calls()[-1] == DRAIN_N1
    assert os.stat(cursor).st_uid == 0  # replaced by root's own


# --- on the real cluster: hostile job names, comments and environment ------------------------


def test_a_process_name_chosen_by_the_job_cannot_talk_a_fatal_xid_down(node):
    """The kernel prints the faulting process's name (`name=<comm>`), which a job picks: a name
    like `x, Nonfatal` must not turn a fatal NVLink5 XID into a warning."""
    node.set_snapshot(healthy_snapshot_dict(hostname="n1"))
    node.kern.write_text(f"[ 9.0] NVRM: Xid (PCI:{PCI_GPU3}): 149, pid=4242, name=x, Nonfatal, "
                         "NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 0x00000000 0x00000000)\n")
    proc = node.slurmagent("prolog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"})
    assert proc.returncode == 1, proc.stderr
    drain = node.calls()[-1]
    assert drain[:3] == ["update", "NodeName=n1", "State=DRAIN"]
    assert drain[3].startswith("Reason=slurmagent: xid 149 on gpu 3 (") and drain[3].endswith("(fatal))")


# --- bad config values, arguments and files: one line, exit 2 (or, in a hook, an internal error) --


@pytest.mark.parametrize(("old", "new", "shown"), [
    ("[slurm]\n", "[slurm]\ntimeout_s = 1e308\n", "'slurm.timeout_s' = 1e+308 is out of range (0.5 .. 3600)"),
    ("[health]\n", "[health]\ntimeout_s = 0\n", "'health.timeout_s' = 0 is out of range (0.5 .. 3600)"),
    ("expected_gpus = 8", "expected_gpus = 100000000000000000000000",
     "'health.expected_gpus' = 100000000000000000000000 is out of range (0 .. 1024)"),
    ("max_drained_fraction = 1.0", "max_drained_fraction = 5", "'repair.max_drained_fraction' = 5 is out of range (0 .. 1)"),
])
def test_a_hook_with_an_out_of_range_config_reports_a_config_error(node, old, new, shown):
    """`slurm.timeout_s = 1e308` once overflowed a timer and the XID-79 prolog failed open as a
    mystery OverflowError; the value is now refused at load, as the config error it is."""
    text = node.config.read_text()
    assert old in text
    node.config.write_text(text.replace(old, new, 1))
    proc = node.slurmagent("prolog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"})
    assert proc.returncode == 0  # an internal error fails open by default: said, never "healthy"
    assert proc.stderr == (f"slurmagent prolog: internal error (not a GPU fault): config {node.config}: {shown}; "
                           "none (fail open)\n")
    assert node.calls() == []  # nothing ran under a config that was refused


@pytest.mark.parametrize("args", [["--config", "{cfg}", "prolog"], ["--config={cfg}", "prolog"],
                                  ["--debug", "--config", "{cfg}", "prolog"]])
def test_config_option_before_a_hook_is_honoured(node, args):
    args = [a.replace("{cfg}", str(node.config)) for a in args]
    absent = node.tmp / "absent.toml"
    proc = node.slurmagent(*args, env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42", "SLURMAGENT_CONFIG": str(absent)})
    assert proc.returncode == 1, proc.stderr  # XID 79 from the snapshot that --config names
    assert node.calls()[-1] == DRAIN_N1
    assert str(absent) not in proc.stderr


def test_a_deeply_nested_snapshot_in_a_hook_is_a_snapshot_error(node):
    node.snapshot.write_text('{"schema": 1, "gpus": ' + "[" * 100_000 + "]" * 100_000 + "}")
    proc = node.slurmagent("prolog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"})
    assert proc.returncode == 0
    assert proc.stderr == (f"slurmagent prolog: internal error (not a GPU fault): snapshot {node.snapshot} is not a "
                           "snapshot: JSON nested too deeply; none (fail open)\n")
    decision = json.loads((node.state() / "hooks.log").read_text().splitlines()[-1])
    assert decision["verdict"] == "internal-error" and "nested too deeply" in decision["error"]


def test_a_job_that_floods_xids_gets_a_bounded_decision_log_line(node):
    """A job can make the kernel print an application XID as often as it likes; each is a finding,
    and one decision line once reached 8.9 MB. The line is cut at 64 KiB with a marker; the verdict,
    the reason and the first findings stay."""
    node.set_snapshot(xid_snapshot_dict(79, gpu=3))
    line = f"[ 9.0] NVRM: Xid (PCI:{PCI_GPU3}): 13, pid=4242, name=x, Graphics Exception: ESR 0x{{:x}}\n"
    node.kern.write_text("".join(line.format(i) for i in range(20_000)))
    proc = node.slurmagent("prolog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"})
    assert proc.returncode == 1, proc.stderr
    (raw,) = (node.state() / "hooks.log").read_bytes().splitlines()
    assert len(raw) <= 64 * 1024
    decision = json.loads(raw)
    assert decision["verdict"] == "unhealthy" and decision["reason"] == XID79 and decision["truncated"] is True
    findings = decision["findings"]
    assert findings[0] == "xid 79 on gpu 3 (fallen off the bus)" and findings[1].startswith("xid 13 on gpu 3")
    assert findings[-1] == f"... {20_001 - (len(findings) - 1)} more (truncated)"


def run_limited(*args: str, config: Path, memory: int = 1 << 30) -> subprocess.CompletedProcess:
    """The CLI with its address space capped, so that an unbounded expansion fails instead of
    eating the machine."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = {"SLURMAGENT_CONFIG": str(config), "PYTHONPATH": str(REPO), "SLURMD_NODENAME": "ctl"}
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", *args], env=env, capture_output=True, text=True,
                          timeout=120, cwd="/", preexec_fn=cap)


@pytest.mark.parametrize(("expr", "error"), [
    ("n[1-100000000]", "hostlist 'n[1-100000000]' names 100000000 nodes, more than 65536"),
    ("n1,n[1-300][1-300]", "hostlist 'n1,n[1-300][1-300]' names 90001 nodes, more than 65536"),
    ("n[1-1" + "0" * 30 + "]", "bad range '1-1" + "0" * 30 + "' in hostlist 'n[1-1" + "0" * 30 + "]'"),
])
def test_repair_refuses_a_hostlist_too_large_to_expand(node, expr, error):
    proc = run_limited("repair", "--dry-run", expr, config=node.config)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == f"slurmagent: repair: {error}\n"
    assert node.calls() == []


def test_hostlist_at_the_limit_still_expands():
    from slurmagent.core import hostlist

    names = hostlist.expand("n[00001-65536]")
    assert len(names) == 65536 and names[0] == "n00001" and names[-1] == "n65536"
    with pytest.raises(ValueError, match="names 65537 nodes, more than 65536"):
        hostlist.expand("n[1-65536],x")
