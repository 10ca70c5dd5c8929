"""A real Slurm cluster on 127.0.0.1 for `slurmagent demo`, the tests and the benchmarks.

Used by the test suite, the benchmarks and `make demo`. It writes a private slurm.conf,
starts the daemons in the foreground under its own supervision and stops exactly the
processes it started (plus the slurmstepd of jobs still running on its nodes).

Node-local disks (`node_local=ROOT`, opt-in): every slurmd runs in its own mount namespace
where `ROOT/localssd` is `ROOT/nodes/<node>`, so every process of a job on that node (batch
script, srun tasks, `srun --overlap` helpers) sees its own node's directory at the same path,
as on VMs with a local SSD each; the host sees each node's files under `ROOT/nodes/<node>`.
Without it every slurmd shares the host's file systems, which hides multi-node bugs.

`cloud_nodes` are dynamic nodes (`State=CLOUD`, Slurm power saving): slurmctld "creates their
VM" through a ResumeProgram that starts their slurmd (`-b`: it reports a boot of now, as a
fresh VM would) and "deletes" it through a SuspendProgram that kills that slurmd; both are
shell scripts under the cluster's base directory, and every such slurmd's pid is kept there.

`configless` (as on Cluster Toolkit / slurm-gcp): slurmctld runs with `enable_configless` and
each slurmd starts with `--conf-server 127.0.0.1:PORT`, no `-f` and no SLURM_CONF: it fetches
slurm.conf (and the gres.conf beside it) into `<spool>/conf-cache/`, the SLURM_CONF its
Prolog/Epilog get. `gpus=N` gives every node `Gres=gpu:N` from a gres.conf whose `File=` are N
distinct character devices of the host (slurmd counts a gpu gres only with `File=`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..slurm.model import parse_kv
from .ports import free_ports

SLURM_BINARIES = ("slurmctld", "slurmd", "scontrol", "sbatch", "squeue", "sinfo", "munge", "unmunge")


def slurm_available() -> str | None:
    """None when a local cluster can run here, else why not."""
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return f"missing {', '.join(missing)} (apt-get install slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root"
    return None


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class LocalSlurmCluster:
    base: Path
    nodes: list[str] = field(default_factory=lambda: ["n1", "n2", "n3"])
    prolog: str | None = None
    epilog: str | None = None
    extra_conf: list[str] = field(default_factory=list)
    node_extra: str = ""
    # Slurm's minimum (22.05-26.05 refuse less): a requeued job may start again after 6 s, not 21;
    # a step's credential must still reach its slurmd within 5 s of slurmctld signing it.
    cred_expire: int = 5
    node_local: Path | None = None  # ROOT: per-node ROOT/localssd (see the module doc)
    cloud_nodes: list[str] = field(default_factory=list)  # State=CLOUD: powered up for a job, down when told
    configless: bool = False  # slurmd fetches its config from slurmctld (see the module doc)
    gpus: int = 0  # Gres=gpu:N per node, from gres.conf File= (at most len(GPU_STAND_INS))
    ctld_params: list[str] = field(default_factory=list)  # more SlurmctldParameters (enable_expedited_requeue)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    munged: subprocess.Popen | None = None

    @property
    def local_path(self) -> Path:
        """The node-local path as jobs see it (the same on every node)."""
        if self.node_local is None:
            raise RuntimeError("this cluster has no node-local directories (node_local=None)")
        return self.node_local / "localssd"

    def node_dir(self, name: str) -> Path:
        """Where the host sees node `name`'s node-local directory."""
        if self.node_local is None:
            raise RuntimeError("this cluster has no node-local directories (node_local=None)")
        return self.node_local / "nodes" / name

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        return env

    # --- lifecycle --------------------------------------------------------------------

    def write_conf(self) -> None:
        host = socket.gethostname()
        ports = free_ports(1 + len(self.nodes))
        self.ctld_port, node_ports = ports[0], ports[1:]
        b = self.base
        for sub in ("ctld", "d"):
            (b / sub).mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=satest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=cred_expire={self.cred_expire},socket={self.munge_socket}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={b}/ctld",
            f"SlurmdSpoolDir={b}/d/%n",
            f"SlurmctldPidFile={b}/ctld.pid",
            f"SlurmdPidFile={b}/d-%n.pid",
            f"SlurmctldLogFile={b}/ctld.log",
            f"SlurmdLogFile={b}/d-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=nohold_on_prolog_fail,bf_interval=1,sched_interval=1",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "MpiDefault=none",
            "MinJobAge=600",
            "KillWait=5",
            "PrologEpilogTimeout=60",
            "SlurmdTimeout=30",
            "MessageTimeout=10",
        ]
        if self.prolog:
            lines += [f"Prolog={self.prolog}", "PrologFlags=Alloc"]
        if self.epilog:
            lines.append(f"Epilog={self.epilog}")
        params = ["enable_configless"] * self.configless + self.ctld_params  # one line: a second would replace it
        if params:
            lines.append(f"SlurmctldParameters={','.join(params)}")
        node_extra = self.node_extra
        if self.gpus:
            lines.append("GresTypes=gpu")
            node_extra = f"Gres=gpu:{self.gpus} {node_extra}"
            (b / "gres.conf").write_text(f"NodeName={','.join(self.nodes)} Name=gpu "
                                         f"File={','.join(GPU_STAND_INS[:self.gpus])}\n")
        lines += self.extra_conf
        if self.cloud_nodes:
            lines += self._power_saving()
        for name, port in zip(self.nodes, node_ports):
            state = "CLOUD" if name in self.cloud_nodes else "UNKNOWN"
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 "
                f"State={state} Port={port} {node_extra}".rstrip()
            )
        lines.append(f"PartitionName=gpu Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _power_saving(self) -> list[str]:
        """slurm.conf lines and the Resume/Suspend programs for the cloud nodes."""
        b, slurmd = self.base, _sbin("slurmd")
        resume, suspend = b / "resume-program", b / "suspend-program"
        resume.write_text(
            "#!/bin/sh\n# slurmctld: power these nodes up (a fresh VM: a slurmd that reports a boot of now)\n"
            f"exec 2>>{b}/power.err\n"
            f'echo "resume $1" >> {b}/power.log\n'
            'for n in $(scontrol show hostnames "$1"); do\n'
            "  # a fresh VM replaces the old one: a slurmd of this node still running would hold its port\n"
            f'  old=$(cat {b}/cloud-$n.pid 2>/dev/null) && grep -qaF -- "{self.conf}" /proc/$old/cmdline 2>/dev/null && kill -9 $old\n'
            f'  rm -f {b}/d-$n.pid\n'
            f"  setsid {slurmd} -b -D -N $n -f {self.conf} >/dev/null 2>>{b}/d-$n.err </dev/null &\n"
            "  pid=$!\n"
            f"  echo $pid > {b}/cloud-$n.pid\n"
            "  # Slurm 24.11 kills this script's process group once it exits: return only after slurmd\n"
            "  # has left it (setsid: its own session), or it may be killed before it starts.\n"
            '  for _ in $(seq 200); do [ "$(ps -o sid= -p $pid | tr -d \' \')" = "$pid" ] && break; sleep 0.05; done\n'
            "done\n")
        suspend.write_text(
            "#!/bin/sh\n# slurmctld: power these nodes down (delete the VM). SIGKILL: slurmctld's children\n"
            "# inherit its blocked SIGTERM.\n"
            f"exec 2>>{b}/power.err\n"
            f'echo "suspend $1" >> {b}/power.log\n'
            'for n in $(scontrol show hostnames "$1"); do\n'
            f'  old=$(cat {b}/cloud-$n.pid 2>/dev/null) && grep -qaF -- "{self.conf}" /proc/$old/cmdline 2>/dev/null && kill -9 $old\n'
            f"  rm -f {b}/cloud-$n.pid\n"
            "done\n")
        for script in (resume, suspend):
            script.chmod(0o755)
        static = [n for n in self.nodes if n not in self.cloud_nodes]
        return [f"ResumeProgram={resume}", f"SuspendProgram={suspend}", "SuspendTime=3600", "SuspendTimeout=5",
                "ResumeTimeout=90", "PrivateData=cloud", *([f"SuspendExcNodes={','.join(static)}"] if static else [])]

    def power_log(self) -> list[str]:
        """What slurmctld asked of the Resume/Suspend programs, in order ("resume c1", "suspend c1")."""
        try:
            return (self.base / "power.log").read_text().splitlines()
        except OSError:
            return []

    def _stop_cloud_slurmds(self) -> None:
        for pid_file in self.base.glob("cloud-*.pid"):
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
            pid_file.unlink(missing_ok=True)

    def ensure_munge(self) -> None:
        """A private munged (own key, socket, pid file) for this cluster only, so clusters of
        concurrent test sessions never share, or stop, each other's authentication."""
        self.munge_dir = Path(tempfile.mkdtemp(prefix="sa-munge-", dir="/run" if os.access("/run", os.W_OK) else None))
        self.munge_dir.chmod(0o755)  # clients (root, the job's user) reach the socket
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        for path in (self.munge_dir, key):
            shutil.chown(path, "munge", "munge")
        key.chmod(0o400)
        self.munge_socket = self.munge_dir / MUNGE_SOCKET_NAME  # munge's default name: see start_node
        d = self.munge_dir
        self.munged = subprocess.Popen(
            ["setpriv", "--reuid=munge", "--regid=munge", "--clear-groups", _sbin("munged"), "--foreground",
             f"--socket={self.munge_socket}", f"--key-file={key}", f"--pid-file={d}/munged.pid",
             f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait(lambda: _munge_works(self.munge_socket), 10, "munged did not start")

    def start(self) -> LocalSlurmCluster:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> LocalSlurmCluster:
        if self.configless and self.cloud_nodes:
            raise ValueError("configless cloud nodes are not supported (their ResumeProgram passes -f)")
        self.ensure_munge()
        self.write_conf()
        self.procs["ctld"] = subprocess.Popen(
            [_sbin("slurmctld"), "-D", "-c", "-f", str(self.conf)],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.base / "ctld.err", "wb"),
        )
        _wait(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, 30, "slurmctld did not answer")
        for name in self.nodes:
            if name not in self.cloud_nodes:
                self.start_node(name)
        self.wait_nodes_idle(self.nodes)
        return self

    def conf_cache(self, name: str) -> Path:
        """Where a configless slurmd of node `name` keeps the config it fetched."""
        return self.base / "d" / name / "conf-cache"

    def start_node(self, name: str) -> None:
        argv = [_sbin("slurmd"), "-D", "-N", name, "-f", str(self.conf)]
        env = self.env
        if self.configless:  # nothing of its own: the config comes from slurmctld
            argv = [_sbin("slurmd"), "-D", "-N", name, "--conf-server", f"127.0.0.1:{self.ctld_port}"]
            env = {k: v for k, v in env.items() if k != "SLURM_CONF"}
        binds: list[str] = []  # source, target, ...: mounted in the slurmd's own mount namespace
        if self.configless:  # before it has a config, slurmd knows only munge's default socket
            Path(DEFAULT_MUNGE_DIR).mkdir(parents=True, exist_ok=True)
            binds += [str(self.munge_dir), DEFAULT_MUNGE_DIR]
            # Newer slurmd links /run/slurm/conf to its conf cache, and every Slurm client on the
            # host without SLURM_CONF reads that link: this cluster's own, in the slurmd's namespace
            # only, so clusters of parallel test workers never read each other's config.
            Path(SLURMD_RUN_DIR).mkdir(parents=True, exist_ok=True)
            (self.base / "d" / name / "run-slurm").mkdir(parents=True, exist_ok=True)
            binds += [str(self.base / "d" / name / "run-slurm"), SLURMD_RUN_DIR]
        if self.node_local is not None:
            self.local_path.mkdir(parents=True, exist_ok=True)
            self.node_dir(name).mkdir(parents=True, exist_ok=True)
            binds += [str(self.node_dir(name)), str(self.local_path)]
        if binds:
            argv = ["unshare", "-m", "--propagation", "private", sys.executable, "-c", _BIND_AND_EXEC,
                    *binds, "--", *argv]
        self.procs[name] = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.base / f"d-{name}.err", "wb"),
        )

    def stop_node(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc:
            _terminate(proc)

    def kill_node(self, name: str, job_id: str) -> None:
        """The node dies under job `job_id`: its slurmd, the job's slurmstepds and every process
        of the job on it (SIGKILL; the job runs on this node only, so its stepds are this node's)."""
        self.stop_node(name)
        mine = (f"SLURM_JOB_ID={job_id}".encode(), f"SLURMD_NODENAME={name}".encode())
        for proc in Path("/proc").iterdir():
            try:
                cmd = (proc / "cmdline").read_bytes()
                env = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            stepd = cmd.startswith(b"slurmstepd") and f"[{job_id}.".encode() in cmd  # "slurmstepd: [JOB.batch]"
            if stepd or all(m in env for m in mine):
                try:
                    os.kill(int(proc.name), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass

    def stop_ctld(self) -> None:
        proc = self.procs.pop("ctld", None)
        if proc:
            _terminate(proc)

    def restart_ctld(self) -> None:
        self.procs["ctld"] = subprocess.Popen(
            [_sbin("slurmctld"), "-D", "-f", str(self.conf)],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.base / "ctld.err", "ab"),
        )
        _wait(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, 30, "slurmctld did not answer")

    def stop(self) -> None:
        for name in [n for n in self.procs if n != "ctld"]:
            self.stop_node(name)
        self._stop_cloud_slurmds()
        self._kill_stepds()
        self.stop_ctld()
        if self.munged:
            _terminate(self.munged)
            self.munged = None
            shutil.rmtree(self.munge_dir, ignore_errors=True)

    def _kill_stepds(self) -> None:
        """slurmstepd of jobs still running belong to this cluster: end them too."""
        spool = str(self.base / "d")
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            try:
                cmdline = (pid_dir / "cmdline").read_bytes().split(b"\0")
                environ = (pid_dir / "environ").read_bytes()
            except OSError:
                continue
            if cmdline and cmdline[0].endswith(b"slurmstepd") and spool.encode() in environ + b"".join(cmdline):
                try:
                    os.kill(int(pid_dir.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # --- client helpers ---------------------------------------------------------------

    def run(self, argv: list[str], check: bool = True, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout, check=check, **kw)

    def _show(self, what: str, name: str) -> dict[str, str]:
        """`scontrol -o show`, retried: a busy slurmctld (job start, reconfigure) may refuse one call."""
        for attempt in range(5):
            proc = self.run(["scontrol", "-o", "show", what, name], check=False)
            if proc.returncode == 0:
                return parse_kv(proc.stdout)  # the product's parser: a job's comment never wins
            time.sleep(0.3 * (attempt + 1))
        raise RuntimeError(f"scontrol show {what} {name}: {proc.stderr.strip() or proc.returncode}")

    def node(self, name: str) -> dict[str, str]:
        return self._show("node", name)

    def job(self, job_id: str) -> dict[str, str]:
        return self._show("job", job_id)

    def sbatch(self, *args: str) -> str:
        out = self.run(["sbatch", "--parsable", *args]).stdout.strip()
        return out.split(";")[0]

    def wait_nodes_idle(self, names: list[str], timeout: float = 60) -> None:
        """Until every node takes jobs: IDLE, registered, not drained (IDLE+DRAIN is not idle)."""
        def idle() -> bool:
            self._check_started(names)
            return all(_takes_jobs(_flags(self.node(n))) for n in names)

        _wait(idle, timeout, lambda: f"nodes {names} not idle; last: {[self.node(n).get('State') for n in names]}")

    def _check_started(self, names: list[str]) -> None:
        """A slurmd we started that already exited never registers: say why at once (its stderr,
        e.g. `unshare` refusing a chroot whose / is not a mount point), not "not idle" later."""
        for name in names:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                try:
                    err = (self.base / f"d-{name}.err").read_text(errors="replace").strip().splitlines()
                except OSError:
                    err = []
                raise RuntimeError(f"slurmd of node {name} exited with status {proc.returncode}: "
                                   f"{err[-1] if err else 'no output'}")

    def wait_job(self, job_id: str, states: tuple[str, ...], timeout: float = 120) -> dict[str, str]:
        last: dict[str, str] = {}

        def reached() -> bool:
            nonlocal last
            last = self.job(job_id)
            return last.get("JobState") in states

        _wait(reached, timeout, lambda: f"job {job_id} not in {states}: {last.get('JobState')} {last.get('Reason')}")
        return last

    def resume(self, *names: str) -> None:
        for name in names:
            self.run(["scontrol", "update", f"nodename={name}", "state=resume"], check=False)

    def reset_nodes(self, timeout: float = 60) -> None:
        """Bring every node back to IDLE and undrained between tests (cancel leftovers).

        A resume goes only to a registered node: right after a slurmctld restart a node is
        UNKNOWN until its slurmd registers again and Slurm refuses the resume. A Reason may
        stay on an undrained node (Slurm 24.11 keeps it on every resume; 22.05 clears it),
        so a node's drain is its DRAIN flag, never its Reason alone."""
        self.run(["scancel", "--full", "-u", "root"], check=False)

        def settled() -> bool:
            done = True
            for name in self.nodes:
                flags = _flags(self.node(name))
                if flags & _HELD and not flags & _UNSETTLED:
                    self.resume(name)
                done = done and _takes_jobs(flags)
            return done

        _wait(settled, timeout, lambda: f"nodes not reset; last: {[self.node(n).get('State') for n in self.nodes]}",
              interval=0.5)


DEFAULT_MUNGE_DIR = "/run/munge"  # where libmunge looks when no socket is configured
MUNGE_SOCKET_NAME = "munge.socket.2"
SLURMD_RUN_DIR = "/run/slurm"  # where a newer configless slurmd links `conf` to its conf cache

# Character devices every Linux host has: a GPU gres needs File=, and slurmd wants distinct devices.
GPU_STAND_INS = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/ptmx",
                 "/dev/kmsg")

# Node flags (State split on + and *) that keep a node from taking jobs.
_HELD = frozenset({"DRAIN", "DOWN", "FAIL"})
_UNSETTLED = frozenset({"UNKNOWN", "NOT_RESPONDING", "COMPLETING", "POWERING_UP", "REBOOT_ISSUED"})


def _flags(node: dict[str, str]) -> frozenset[str]:
    return frozenset(f for f in re.split(r"[+*]", node.get("State", "")) if f)


def _takes_jobs(flags: frozenset[str]) -> bool:
    return "IDLE" in flags and not flags & (_HELD | _UNSETTLED)


# Runs inside the new mount namespace: bind the node's own directory, then become slurmd.
_BIND_AND_EXEC = """
import os, subprocess, sys
end = sys.argv.index("--")
binds, argv = sys.argv[1:end], sys.argv[end + 1:]
for source, target in zip(binds[::2], binds[1::2]):
    subprocess.run(["mount", "--bind", source, target], check=True, timeout=30)
os.execv(argv[0], argv)
"""


def _munge_works(socket_path: Path) -> bool:
    try:
        cred = subprocess.run(["munge", "-n", f"--socket={socket_path}"], capture_output=True, timeout=5)
        if cred.returncode != 0:
            return False
        return subprocess.run(["unmunge", f"--socket={socket_path}"], input=cred.stdout, capture_output=True,
                              timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _wait(pred, timeout: float, message, interval: float = 0.2) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(interval)
    raise TimeoutError(message() if callable(message) else message)


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
