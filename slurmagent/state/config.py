"""The TOML config file: typed, validated, every key optional.

An unknown key or a wrong type is a ConfigError naming the key and the file. The schema is
the dataclasses below; the config reference (docs/admin/configuration.md) is generated from them
(`python -m slurmagent.state.config`), and a test keeps the two in step.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..core.catalogue import CATALOGUE
from ..core.checks import Limits  # the warning thresholds' defaults: one source
from ..errors import ConfigError
from .config_node import NodeHealthKeys, key as _key, validate_paths
from .fsutil import UntrustedFile, read_trusted, untrusted_reason

CHECK_NAMES = frozenset(spec.name for spec in CATALOGUE)
DEFAULT_PATH = "/etc/slurmagent/config.toml"
ENV_VAR = "SLURMAGENT_CONFIG"


@dataclass(frozen=True)
class HealthConfig(NodeHealthKeys):
    """[health]: where the health check reads and what it warns or drains on."""
    snapshot: str = _key("", "replay snapshot to read instead of NVML (`%n` = node name)")
    expected_gpus: int = _key(
        0, "0 = find it: slurm.conf/gres.conf (`[slurm] conf`, `$SLURM_CONF`, the configless cache, "
        "/etc/slurm), else the machine type and the PCI bus ([order](health.md#the-expected-gpu-count)); "
        "none: a `gpu-count-unknown` warning",
        low=0, high=1024,
    )
    timeout_s: float = _key(
        15.0, "deadline of the whole check; a hung NVML read is an unhealthy verdict",
        low=0.5, high=3600,
    )
    kernel_log: str = _key("", "file to read for NVRM Xid lines instead of the kernel log (`%n` = node name)")
    kernel_log_enabled: bool = _key(True, "read XIDs from the kernel log at all")
    temperature_warn_c: float = _key(Limits.temperature_warn_c, "warn (not drain) at or above this GPU temperature", low=1, high=200)
    nvlink_errors_warn: int = _key(
        Limits.nvlink_errors_warn, "warn when a link's replay+recovery+CRC counters reach this",
        low=1, high=10**12,
    )
    ecc_corrected_warn: int = _key(Limits.ecc_corrected_warn, "warn when volatile corrected ECC errors reach this", low=1, high=10**12)
    healthcheck_skip_s: float = _key(
        120.0, "`healthcheck` exits 0 at once when a healthy prolog/epilog decision was logged this recently and no "
        "unhealthy verdict since (0 = always check)"
    , low=0, high=86400)
    leftover_grace_s: float = _key(10.0, "GPU processes no running job owns are read again after this long (the "
                                   "previous job's CUDA teardown) before `gpu-leftover-processes` drains", low=0, high=600)
    gpu_process_allowlist: tuple[str, ...] = _key(
        ("nvidia-cuda-mps-server", "nvidia-cuda-mps-control", "nv-hostengine", "dcgm-exporter"),
        "process names (`/proc/PID/comm`) allowed on a GPU outside any job")
    orphaned_memory_mib: int = _key(1024, "`gpu-orphaned-memory` drains when a GPU's used memory (reserved memory apart) "
                                    "exceeds its processes' by more than this", low=1, high=10**7)
    cuda_timeout_s: float = _key(10.0, "deadline of the `cuda-init` check (cuInit in a child)", low=0.5, high=600)
    cuda_in_prolog: bool = _key(False, "also run `cuda-init` in every prolog (it costs the driver's CUDA start)")
    cuda_first_prolog: bool = _key(
        True, "the first prolog of each boot runs `cuda-init` unless a check found CUDA working this boot "
        "(the resume unit's sandbox cannot load nvidia-uvm after a boot: the first job's prolog judges it)")


@dataclass(frozen=True)
class HooksConfig:
    """[hooks]: how the Prolog/Epilog fail and log."""
    on_internal_error: str = _key(
        "open",
        "a slurmagent failure (bug, bad config) in a hook: `open` lets the job run and logs it loudly, "
        "`closed` drains the node with `slurmagent: internal error`",
        ("open", "closed"),
    )
    epilog_requeue_failed: bool = _key(True, "epilog requeues a job that failed while its node was unhealthy")
    log_file: str = _key("", "decision log; default `<state_dir>/hooks.log`")
    syslog: bool = _key(True, "also send each decision to syslog/journald")


@dataclass(frozen=True)
class SlurmConfig:
    """[slurm]: the Slurm binaries and their deadline."""
    scontrol: str = _key("scontrol", "scontrol binary")
    sbatch: str = _key("sbatch", "sbatch binary")
    squeue: str = _key("squeue", "squeue binary (the expiry watch and `watch` list the jobs running on the node)")
    scancel: str = _key("scancel", "scancel binary (wrapped jobs are signalled to flush; `watch` cancels a job it cannot requeue)")
    timeout_s: float = _key(10.0, "deadline of one scontrol/squeue/scancel/sbatch call", low=0.5, high=3600)
    conf: str = _key("", "slurm.conf path; default `$SLURM_CONF` or /etc/slurm/slurm.conf (the expected GPU "
                     "count also looks in the configless cache: [health](health.md#the-expected-gpu-count))")


@dataclass(frozen=True)
class GcpConfig:
    """[gcp]: the project, zones and endpoint of the Compute API."""
    project: str = _key("", "default: metadata server")
    zone: str = _key("", "default: metadata server")
    compute_endpoint: str = _key("", "e.g. http://127.0.0.1:PORT for tests; default: Google's")
    zones: tuple[str, ...] = _key(
        (), "more zones where nodes' VMs live (regional MIGs): `repair` looks a VM up in `zone`, then in these "
        "(one `instances.list` each); empty: one `instances.aggregatedList` for VMs not found in `zone`")


@dataclass(frozen=True)
class RepairConfig:
    """[repair]: the circuit breaker, repair strategy and journal bounds."""
    strategy: str = _key(
        "auto",
        "`auto`: per VM, `reportHostAsFaulty` where Google accepts it (running, reservation-bound A3 Ultra/A4/A4X), "
        "else MIG `recreateInstances`; a dynamic (CLOUD / power-saving) node is powered down (`POWER_DOWN_ASAP`); "
        "a VM in no MIG is reported or left drained, never deleted. Or one way for all: `recreate`, "
        "`report-faulty`, `power-down`, `none` (drain only)",
        ("auto", "recreate", "report-faulty", "power-down", "none"))
    exclude_nodes: tuple[str, ...] = _key(
        (), "nodes (hostlists allowed) slurmagent never drains, requeues or repairs; the Slurm node feature "
        "`slurmagent_off` does the same per node")
    adopt_reasons: tuple[str, ...] = _key(
        (), "regular expressions (Python `re.search`) over the Reason of a node drained or down by someone else: "
        "a match hands it to `repair` (re-drained `slurmagent: adopted: <reason>`, then repaired like ours), "
        "e.g. `^Prolog error` for Cluster Toolkit's GPU health prolog. Empty: only `slurmagent:` reasons",
        regex=True)
    max_drained_fraction: float = _key(0.25, "circuit breaker: most nodes slurmagent may hold drained", low=0, high=1)
    retry_after_s: float = _key(
        3600.0, "ask the MIG again when a node is still `repairing` after this long (0: at every run)",
        low=0, high=604800,
    )
    max_repairs_per_day: int = _key(
        3, "per node; beyond this it stays drained for an admin (or `repair --force`)",
        low=0, high=1000,
    )
    api_timeout_s: float = _key(30.0, "timeout of one Compute API request", low=0.1, high=600)
    operation_timeout_s: float = _key(
        120.0, "deadline of one repair request, retries and operation wait included",
        low=0.1, high=86400,
    )
    resume_wait_s: float = _key(300.0, "`resume-if-healthy` waits this long for slurmd to register", low=0, high=86400)
    suppressed_ttl_s: float = _key(
        86400.0, "a circuit-breaker suppression mark older than this stops counting",
        low=1, high=2592000,
    )
    journal_max_pending: int = _key(
        1000, "journal: most pending actions kept (beyond: logged loudly, oldest dropped)",
        low=1, high=1000000,
    )
    journal_max_done: int = _key(500, "journal: done entries kept for `status`", low=0, high=1000000)
    journal_max_age_s: float = _key(
        86400.0, "journal: pending actions older than this are dropped",
        low=60, high=2592000,
    )
    lemon_faults: int = _key(
        3, "a node repaired this many times within `lemon_window_s` is a lemon: listed by `report --state-dir` "
        "and in `slurmagent_lemon_nodes` (0: no node is ever one)", low=0, high=1000)
    lemon_window_s: float = _key(604800.0, "the window of `lemon_faults` (default 7 days)", low=60, high=31536000)
    lemon_action: str = _key(
        "report", "`report`: a lemon is listed, repaired as any node; `report-faulty`: its repair is "
        "`reportHostAsFaulty` (Google moves the VM to another host) where its VM supports it, not a recreate",
        ("report", "report-faulty"))
    allow_non_root: bool = _key(
        False, "let non-root users run `repair` (honoured only from a root-owned config; `--dry-run` is always allowed)")


@dataclass(frozen=True)
class CheckpointConfig:
    """[checkpoint]: where and how often `slurmagent run` syncs checkpoints."""
    remote: str = _key("", "gs://bucket/prefix; STORAGE_EMULATOR_HOST is honoured")
    sync_interval_s: float = _key(60.0, "background sync period of `slurmagent run`", low=0.1, high=86400)
    grace_s: float = _key(90.0, "how long the child may take to checkpoint after the signal", low=0.1, high=86400)
    max_requeues: int = _key(3, "requeue at most this many restarts in a row that committed no new checkpoint", low=0, high=10000)
    signal_lead_s: int = _key(
        300, "`slurmagent sbatch`: end-of-time signal this long before the limit",
        low=0, high=65535,
    )
    transfers: int = _key(16, "files (and slices of big files) one sync or restore moves at once, per node", low=1, high=256)
    parallel_upload_mib: int = _key(
        0, "files from this size (MiB) go up as parallel parts composed into one object (Cloud Storage's parallel "
        "composite upload: faster for big files on Cloud Storage, slower on the emulators, whose compose copies); 0 = off",
        low=0, high=5242880,
    )
    keep_commits: int = _key(
        2, "retention: after each new commit, objects under `blobs/` that none of the last this-many commits "
        "references are deleted (by the job holding the checkpoint; `slurmagent ckpt gc` does it by hand)",
        low=1, high=10000,
    )
    gc_grace_s: float = _key(
        600.0, "retention: an object is deleted only this long after the last commit that referenced it left the "
        "kept ones, and this long after it was written (a restore or sync in flight finishes first)",
        low=0, high=2592000,
    )
    local_cache_gib: float = _key(
        0.0, "node-local cache of committed blobs (a restart on a node that held them reads no bucket): at most "
        "this many GiB held only by the cache (entries that are hard links to files of --ckpt-dir cost nothing); "
        "trimmed before each restore and after each sync; 0 = room for `keep_commits` checkpoints",
        low=0, high=1048576,
    )
    settle_s: float = _key(
        0.5, "a periodic commit takes a folder's files (outside step folders) when more than one of them changed "
        "only once none changed for this long: the gap between one save's consecutive files (a model closed, its "
        "optimizer not yet opened); keep it well under the save period, or those saves starve. Files open for "
        "writing or still under a temporary name are never taken, logs open for appending hold back nothing, "
        "and a set the trainer declared (`trainer.saved`) needs no settling",
        low=0, high=3600,
    )
    keep_uncommitted: int = _key(
        3, "`<dir>.uncommitted/` keeps the newest this-many sets of files moved out of the checkpoint directory at a "
        "start (an earlier job's, an uncommitted step); older sets are deleted, their sizes said",
        low=1, high=1000,
    )
    local_cache: bool = _key(True, "keep that cache and let a multi-node restore's nodes fetch from each other's; "
                             "false: every restore downloads what is not in place")
    local_cache_dir: str = _key(
        "", "where that cache lives on each node; default `<parent of --ckpt-dir>/.slurmagent-cache-<uid>` "
        "(same file system: hard links, no byte stored twice), created 0700")


@dataclass(frozen=True)
class ExpiryConfig:
    """[expiry]: drain and flush ahead of the VM's end."""
    termination_time: str = _key("", "RFC 3339 override; default: the Compute API")
    drain_lead_s: float = _key(1800.0, "drain this long before termination", low=0, high=604800)
    flush_lead_s: float = _key(120.0, "flush running jobs this long before termination", low=0, high=604800)
    prolog_guard: str = _key(
        "requeue",
        "a job whose time limit ends after `termination - flush_lead_s`: `requeue` drains the node with the expiry "
        "reason and fails the prolog (the job runs elsewhere) unless the job is wrapped (it flushes at the lead), "
        "`requeue-all` does so for wrapped jobs too, `warn` only logs, `off`",
        ("requeue", "requeue-all", "warn", "off"),
    )
    unwrapped_jobs: str = _key(
        "requeue",
        "at the flush, jobs whose batch script does not exec `slurmagent run`: `requeue`, `signal` (USR1, which "
        "kills a script that does not trap it), `leave`",
        ("requeue", "signal", "leave"),
    )
    drain_at_max_time: bool = _key(
        False, "also drain when the lifetime left is below the node's largest partition MaxTime (only when all are finite)")
    refresh_s: float = _key(
        3600.0, "ask the Compute API again after this long (the answer is cached per boot)",
        low=1, high=604800,
    )
    api_timeout_s: float = _key(20.0, "deadline of the Compute API read (retries included)", low=0.1, high=600)
    compute_api: bool = _key(
        True, "learn the termination time from the Compute API (`instances.get`); false: from the metadata server's "
        "maintenance and preemption notices alone, for VMs without Compute permission by design (a flex-start or "
        "max-run-duration end is then not seen)")
    metadata_timeout_s: float = _key(
        2.0, "deadline of one metadata server read (a long poll waits this much longer)",
        low=0.1, high=600,
    )
    publish_run_file: bool = _key(
        True, "also write a world-readable copy of the expiry state (`run_file`) for wrappers running as the job's user")
    run_file: str = _key("/run/slurmagent/%n/expiry.json",
                         "where that world-readable copy goes (`%n` = node name: a wrapper reads its own node's)")


