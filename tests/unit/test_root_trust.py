"""Root trusts nothing a user wrote: the config every root command reads, the files in the state
dir, the interpreter's module path, the text of a job's record and batch script, and another
node's expiry state.

scontrol is the recording script of test_hostile (every call is checked); a user's "scontrol"
creates MARK, so a MARK on disk means root ran something a user controls.

Its tests that need the cluster, the emulator or a fake server: tests/cluster/test_root_trust_slurm.py.
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

from support import REPO, healthy_snapshot_dict, wait_for
from slurmagent.state import host
from test_hostile import DRAIN_N1, Node, needs_root

NOBODY = 65534
SLURMAGENT_BIN = Path(sys.executable).with_name("slurmagent")  # the installed console script


@pytest.fixture
def node(tmp_path) -> Node:
    return Node(tmp_path)


def evil_scontrol(node: Node) -> Path:
    evil = node.tmp / "evil-scontrol"
    evil.write_text(f"#!/bin/sh\ntouch {node.mark}\n")
    evil.chmod(0o755)
    return evil


@pytest.fixture
def open_dir():
    """A root-owned directory under /tmp that the `nobody` user can reach (tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="sa-trust-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


# --- the config of every root command ---------------------------------------------------------


def plant_trusted_drain(node: Node) -> None:
    """A root-written journal entry, so `journal --replay` has an scontrol call to make."""
    pending = node.state("n1") / "journal" / "pending"
    pending.mkdir(parents=True, mode=0o700)
    entry = {"id": "e" * 32, "kind": "drain", "created": time.time(), "attempts": 0, "last_error": "",
             "payload": {"node": "n2", "reason": "slurmagent: replayed"}}
    (pending / f"{time.time_ns():020d}-drain-eeeeeeeeeeee.json").write_text(json.dumps(entry))


ROOT_COMMANDS = [("repair",), ("status",), ("journal", "--replay", "--node", "n1")]


@needs_root
@pytest.mark.parametrize("command", ROOT_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_root_commands_refuse_a_config_any_user_can_write(node, command):
    plant_trusted_drain(node)
    cfg = node.write_config(node.tmp / "open.toml", scontrol=evil_scontrol(node))
    cfg.chmod(0o666)
    proc = node.slurmagent("--config", str(cfg), *command, env={"SLURMD_NODENAME": "n1"})
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith(f"slurmagent: config {cfg}: refused: {cfg} is writable by non-root users"), line
    assert not node.mark.exists()  # the user's "scontrol" never ran as root

    proc = node.slurmagent("--config", str(node.config), *command, env={"SLURMD_NODENAME": "n1"})  # root's own
    assert "refused" not in proc.stderr and node.calls(), proc.stderr


def trusted_config(node: Node, where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    where.chmod(0o755)
    return node.write_config(where / "real.toml")


@needs_root
@pytest.mark.parametrize("how", ["symlink in a world-writable dir", "a user's symlink in a sticky dir",
                                 "root's symlink in a user's dir"])
def test_a_config_symlink_a_user_can_flip_is_refused(node, open_dir, how):
    """The link itself, and every directory on the way to it, is checked; not only the target's."""
    target = trusted_config(node, open_dir / "etc")
    d = open_dir / "dir"
    d.mkdir()
    link = d / "config.toml"
    link.symlink_to(target)
    if how == "symlink in a world-writable dir":
        d.chmod(0o777)
    elif how == "a user's symlink in a sticky dir":
        d.chmod(0o1777)
        os.lchown(link, NOBODY, NOBODY)
    else:
        os.chown(d, NOBODY, NOBODY)
    proc = node.slurmagent("prolog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"}, config=link)
    assert proc.returncode == 0, proc.stderr  # internal error, fail open: not "GPU unhealthy"
    assert "internal error (not a GPU fault): config" in proc.stderr and "refused" in proc.stderr, proc.stderr
    assert node.calls() == []


@needs_root
def test_a_root_symlink_between_root_owned_files_is_followed(node, open_dir):
    """What config management does (config.toml -> config.toml.v2) keeps working."""
    target = trusted_config(node, open_dir / "etc")
    link = open_dir / "etc" / "config.toml"
    link.symlink_to(target.name)
    proc = node.slurmagent("epilog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"}, config=link)
    assert proc.returncode == 0 and node.calls()[-1] == DRAIN_N1, proc.stderr


FLIPPER = r"""
import os, sys, time
d, safe, evil_text = sys.argv[1], sys.argv[2], sys.argv[3]
cfg, end = os.path.join(d, "config.toml"), time.monotonic() + float(sys.argv[4])
while time.monotonic() < end:
    with open(os.path.join(d, "evil.tmp"), "w") as fh:
        fh.write(evil_text)
    os.rename(os.path.join(d, "evil.tmp"), cfg)
    os.symlink(safe, os.path.join(d, "link.tmp"))
    os.rename(os.path.join(d, "link.tmp"), cfg)
"""


@needs_root
def test_a_config_flipped_between_check_and_read_is_never_used(node, open_dir):
    """`nobody` flips its entry in a sticky directory between its own config and a symlink to
    root's: what root checks and what root reads are the same open file, so never the user's."""
    from slurmagent.errors import ConfigError
    from slurmagent.state.config import load

    safe = trusted_config(node, open_dir / "etc")
    evil = node.write_config(node.tmp / "evil.toml", scontrol=evil_scontrol(node)).read_text()
    sticky = open_dir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    flipper = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                sys.executable, "-c", FLIPPER, str(sticky), str(safe), evil, "20"])
    used, refused = [], 0
    try:
        wait_for(lambda: (sticky / "config.toml").exists() or os.path.islink(sticky / "config.toml"), 10, "the flips")
        end = time.monotonic() + 8
        while time.monotonic() < end and not used:
            try:
                cfg = load(str(sticky / "config.toml"), for_root_hook=True)
            except ConfigError as exc:
                refused += 1
                assert "refused" in str(exc) or "not found" in str(exc), exc
                continue
            used.append(cfg.slurm.scontrol)
    finally:
        flipper.kill()
        flipper.wait()
    assert used == [] and refused > 0  # neither the user's file nor the user's link is ever read


