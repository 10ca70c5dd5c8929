"""The local cluster harness itself, without Slurm: what makes it fail loudly or quietly on
Slurm 24.11, in a chroot, or on a machine shared with other clusters."""

from __future__ import annotations

import os
import signal
import stat
import socket
import subprocess
import time
from pathlib import Path

import pytest

from slurmagent.devtools.localcluster import LocalSlurmCluster, free_ports


def test_free_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = free_ports(8)
    assert len(set(ports)) == 8
    if low > 11000:  # room below the range: no outgoing connection can take one before it is bound
        assert all(p < low for p in ports), (ports, low)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_slurmd_that_exits_at_start_is_reported_with_its_error_at_once(tmp_path):
    c = LocalSlurmCluster(tmp_path, nodes=["n1"])
    with open(tmp_path / "d-n1.err", "wb") as err:
        c.procs["n1"] = subprocess.Popen(
            ["sh", "-c", "echo 'unshare: cannot change root filesystem propagation: Invalid argument' >&2; exit 1"],
            stderr=err)
    c.procs["n1"].wait(10)
    with pytest.raises(RuntimeError, match="n1 exited with status 1: unshare: cannot change root filesystem"):
        c.wait_nodes_idle(["n1"], timeout=30)


def _fake_bin(tmp_path: Path) -> Path:
    """`slurmd` that only stays alive; `scontrol show hostnames X` that prints X."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "slurmd").write_text("#!/bin/sh\nexec sleep 60\n")
    (bin_dir / "scontrol").write_text('#!/bin/sh\necho "$3"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def test_the_resume_program_returns_only_once_its_slurmd_survives_a_kill_of_its_process_group(tmp_path, monkeypatch):
    """Slurm 24.11 runs ResumeProgram in its own process group and, once it exits, kills that
    group (SIGTERM, 10 ms, SIGKILL): a slurmd started in the background must be out of it by then."""
    monkeypatch.setenv("PATH", f"{_fake_bin(tmp_path)}:{os.environ['PATH']}")
    c = LocalSlurmCluster(tmp_path / "slurm", nodes=["s1", "c1"], cloud_nodes=["c1"])
    c.munge_socket = tmp_path / "munge.sock"  # written into slurm.conf only
    c.write_conf()
    survived = []
    try:
        for _ in range(5):
            script = subprocess.Popen([str(c.base / "resume-program"), "c1"], process_group=0,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            script.wait(30)
            for sig in (signal.SIGTERM, signal.SIGKILL):  # as Slurm's run_command does
                try:
                    os.killpg(script.pid, sig)
                except ProcessLookupError:
                    pass
                time.sleep(0.01)
            pid = int((c.base / "cloud-c1.pid").read_text())
            time.sleep(0.05)
            state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else "gone"
            survived.append(state not in ("Z", "gone"))
            c.stop()  # kills the cloud slurmd by its pid file
    finally:
        c.stop()
    assert all(survived), survived
    assert c.power_log() == ["resume c1"] * 5


def test_a_configless_cluster_gives_slurmd_no_config_of_its_own_and_gpus_from_gres_files(tmp_path):
    """As on Cluster Toolkit: the config lives with slurmctld only; a gpu gres counts only with File=."""
    c = LocalSlurmCluster(tmp_path / "slurm", nodes=["n1", "n2"], configless=True, gpus=8)
    c.munge_socket = tmp_path / "munge.sock"  # written into slurm.conf only
    c.write_conf()
    conf = c.conf.read_text().splitlines()
    assert "SlurmctldParameters=enable_configless" in conf and "GresTypes=gpu" in conf
    assert all("Gres=gpu:8" in line for line in conf if line.startswith("NodeName="))
    [gres] = (c.base / "gres.conf").read_text().splitlines()
    files = gres.split("File=", 1)[1].split(",")
    assert gres.startswith("NodeName=n1,n2 Name=gpu ") and len(set(files)) == 8
    assert all(stat.S_ISCHR(os.stat(f).st_mode) for f in files)
    with pytest.raises(ValueError, match="configless cloud nodes"):
        LocalSlurmCluster(tmp_path / "x", nodes=["c1"], cloud_nodes=["c1"], configless=True).start()


def test_more_slurmctld_parameters_join_the_one_line(tmp_path):
    """Slurm keeps the last SlurmctldParameters line only: configless and the extras share one."""
    tmp = tmp_path
    c = LocalSlurmCluster(tmp / "a", nodes=["n1"], configless=True, ctld_params=["enable_expedited_requeue"])
    c.munge_socket = tmp / "munge.sock"
    c.write_conf()
    lines = [ln for ln in c.conf.read_text().splitlines() if ln.startswith("SlurmctldParameters=")]
    assert lines == ["SlurmctldParameters=enable_configless,enable_expedited_requeue"]
    c = LocalSlurmCluster(tmp / "b", nodes=["n1"])
    c.munge_socket = tmp / "munge.sock"
    c.write_conf()
    assert "SlurmctldParameters" not in c.conf.read_text()