@dataclass(frozen=True)
class WatchConfig:
    """[watch]: what the watch does to jobs on a GPU that failed."""
    running_jobs: str = _key(
        "requeue",
        "`watch`/`healthcheck` found a GPU unusable (lost, missing, NVML down, an XID asking for a GPU reset or a node "
        "reboot) under running jobs: `requeue` requeues the unwrapped ones at once (cancels one that is not "
        "requeueable) and those wrapped jobs that did not leave after their fault flush; `leave` only drains (wrapped "
        "jobs are still told to flush)",
        ("requeue", "leave"),
    )
    flush_deadline_s: float = _key(
        60.0, "a wrapped job told to flush for a GPU fault that is still on the node after this long is requeued",
        low=1, high=3600)
    channel_socket: str = _key(
        "/run/slurmagent/%n/channel.sock",
        "where `watch` listens for its node's wrapped jobs (per-job metrics, hang/straggler drains; judged by the "
        "caller's uid and the job as Slurm shows it; `%n` = node name); empty = no channel")
    hang_count_min_run_s: float = _key(
        120.0, "a job's hang that names no node is counted against its nodes (the lemon count) only when the job's "
        "attempt has run this long as Slurm says (squeue's time used): short jobs cannot make a node a lemon",
        low=0, high=86400)