# --- the interpreter's module path ------------------------------------------------------------


def evil_package(node: Node) -> Path:
    """A directory holding `slurmagent/__init__.py` that creates MARK when imported."""
    cwd = node.tmp / "userdir"
    (cwd / "slurmagent").mkdir(parents=True)
    (cwd / "slurmagent" / "__init__.py").write_text(f"open({str(node.mark)!r}, 'w').close()\n")
    return cwd


@pytest.mark.skipif(not SLURMAGENT_BIN.exists(), reason="needs the installed console script")
def test_the_release_watcher_never_imports_slurmagent_from_the_cwd(node):
    (node.tmp / "slurm.conf").write_text("SchedulerParameters=bf_interval=2\n")  # held on prolog failure
    cwd = evil_package(node)
    env = {"SLURMAGENT_CONFIG": str(node.config), "SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"}
    proc = subprocess.run([str(SLURMAGENT_BIN), "prolog"], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and node.calls()[1] == DRAIN_N1, proc.stderr
    wait_for(lambda: node.mark.exists() or ["-o", "show", "job", "42"] in node.calls(), 30,
             "the release watcher to ask about job 42")
    assert not node.mark.exists()


FAKE_SBATCH = """#!{python}
import shutil, sys
script = next(a for a in sys.argv[1:] if "slurmagent-sbatch-" in a)
shutil.copy(script, {copy!r})
print("4242")
"""


def test_the_generated_batch_script_never_imports_slurmagent_from_the_cwd(node):
    from slurmagent.state.config import load
    from slurmagent.run.main import submit

    sbatch, copy = node.tmp / "bin" / "sbatch", node.tmp / "batch.sh"
    sbatch.write_text(FAKE_SBATCH.format(python=sys.executable, copy=str(copy)))
    sbatch.chmod(0o755)
    cfg = node.tmp / "submit.toml"
    cfg.write_text(node.config.read_text().replace("[slurm]\n", f'[slurm]\nsbatch = "{sbatch}"\n'))
    assert submit(load(str(cfg)), ["-N1", "--", "--ckpt-dir", str(node.tmp / "ck"), "--", "true"]) == 0
    cwd = evil_package(node)  # the job starts in the user's submit directory
    env = {"SLURMAGENT_CONFIG": str(cfg), "PATH": os.environ["PATH"], "HOME": str(node.tmp)}
    proc = subprocess.run(["/bin/sh", str(copy), "--ckpt-dir", str(node.tmp / "ck"), "--", "true"], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=60)
    assert not node.mark.exists(), proc.stderr
    assert proc.returncode == 0, proc.stderr


# --- the state dir ---------------------------------------------------------------------------


def sticky_state_config(node: Node, open_dir: Path) -> tuple[Path, Path]:
    """A config whose state dir is a `%n` path in a sticky world-writable dir, like /tmp."""
    sticky = open_dir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    cfg = node.tmp / "sticky.toml"
    cfg.write_text(node.config.read_text().replace(f'state_dir = "{node.tmp}/state/%n"',
                                                   f'state_dir = "{sticky}/sa-%n"'))
    return cfg, sticky / "sa-n1"


PLANTED = ["file owned by nobody", "dir a user created in a sticky dir", "symlink to a root-owned file"]


def plant(node: Node, open_dir: Path, how: str, files: dict[str, str]) -> tuple[Path, Path]:
    """Put `files` in the state dir of n1 the way `how` says; returns (config, state dir)."""
    cfg, state = node.config, node.state("n1")
    if how == "dir a user created in a sticky dir":
        cfg, state = sticky_state_config(node, open_dir)
    state.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = state / name
        if how == "symlink to a root-owned file":
            real = node.tmp / f"root-owned-{name}"
            real.write_text(text)
            path.symlink_to(real)
        else:
            path.write_text(text)
        if how == "file owned by nobody":
            os.chown(path, NOBODY, NOBODY)
    if how == "dir a user created in a sticky dir":
        os.chown(state, NOBODY, NOBODY)  # the files in it are root's: the directory alone decides
    return cfg, state


def expiry_text(seconds_left: float) -> str:
    end = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds_left))
    return json.dumps({"schema": 1, "boot_id": host.boot_id(), "termination_time": end, "source": "config"})


