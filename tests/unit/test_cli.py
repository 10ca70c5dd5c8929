"""The command line as a user types it: `--config` before a hook, and the `--` forms of
`sbatch` and `run` from docs/user/wrapper.md, parsed exactly as written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

SBATCH_RECORDER = """#!{python}
import json, sys
with open({log!r}, "a") as fh:
    fh.write(json.dumps(sys.argv[1:]) + "\\n")
print("77")
"""


def slurmagent(*args: str, config: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(SLURMAGENT_CONFIG=str(config), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "slurmagent.entry", *args], env=env, capture_output=True, text=True,
                          timeout=60, cwd=cwd)


# `scontrol show config` as the controller answers it: tmp_path/show-config, else unreachable (exit 1)
SCONTROL_FAKE = """#!/bin/sh
echo "$@" >> {log}
[ -f {answer} ] && exec cat {answer}
echo "slurm_load_ctl_conf error: Unable to contact slurm controller (connect failure)" >&2
exit 1
"""


@pytest.fixture
def sbatch_log(tmp_path) -> Path:
    log = tmp_path / "sbatch.jsonl"
    recorder = tmp_path / "sbatch"
    recorder.write_text(SBATCH_RECORDER.format(python=sys.executable, log=str(log)))
    recorder.chmod(0o755)
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(SCONTROL_FAKE.format(log=tmp_path / "scontrol.log", answer=tmp_path / "show-config"))
    scontrol.chmod(0o755)
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n[slurm]\nsbatch = "{recorder}"\n'
                                     f'scontrol = "{scontrol}"\n')
    return log


@pytest.mark.parametrize(
    ("argv", "sbatch_opts", "run_args"),
    [
        # docs/user/wrapper.md: "or, simpler, `slurmagent sbatch -N1 --gres=gpu:8 -- python train.py`"
        (["-N1", "--gres=gpu:8", "--", "python", "train.py"], ["-N1", "--gres=gpu:8"], ["--", "python", "train.py"]),
        (["--", "python", "train.py"], [], ["--", "python", "train.py"]),
        (["--parsable", "--exclusive", "--", "--grace", "120", "--", "python", "train.py", "--", "--lr=3"],
         ["--parsable", "--exclusive"], ["--grace", "120", "--", "python", "train.py", "--", "--lr=3"]),
        # forms that worked before and still do
        (["-t", "4:00:00", "--", "--grace", "120", "--", "python", "train.py"], ["-t", "4:00:00"],
         ["--grace", "120", "--", "python", "train.py"]),
        (["-N", "4", "--", "srun", "python", "train.py"], ["-N", "4"], ["--", "srun", "python", "train.py"]),
    ],
)
def test_sbatch_takes_the_readme_forms_with_the_separator_intact(tmp_path, sbatch_log, argv, sbatch_opts, run_args):
    proc = slurmagent("sbatch", *argv, config=tmp_path / "c.toml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "77\n"
    (call,) = [json.loads(line) for line in sbatch_log.read_text().splitlines()]
    script = next(a for a in call if a.endswith(".sh"))
    at = call.index(script)
    assert call[:at] == [*sbatch_opts, "--requeue", "--open-mode=append", "--signal=B:USR1@300"]
    assert call[at + 1:] == run_args


@pytest.mark.parametrize(("argv", "env", "modes"), [
    (["-N1"], {}, ["--open-mode=append"]),  # a requeue keeps the first attempt's output
    (["--open-mode=truncate"], {}, ["--open-mode=truncate"]),
    (["--open-mode", "truncate"], {}, ["--open-mode"]),
    ([], {"SBATCH_OPEN_MODE": "truncate"}, []),  # sbatch reads the user's environment itself
])
def test_sbatch_appends_the_jobs_output_unless_the_user_chose_a_mode(tmp_path, sbatch_log, monkeypatch, argv, env, modes):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    proc = slurmagent("sbatch", *argv, "--", "true", config=tmp_path / "c.toml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (call,) = [json.loads(line) for line in sbatch_log.read_text().splitlines()]
    assert [a for a in call if a.startswith("--open-mode")] == modes


CONFIG_2605 = """Configuration data as of 2026-12-02T01:46:05
AuthInfo                = cred_expire=20,socket=/run/munge/munge.socket.2
MetricsType             = metrics/openmetrics
SlurmctldParameters     = {params}
SlurmctldPort           = 6817
SLURM_VERSION           = 26.05.5
"""


def submitted_requeue(tmp_path, sbatch_log, *argv: str) -> tuple[list[str], str]:
    """The requeue options `slurmagent sbatch ARGV -- true` passed to sbatch, and its stderr."""
    proc = slurmagent("sbatch", *argv, "--", "true", config=tmp_path / "c.toml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (call,) = [json.loads(line) for line in sbatch_log.read_text().splitlines()]
    return [a for a in call if "requeue" in a], proc.stderr


def test_sbatch_asks_for_the_expedited_requeue_where_the_controller_enables_it(tmp_path, sbatch_log):
    (tmp_path / "show-config").write_text(CONFIG_2605.format(params="enable_configless,enable_expedited_requeue"))
    options, stderr = submitted_requeue(tmp_path, sbatch_log, "-N1")
    assert options == ["--requeue=expedite"]
    assert "--requeue=expedite (Slurm 26.05.5" in stderr and "REQUEUE_HOLD" in stderr
    assert (tmp_path / "scontrol.log").read_text().split("\n")[0] == "show config"


def test_sbatch_asks_for_the_plain_requeue_where_expedite_is_off_or_unknown(tmp_path, sbatch_log):
    (tmp_path / "show-config").write_text(CONFIG_2605.format(params="enable_configless"))
    assert submitted_requeue(tmp_path, sbatch_log) == (["--requeue"], "")
    sbatch_log.unlink()
    (tmp_path / "show-config").unlink()  # slurmctld unreachable: as before 25.11, sbatch says the rest
    assert submitted_requeue(tmp_path, sbatch_log) == (["--requeue"], "")


@pytest.mark.parametrize("own", [["--no-requeue"], ["--requeue"], ["--requeue=expedite"]])
def test_sbatch_keeps_the_users_own_requeue_choice(tmp_path, sbatch_log, own):
    (tmp_path / "show-config").write_text(CONFIG_2605.format(params="enable_expedited_requeue"))
    assert submitted_requeue(tmp_path, sbatch_log, *own) == (own, "")
    assert not (tmp_path / "scontrol.log").exists()  # nothing to decide: no controller round trip


def test_sbatch_without_a_command_is_one_line_exit_2(tmp_path, sbatch_log):
    for argv in (["-N1", "--gres=gpu:8"], ["-N1", "--"], []):
        proc = slurmagent("sbatch", *argv, config=tmp_path / "c.toml", cwd=tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, (argv, proc.stderr)
        assert "slurmagent sbatch [sbatch options] -- CMD ARGS" in proc.stderr
    assert not sbatch_log.exists()


ARGV_DUMP = "import json, sys; open(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))"


@pytest.mark.parametrize(
    "argv",
    [
        ["--grace", "5", "--", sys.executable, "-c", ARGV_DUMP, "{out}", "-x", "--", "--lr=3"],  # the documented form
        ["--grace", "5", sys.executable, "-c", ARGV_DUMP, "{out}", "-x", "--", "--lr=3"],  # CMD's options stay CMD's
    ],
)
def test_run_hands_the_command_its_own_options_and_separator(tmp_path, argv):
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    out = tmp_path / "argv.json"
    argv = [a.replace("{out}", str(out)) for a in argv]
    proc = slurmagent("run", "--ckpt-dir", str(tmp_path / "ck"), *argv, config=tmp_path / "c.toml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == ["-x", "--", "--lr=3"]


@pytest.mark.parametrize(("option", "value", "shown"), [
    ("--sync-interval", "0", "--sync-interval 0.0 is out of range (0.1 .. 86400)"),
    ("--grace", "1e308", "--grace 1e+308 is out of range (0.1 .. 86400)"),
    ("--grace", "nan", "--grace nan is out of range (0.1 .. 86400)"),
    ("--max-requeues", "100000", "--max-requeues 100000 is out of range (0 .. 10000)"),
])
def test_run_options_obey_the_ranges_of_the_keys_they_override(tmp_path, option, value, shown):
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    proc = slurmagent("run", "--ckpt-dir", str(tmp_path / "ck"), option, value, "--", "touch", str(tmp_path / "ran"),
                      config=tmp_path / "c.toml", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == f"slurmagent: run: {shown}\n"
    assert not (tmp_path / "ran").exists()


# --- bad paths: one line, exit 2, nothing created --------------------------------------------------


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("slurmagent: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.mark.parametrize("ckpt_dir", ["/dev/null", "FILE", "/proc/1/x"])
def test_run_with_an_unusable_ckpt_dir_is_one_line(tmp_path, ckpt_dir):
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    if ckpt_dir == "FILE":
        ckpt_dir = str(tmp_path / "a-file")
        Path(ckpt_dir).write_text("x")
    proc = slurmagent("run", "--ckpt-dir", ckpt_dir, "--", "true", config=tmp_path / "c.toml", cwd=tmp_path)
    assert ckpt_dir in _one_error_line(proc)


def test_snapshot_to_a_directory_is_one_line(tmp_path):
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    line = _one_error_line(slurmagent("snapshot", "-o", str(tmp_path), config=tmp_path / "c.toml", cwd=tmp_path))
    assert "is a directory" in line


def test_snapshot_never_creates_the_directory_of_its_output(tmp_path):
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    target = tmp_path / "nonexistent" / "dir" / "x.json"
    line = _one_error_line(slurmagent("snapshot", "-o", str(target), config=tmp_path / "c.toml", cwd=tmp_path))
    assert "does not exist" in line and not (tmp_path / "nonexistent").exists()
    ok = slurmagent("snapshot", "-o", str(tmp_path / "x.json"), config=tmp_path / "c.toml", cwd=tmp_path)
    assert ok.returncode == 0 and json.loads((tmp_path / "x.json").read_text()), ok.stderr


@pytest.mark.parametrize("args", [["status", "--json"], ["journal", "--json"], ["repair", "--dry-run", "--json"],
                                  ["ckpt", "ls", "--json", "--remote", "gs://b/p"]])
def test_a_json_command_prints_a_json_error_object_on_exit_2(tmp_path, args):
    """Before: a config error printed one line on stderr and nothing a script reading stdout could parse
    (doctor --json did; status, repair --dry-run, journal did not)."""
    bad = tmp_path / "c.toml"
    bad.write_text("[watch]\nchannel_socket = 5\n")  # not a path: the config is invalid
    r = slurmagent(*args, config=bad, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and "channel_socket" in doc["error"] and doc["version"]
    assert len(r.stderr.strip().splitlines()) == 1 and "channel_socket" in r.stderr


def test_json_after_the_double_dash_is_the_wrapped_commands_not_ours(tmp_path):
    bad = tmp_path / "c.toml"
    bad.write_text("[watch]\nchannel_socket = 5\n")
    r = slurmagent("run", "--", "tool", "--json", config=bad, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "", r.stdout
