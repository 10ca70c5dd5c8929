"""The wrapper's pieces without a cluster: identity, options, sbatch argv, signals, trainer helper."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO, SUPPORT, wait_for
from support.fakes.slurm import FakeSlurm
from slurmagent import trainer
from slurmagent.state.config import parse
from slurmagent.run.main import build_options, submit, warn_if_not_requeueable
from slurmagent.slurm.commands import Slurm
from slurmagent.state.expiry_state import termination_time
from slurmagent.run.job import JobIdentity, WrapperError, parse_signal
from slurmagent.run.supervisor import Supervisor

TOY = str(SUPPORT / "toy_trainer.py")


def test_identity_slurm_array_task_requeues_array_id():
    ident = JobIdentity.from_env({"SLURM_JOB_ID": "105", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "5",
                                  "SLURM_RESTART_COUNT": "2"})
    assert (ident.platform, ident.job_id, ident.restart_count) == ("slurm", "100_5", 2)


def test_identity_cloud_run_prefix_and_attempt():
    ident = JobIdentity.from_env({"CLOUD_RUN_JOB": "train", "CLOUD_RUN_TASK_INDEX": "3", "CLOUD_RUN_TASK_ATTEMPT": "1"})
    assert (ident.platform, ident.name, ident.restart_count) == ("cloud-run", "train-task-3", 1)


def test_options_default_remote_and_private_dir(tmp_path):
    cfg = parse({"checkpoint": {"remote": "gs://b/p/", "grace_s": 7}})
    ident = JobIdentity.from_env({"SLURM_JOB_ID": "42"})
    opts = build_options(cfg, ["--", "python", "t.py"], {"TMPDIR": str(tmp_path), "SLURMD_NODENAME": "n2"}, ident)
    assert opts.remote == "gs://b/p/42"
    assert opts.ckpt_dir == tmp_path / f"slurmagent-{os.geteuid()}" / "42"
    for d in (opts.ckpt_dir, opts.ckpt_dir.parent):
        assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700 and d.stat().st_uid == os.geteuid()
    assert opts.cmd == ["python", "t.py"] and opts.grace_s == 7.0 and opts.max_requeues == 3
    per_node = build_options(cfg, ["x"], {"SLURMD_NODENAME": "n2"}, ident, ckpt_dir="/ssd/ck-%n")
    assert per_node.ckpt_dir == Path("/ssd/ck-n2")


@pytest.mark.parametrize("bad", [dict(grace=-1), dict(max_requeues=-2), dict(ckpt_signal="SIGNOPE")])
def test_bad_options_are_wrapper_errors(bad):
    with pytest.raises(WrapperError):
        build_options(parse({}), ["x"], {}, JobIdentity.from_env({}), **bad)


def test_parse_signal_forms():
    assert parse_signal("usr1") == parse_signal("SIGUSR1") == parse_signal(str(int(signal.SIGUSR1))) == signal.SIGUSR1


def test_sbatch_adds_requeue_and_end_signal_and_keeps_argv_intact(monkeypatch, capsys):
    runner = FakeSlurm()
    runner.sbatch_reply = "77\n"
    monkeypatch.setattr(Slurm, "from_config", classmethod(lambda cls, cfg: cls(runner=runner)))
    nasty = ["python", "train.py", "--name", "a b; rm -rf / $(id) `x` 'q'"]
    code = submit(parse({"checkpoint": {"signal_lead_s": 240}}), ["-t", "10", "--", *nasty])
    assert code == 0 and capsys.readouterr().out == "77\n"
    [argv] = [c for c in runner.calls if c[0] == "sbatch"]  # after its `scontrol show config` (22.05 here)
    assert argv[:6] == ["sbatch", "-t", "10", "--requeue", "--open-mode=append", "--signal=B:USR1@240"]
    script_index = 6
    assert argv[script_index + 1:] == ["--", *nasty]  # one argv element each, no shell string


def test_sbatch_keeps_user_signal_and_passes_run_options(monkeypatch, capsys):
    runner = FakeSlurm()
    monkeypatch.setattr(Slurm, "from_config", classmethod(lambda cls, cfg: cls(runner=runner)))
    submit(parse({}), ["--signal=B:USR1@900", "--", "--grace", "30", "--", "python", "t.py"])
    [argv] = [c for c in runner.calls if c[0] == "sbatch"]  # after its `scontrol show config` (22.05 here)
    assert argv.count("--signal=B:USR1@900") == 1 and not any(a.startswith("--signal=B:USR1@300") for a in argv)
    assert argv[-5:] == ["--grace", "30", "--", "python", "t.py"]


def test_sbatch_without_command_is_usage_error():
    with pytest.raises(WrapperError):
        submit(parse({}), ["-t", "10"])


def test_not_requeueable_job_gets_a_clear_warning(tmp_path):
    import io

    runner = FakeSlurm()
    runner.add_job("9", "RUNNING", Requeue="0")
    err = io.StringIO()
    ident = JobIdentity.from_env({"SLURM_JOB_ID": "9"})
    sup = Supervisor(build_options(parse({}), ["true"], {}, ident), ident, None, None, {}, err=err)
    warn_if_not_requeueable(sup, Slurm(runner=runner), "9")
    assert "not requeueable (Requeue=0)" in err.getvalue() and "--requeue" in err.getvalue()


def test_termination_time_from_expiry_state(tmp_path):
    state = tmp_path / "expiry.json"
    state.write_text('{"termination_time": "2026-12-01T10:00:00Z"}')
    before = 1796119200.0 - 60  # a minute before 2026-12-01T10:00:00Z
    assert termination_time((tmp_path / "missing.json", state), now=before).isoformat() == "2026-12-01T10:00:00+00:00"
    state.write_text('{"termination_time": "2026-12-01T10:00:00Z", "boot_id": "old-boot"}')
    assert termination_time((state,), boot_id="this-boot") is None  # stale: from an earlier boot
    assert termination_time((state,), boot_id="old-boot", now=before) is not None


def _wrapper(tmp_path, *args, env_extra=None, trainer_args=("100000",)):
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp_path / "c.toml"), **(env_extra or {}))
    for key in ("SLURM_JOB_ID", "CLOUD_RUN_JOB", "STORAGE_EMULATOR_HOST"):
        env.pop(key, None)
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    ledger = tmp_path / "ledger"
    proc = subprocess.Popen([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "ck"), *args,
                             "--", sys.executable, TOY, *trainer_args, str(ledger), "0.02"],
                            env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    wait_for(lambda: ledger.exists(), 30, "trainer start")
    return proc, ledger


def test_second_signal_during_flush_starts_no_second_flush(tmp_path):
    proc, ledger = _wrapper(tmp_path, "--grace", "3", trainer_args=("100000",))
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 143
    err = proc.stderr.read()
    assert err.count("asking the job to checkpoint") == 1, err
    assert ledger.read_text().count("ckpt ") == 1


def test_usr1_end_of_time_signal_flushes_and_child_gets_checkpoint_signal(tmp_path):
    proc, ledger = _wrapper(tmp_path)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(30) == 143
    assert "SIGUSR1: asking the job to checkpoint" in proc.stderr.read()
    assert "ckpt " in ledger.read_text()
    assert (tmp_path / "ck" / "state.json").exists()


def test_child_exit_code_is_passed_through(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURMAGENT_CONFIG=str(tmp_path / "c.toml"))
    env.pop("SLURM_JOB_ID", None)
    (tmp_path / "c.toml").write_text(f'state_dir = "{tmp_path}/state"\n')
    proc = subprocess.run([sys.executable, "-m", "slurmagent.entry", "run", "--ckpt-dir", str(tmp_path / "ck"), "--",
                           sys.executable, "-c", "import os,sys; assert os.environ['SLURMAGENT_CKPT_DIR']; sys.exit(7)"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr


def test_trainer_helper_flag_and_atomic_write(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMAGENT_CKPT_DIR", str(tmp_path / "ck"))
    monkeypatch.setenv("SLURMAGENT_RESUMED", "1")
    monkeypatch.setenv("SLURMAGENT_RESTART_COUNT", "2")
    trainer.reset()
    with trainer.checkpoint_handler():
        assert not trainer.checkpoint_requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(trainer.checkpoint_requested, 5, "flag")
    trainer.reset()
    assert trainer.resumed() and trainer.restart_count() == 2
    trainer.atomic_write(trainer.ckpt_dir() / "s.json", "{}")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["s.json"]


def test_checkpoint_tunables_from_the_config_reach_the_wrapper_store(tmp_path):
    from slurmagent.state.config import Config, load
    from slurmagent.checkpoint.gcs.store import GcsCheckpointStore
    from slurmagent.run.main import store_tunables

    default = GcsCheckpointStore("gs://ckpt/p", **store_tunables(Config())).settings()
    assert (default.max_workers, default.parallel_upload_threshold) == (16, None)
    config = tmp_path / "c.toml"
    config.write_text("[checkpoint]\ntransfers = 4\nparallel_upload_mib = 1024\n")
    tuned = GcsCheckpointStore("gs://ckpt/p", **store_tunables(load(str(config)))).settings()
    assert (tuned.max_workers, tuned.parallel_upload_threshold) == (4, 1024 * 1024 * 1024)