@needs_root
@pytest.mark.parametrize("how", ["root's own (control)", *PLANTED])
def test_a_planted_expiry_state_does_not_drain_a_healthy_node(node, open_dir, how):
    node.set_snapshot(healthy_snapshot_dict(hostname="n1"))
    if how.startswith("root's own"):
        cfg, path = node.config, node.state("n1") / "expiry.json"
        path.parent.mkdir(parents=True)
        path.write_text(expiry_text(600))
    else:
        cfg, state = plant(node, open_dir, how, {"expiry.json": expiry_text(600)})
        path = state / "expiry.json"
    proc = node.slurmagent("prolog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"}, config=cfg)
    drains = [c for c in node.calls() if c[:3] == ["update", "NodeName=n1", "State=DRAIN"]]
    if how.startswith("root's own"):  # a job with no time limit outlives the VM: requeued off it
        assert proc.returncode == 1 and drains and drains[0][3].startswith("Reason=slurmagent: expiry"), proc.stderr
        return
    assert proc.returncode == 0 and drains == [], proc.stderr
    assert f"ignoring {path}: " in proc.stderr, proc.stderr


def recent_healthy_prolog() -> str:
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    return json.dumps({"time": now, "event": "prolog", "node": "n1", "verdict": "healthy", "action": "none"}) + "\n"