@dataclass(frozen=True)
class RunConfig:
    """[run]: the wrapper's hang and straggler watch (`slurmagent run`)."""
    hang_timeout_s: float = _key(
        -1.0, "no progress (the ranks' `trainer.progress`, the checkpoint directory, the job's output) for this long "
        "after the first progress is a hang (silence alone): evidence, the suspect node drained, the job requeued; "
        "-1 = adaptive (a hang shown by evidence: see hang_floor_s, hang_ceiling_s, hang_blind_floor_s), 0 = off",
        low=-1, high=604800)
    hang_first_progress_s: float = _key(
        1800.0, "the first progress after the trainer starts may take this long (a restore's load, a slow first step)",
        low=1, high=604800)
    hang_floor_s: float = _key(
        120.0, "adaptive rule: the short limit's least (5x the longest gap, at least this): past it a silence is a "
        "hang only with evidence that no rank can go on (a rank stopped, gone or a zombie; every rank's stack "
        "unchanged across the samples)", low=1, high=86400)
    hang_ceiling_s: float = _key(
        1800.0, "adaptive rule: the longest a silence may last, however the ranks' stacks move (a rank moving "
        "through its own code extends the limit up to this; `trainer.phase(expected_s=)` may say longer)",
        low=1, high=604800)
    hang_stack_samples: bool = _key(
        True, "adaptive rule: read the ranks' Python stacks (py-spy --nonblocking) through a silence as evidence; "
        "false: never (the hang_blind_floor_s floor then applies)")
    hang_blind_floor_s: float = _key(
        900.0, "adaptive rule without stacks (py-spy not installed, ptrace denied): a silence is never a hang sooner "
        "(past PyTorch's own NCCL collective timeout, 10 minutes: that fires first on a collective hang)", low=1, high=604800)
    straggler_window_s: float = _key(60.0, "per-rank seconds per step (ranks in lockstep: busy seconds per step, "
                                     "docs/user/hangs.md) are compared over windows this long", low=1,
                                     high=86400)
    straggler_factor: float = _key(2.0, "a rank this many times slower than the other ranks' median is slow",
                                   low=1.01, high=1000)
    straggler_windows: int = _key(3, "slow for this many windows in a row: a straggler", low=1, high=10000)
    straggler_action: str = _key(
        "report", "a straggler is `report`ed (job stderr, decision log through the root channel) or its node is "
        "also `drain`ed (through the channel and the breaker; the node leaves at the job's next requeue)",
        ("report", "drain"))