@needs_root
@pytest.mark.parametrize("how", ["root's own (control)", *PLANTED])
def test_a_forged_decision_log_does_not_make_healthcheck_skip_an_xid79_node(node, open_dir, how):
    if how.startswith("root's own"):
        cfg = node.config
        node.state("n1").mkdir(parents=True)
        (node.state("n1") / "hooks.log").write_text(recent_healthy_prolog())
    else:
        plant(node, open_dir, how, {"hooks.log": recent_healthy_prolog()})
        cfg = node.config if how != "dir a user created in a sticky dir" else node.tmp / "sticky.toml"
    proc = node.slurmagent("healthcheck", env={"SLURMD_NODENAME": "n1"}, config=cfg)
    if how.startswith("root's own"):  # a prolog judged the node a moment ago: no NVML read
        assert proc.returncode == 0 and node.calls() == [], proc.stderr
        return
    assert proc.returncode == 1 and node.calls() and node.calls()[-1] == DRAIN_N1, proc.stderr


@needs_root
@pytest.mark.parametrize("how", PLANTED)
def test_state_files_a_user_could_have_written_are_ignored_by_root(node, open_dir, how, capsys):
    """Every reader of the state dir: repair state, the breaker's mark, the kernel-log cursor, metrics."""
    from slurmagent.gpu import kernlog
    from slurmagent.state import metrics, repair_state

    text = {"repair-state.json": json.dumps({"history": {"n9": [time.time()] * 5}}),
            repair_state.SUPPRESSED_MARKER: f"{time.time():.3f}\n",
            kernlog.CURSOR_FILE: json.dumps({"boot_id": host.boot_id(), "source": "file:/x", "position": 99}),
            "metrics.json": json.dumps({"slurmagent_drains_total": 1e9})}
    _, state = plant(node, open_dir, how, text)
    assert repair_state.load_state(state) == {}
    assert repair_state.has_marker(state) is False
    assert kernlog.load_cursor(state) is None
    assert metrics.read_values(state) == {}
    metrics.Metrics(state).update(add={("slurmagent_drains_total", ()): 1})
    if how != "dir a user created in a sticky dir":  # root starts its counters afresh, the user's 1e9 ignored
        values = metrics.read_values(state)
        assert {k: v for k, v in values.items() if not k.startswith("slurmagent_build_info")} == {
            "slurmagent_drains_total": 1.0}


@needs_root
def test_lock_files_a_user_pointed_elsewhere_create_nothing_and_the_verdict_stands(node):
    """Root's lock files in a user-made state dir: a dangling link there never makes root create
    the file it points at (an empty /etc/nologin would lock users out), and the XID still counts."""
    node.set_snapshot(healthy_snapshot_dict(hostname="n1"))
    node.kern.write_text("[ 12.0] NVRM: Xid (PCI:0000:48:00): 79, pid=1, name=x, GPU has fallen off the bus.\n")
    state = node.state("n1")
    state.mkdir(parents=True)
    targets = {name: node.tmp / f"created-by-root-{name}" for name in ("kernlog.lock", "metrics.lock")}
    for name, target in targets.items():
        (state / name).symlink_to(target)
        os.lchown(state / name, NOBODY, NOBODY)
    os.chown(state, NOBODY, NOBODY)
    proc = node.slurmagent("prolog", env={"SLURMD_NODENAME": "n1", "SLURM_JOB_ID": "42"})
    assert proc.returncode == 1 and node.calls()[-1] == DRAIN_N1, proc.stderr
    assert [t for t in targets.values() if os.path.lexists(t)] == []


# --- another node's expiry state --------------------------------------------------------------


def test_the_expiry_copy_for_wrappers_is_per_node_by_default():
    from slurmagent.state import expiry_state
    from slurmagent.state.config import Config

    # two slurmd on one host never read each other's termination time (their state_dir has a %n too)
    assert expiry_state.run_file(Config(), "n1") == Path("/run/slurmagent/n1/expiry.json")
    assert expiry_state.run_file(Config(), "n2") == Path("/run/slurmagent/n2/expiry.json")
    cfg = Config(state_dir="/var/lib/slurmagent/%n")
    assert set(expiry_state.files_for(cfg, "n1")).isdisjoint(expiry_state.files_for(cfg, "n2"))


def test_the_wrapper_reads_its_own_nodes_expiry_state():
    from slurmagent.state.config import Config
    from slurmagent.run.main import build_options
    from slurmagent.run.job import JobIdentity

    env = {"SLURMD_NODENAME": "n2", "SLURM_JOB_ID": "7"}
    opts = build_options(Config(), ["true"], env, JobIdentity.from_env(env))
    assert [str(p) for p in opts.expiry_files] == ["/var/lib/slurmagent/expiry.json",
                                                   "/run/slurmagent/n2/expiry.json"]
    opts = build_options(Config(), ["true"], {}, JobIdentity.from_env({}))  # outside Slurm: this host's name
    assert f"/run/slurmagent/{host.node_name(None, {})}/expiry.json" in [str(p) for p in opts.expiry_files]


# --- a job's free text imitating scontrol's fields --------------------------------------------

REAL_MIDDLE = ("UserId=alice(1000) GroupId=alice(1000) MCS_label=N/A Priority=1 Nice=0 Account=(null) QOS=(null) "
               "JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 "
               "RunTime=00:00:05 TimeLimit=02:00:00 TimeMin=N/A SubmitTime=2026-11-30T10:00:00 EligibleTime=Unknown "
               "StartTime=2026-11-30T10:00:01 EndTime=2026-11-30T12:00:01 Partition=gpu NodeList=n1 BatchHost=n1 "
               "Features=(null) Command=/home/alice/job.sh WorkDir={workdir} Comment={comment} "
               "StdErr=/home/alice/out StdIn=/dev/null StdOut=/home/alice/out Power=")
FORGED = "JobState=PENDING Reason=JobHeldAdmin TimeLimit=00:01:00"


def job_answer(name: str = "train", comment: str = "(null)", workdir: str = "/home/alice") -> str:
    return f"JobId=42 JobName={name} " + REAL_MIDDLE.format(comment=comment, workdir=workdir) + " \n"