@dataclass(frozen=True)
class ChecksConfig:
    """[checks]: the kill switches of the health checks (`slurmagent check --list`)."""
    off: tuple[str, ...] = _key((), "names of default-on checks not to run")
    on: tuple[str, ...] = _key((), "names of default-off checks to run")


@dataclass(frozen=True)
class MetricsConfig:
    """[metrics]: the Prometheus textfile."""
    textfile: str = _key("", "Prometheus textfile-collector file; default `<state_dir>/slurmagent.prom` (`%n` = node name), "
                         "which node_exporter cannot read (0750 root): `install`'s config sets it to node_exporter's "
                         "textfile directory")


@dataclass(frozen=True)
class Config:
    """The whole config file, one field per section."""
    state_dir: str = _key("/var/lib/slurmagent", "journal, kernel-log cursor, expiry state (`%n` = node name)")
    health: HealthConfig = field(default_factory=HealthConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    gcp: GcpConfig = field(default_factory=GcpConfig)
    repair: RepairConfig = field(default_factory=RepairConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    expiry: ExpiryConfig = field(default_factory=ExpiryConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    run: RunConfig = field(default_factory=RunConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    source: str = field(default="(defaults)", metadata={"internal": True})

    def node_path(self, template: str, node: str | None) -> str:
        """Expand `%n` (Slurm's node-name placeholder) so one config serves several slurmd per host."""
        return template.replace("%n", node or "") if template else template

    def state_path(self, node: str | None) -> Path:
        return Path(self.node_path(self.state_dir, node))


SECTIONS = {f.name: f.type for f in fields(Config) if f.name not in ("state_dir", "source")}
_SECTION_CLASSES = {
    "health": HealthConfig,
    "hooks": HooksConfig,
    "slurm": SlurmConfig,
    "gcp": GcpConfig,
    "repair": RepairConfig,
    "checkpoint": CheckpointConfig,
    "expiry": ExpiryConfig,
    "watch": WatchConfig,
    "run": RunConfig,
    "metrics": MetricsConfig,
    "checks": ChecksConfig,
}


def config_path(explicit: str | None = None) -> tuple[Path, bool]:
    """The file to read and whether it must exist (only the built-in default may be absent)."""
    if explicit:
        return Path(explicit), True
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env), True
    return Path(DEFAULT_PATH), False


def load(explicit: str | None = None, *, for_root_hook: bool = False) -> Config:
    """The config; `for_root_hook`: only from a file only root could have written (ConfigError)."""
    path, required = config_path(explicit)
    try:
        raw_bytes = read_trusted(path, follow_final=True) if for_root_hook else path.read_bytes()
    except UntrustedFile as exc:
        raise ConfigError(f"config {path}: refused: {exc.strerror}") from None
    except FileNotFoundError:
        if required:
            raise ConfigError(f"config {path}: file not found") from None
        return Config()
    except OSError as exc:
        raise ConfigError(f"config {path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw_bytes.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config {path}: not valid TOML: {exc}") from None
    return parse(data, str(path))


def check_safe_permissions(path: Path) -> None:
    """A root hook must not read a file that a non-root user can change or re-point: the file,
    every directory above the path as written and every symlink on the way (read_trusted is
    the reading half of this, on one open file)."""
    if not os.path.lexists(path):
        raise ConfigError(f"config {path}: cannot stat {path}: No such file or directory")
    why = untrusted_reason(path, follow_final=True)
    if why:
        raise ConfigError(f"config {path}: refused: {why}")


def parse(data: dict[str, Any], source: str = "config") -> Config:
    kwargs: dict[str, Any] = {"source": source}
    for key, value in data.items():
        if key == "state_dir":
            kwargs[key] = _coerce(Config, "state_dir", value, source, "state_dir")
        elif key in _SECTION_CLASSES:
            if not isinstance(value, dict):
                raise ConfigError(f"config {source}: [{key}] must be a table")
            kwargs[key] = _section(_SECTION_CLASSES[key], key, value, source)
        else:
            raise ConfigError(f"config {source}: unknown key '{key}'")
    cfg = Config(**kwargs)
    validate_paths(cfg.health, source)
    return cfg


def _section(cls: type, name: str, table: dict[str, Any], source: str) -> Any:
    known = {f.name for f in fields(cls)}
    out = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"config {source}: unknown key '{name}.{key}'")
        out[key] = _coerce(cls, key, value, source, f"{name}.{key}")
        unknown = [n for n in out[key] if n not in CHECK_NAMES] if cls is ChecksConfig else []
        if unknown:
            raise ConfigError(f"config {source}: '{name}.{key}' names no check: {unknown[0]!r} (slurmagent check --list)")
    return cls(**out)


_TYPE_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
               "tuple[str, ...]": "a list of strings"}


def _coerce(cls: type, key: str, value: Any, source: str, dotted: str) -> Any:
    f = next(f for f in fields(cls) if f.name == key)
    typ = str(f.type)
    ok = {
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "tuple[str, ...]": isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value),
    }[typ]
    if not ok:
        raise ConfigError(f"config {source}: '{dotted}' must be {_TYPE_NAMES[typ]}, not {type(value).__name__}")
    if typ == "float" and not math.isfinite(value):
        raise ConfigError(f"config {source}: '{dotted}' must be a finite number, not {value}")
    low, high = f.metadata.get("range", (None, None))
    if typ in ("int", "float") and not ((0 if low is None else low) <= value <= (math.inf if high is None else high)):
        # a zero deadline spins, 1e308 overflows a timer at run time: refuse both here, at load
        raise ConfigError(f"config {source}: '{dotted}' = {value} is out of range ({_range_text(f)})")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"config {source}: '{dotted}' must be one of {', '.join(choices)}, not {value!r}")
    if typ == "tuple[str, ...]":
        for pattern in value if f.metadata.get("regex") else ():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"config {source}: '{dotted}' entry {pattern!r} is not a valid regular "
                                  f"expression: {exc}") from None
        return tuple(value)
    return float(value) if typ == "float" else value