class SlurmAnswers:
    """scontrol and squeue as a fake runner: canned answers, every argv recorded."""

    def __init__(self, scontrol_out: str, squeue_out: str = "42|RUNNING|0|1|1|2:00:00|2026-11-30T12:00:01|n1|None\n"):
        self.scontrol_out, self.squeue_out, self.argvs = scontrol_out, squeue_out, []

    def __call__(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        self.argvs.append(argv)
        out = self.scontrol_out if argv[0] == "scontrol" else self.squeue_out
        return subprocess.CompletedProcess(argv, 0, out, "")


HOSTILE_TEXT = {
    "comment": job_answer(comment=f"x {FORGED}"),
    "job name": job_answer(name=f"x {FORGED}"),
    "name and comment": job_answer(name=f"x UserId=a(1) {FORGED} Comment=c", comment=f"c {FORGED}"),
    "work dir": job_answer(workdir=f"/tmp/a {FORGED}"),
    "newline record": job_answer(name=f"x\nJobId=42 {FORGED}"),
    "newline cut": job_answer(name="x\nJobId=43 Comment=y"),
    "newline field": job_answer(comment=f"c\n   {FORGED}"),
}


@pytest.mark.parametrize("where", list(HOSTILE_TEXT))
def test_a_jobs_free_text_never_passes_for_its_fields(where):
    from slurmagent.slurm.commands import Slurm

    answers = SlurmAnswers(HOSTILE_TEXT[where])
    job = Slurm(runner=answers).job("42")
    assert (job.job_id, job.state, job.reason, job.time_limit, job.held) == ("42", "RUNNING", "None", "2:00:00", False)
    assert (job.node_list, job.restarts, job.requeue) == ("n1", 0, True)
    # the fields come from a listing without free text once the record is ambiguous
    assert answers.argvs[-1][:5] == ["squeue", "-h", "-j", "42", "-t"]


def test_an_honest_job_record_is_read_in_one_call():
    from slurmagent.slurm.commands import Slurm

    answers = SlurmAnswers(job_answer(name="lr=0.1 bs=64", comment="resume from step=100"))
    job = Slurm(runner=answers).job("42")
    assert (job.state, job.time_limit, job.node_list) == ("RUNNING", "02:00:00", "n1")
    assert job.raw["Comment"] == "resume from step=100" and job.raw["JobName"] == "lr=0.1 bs=64"
    assert [a[0] for a in answers.argvs] == ["scontrol"]


def test_an_ambiguous_record_that_squeue_cannot_settle_reads_as_unknown():
    from slurmagent.slurm.commands import Slurm

    job = Slurm(runner=SlurmAnswers(HOSTILE_TEXT["comment"], squeue_out="")).job("42")
    assert job.ambiguous and job.state == "" and job.time_limit == "" and not job.held


def test_the_comment_of_a_node_or_job_keeps_its_imitated_fields_as_text():
    from slurmagent.slurm.model import node_from_kv, parse_kv

    kv = parse_kv(job_answer(comment=f"x {FORGED}").strip())
    assert kv["JobState"] == "RUNNING" and kv["TimeLimit"] == "02:00:00" and kv["Comment"] == f"x {FORGED}"
    n = node_from_kv(parse_kv("NodeName=n1 State=IDLE+DRAIN Reason=swap PSU State=IDLE [root@2026-11-30T10:00:00]"))
    assert n.drained and n.reason == "swap PSU State=IDLE"  # an admin's reason cannot undrain the node


# --- the wrapped-job detection on a user's batch script --------------------------------------

DETECT = """
import sys
from slurmagent.slurm.model import script_execs_wrapper
mb = 4 * 1024 * 1024
tail = sys.argv[1]
print(script_execs_wrapper("#!/bin/sh\\nexec " + "slurmagent " * (mb // 11) + tail + "\\n"),
      script_execs_wrapper("#!/bin/sh\\n" + ("exec slurmagent slurmagent x\\n" * (mb // 28)) + "exec " + tail + "\\n"),
      script_execs_wrapper("#!/bin/sh\\nexec " + "a" * mb + "slurmagent " + tail + "\\n"))
"""


@pytest.mark.parametrize("tail,wrapped", [("python x.py", "False False False"), ("run -- x", "True False True")])
def test_wrapped_detection_on_a_4mb_adversarial_script(tail, wrapped):
    """Quadratic detection takes hours on these (bench/wrapped_detection.py has the figures);
    the generous timeout only separates "finished" from "hung"."""
    proc = subprocess.run([sys.executable, "-c", DETECT, tail], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == wrapped.split(), proc.stderr


@pytest.mark.parametrize("script,wrapped", [
    ("#!/bin/bash\nexec slurmagent run -- python train.py\n", True),
    ("exec\tenv A=1 python -m slurmagent.entry --config /c run --grace 5 -- x\n", True),
    ("  exec /opt/sa/bin/slurmagent run\n", True),
    ("exec slurmagent.cli run\r\n", True),
    ("exec slurmagent run", True),
    ("exec slurmagent --x # run\n", False),
    ("exec # slurmagent run\n", False),
    ("exec a#slurmagent run\n", False),
    ("exec slurmagentx run\n", False),
    ("exec slurmagent running\n", False),
    ("exec run slurmagent\n", False),
    ("execx slurmagent run\n", False),
    ("echo exec slurmagent run\n", False),
    ("exec slurmagent\nrun\n", False),
])
def test_wrapped_detection_cases(script, wrapped):
    from slurmagent.slurm.model import script_execs_wrapper

    assert script_execs_wrapper(script) is wrapped