def out_of_range(dotted: str, value: float) -> str | None:
    """The allowed range of key `dotted` (e.g. `checkpoint.grace_s`) when `value` is outside it:
    a command-line option that overrides a key obeys the key's bounds."""
    section, _, name = dotted.partition(".")
    f = next(f for f in fields(_SECTION_CLASSES[section]) if f.name == name)
    low, high = f.metadata.get("range", (None, None))
    inside = math.isfinite(value) and (0 if low is None else low) <= value <= (math.inf if high is None else high)
    return None if inside else _range_text(f)


def _range_text(f: Any) -> str:
    low, high = f.metadata.get("range", (None, None))
    return f"{0 if low is None else low} .. {'' if high is None else high}".strip()


def reference_markdown() -> str:
    """The config reference table of docs/admin/configuration.md, generated from the schema."""
    rows = ["| key | default | range | meaning |", "|---|---|---|---|"]
    for f in fields(Config):
        if f.metadata.get("internal"):
            continue
        if f.name == "state_dir":
            rows.append(f"| `state_dir` | `{f.default!r}` | | {f.metadata['doc']} |".replace("'", '"'))
            continue
        for sf in fields(_SECTION_CLASSES[f.name]):
            default = sf.default
            if isinstance(default, bool):
                shown = str(default).lower()
            elif isinstance(default, tuple):
                shown = json.dumps(list(default))
            else:
                shown = repr(default).replace("'", '"')
            numeric = str(sf.type) in ("int", "float")
            allowed = f"`{_range_text(sf)}`" if numeric else ""
            rows.append(f"| `{f.name}.{sf.name}` | `{shown}` | {allowed} | {sf.metadata['doc']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_markdown())
