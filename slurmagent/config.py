"""The TOML config file: typed, validated, every key optional.

An unknown key or a wrong type is a ConfigError naming the key and the file. The schema is
the dataclasses below; the README's config reference is generated from them
(`python -m slurmagent.config`), and a test keeps the two in step.
"""

from __future__ import annotations

import math
import os
import stat
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import ConfigError

DEFAULT_PATH = "/etc/slurmagent/config.toml"
ENV_VAR = "SLURMAGENT_CONFIG"


def _key(default: Any, doc: str, choices: tuple[str, ...] = ()) -> Any:
    return field(default=default, metadata={"doc": doc, "choices": choices})


@dataclass(frozen=True)
class HealthConfig:
    snapshot: str = _key("", "replay snapshot to read instead of NVML (`%n` = node name)")
    expected_gpus: int = _key(0, "0 = the node's GPU count from slurm.conf/gres.conf, else this number")
    timeout_s: float = _key(15.0, "deadline of the whole check; a hung NVML read is an unhealthy verdict")
    kernel_log: str = _key("", "file to read for NVRM Xid lines instead of the kernel log (`%n` = node name)")
    kernel_log_enabled: bool = _key(True, "read XIDs from the kernel log at all")
    temperature_warn_c: float = _key(85.0, "warn (not drain) at or above this GPU temperature")
    nvlink_errors_warn: int = _key(1000, "warn when a link's replay+recovery+CRC counters reach this")
    ecc_corrected_warn: int = _key(10000, "warn when volatile corrected ECC errors reach this")
    healthcheck_skip_s: float = _key(
        120.0, "`healthcheck` exits 0 at once when a prolog/epilog decision was logged this recently (0 = always check)"
    )


@dataclass(frozen=True)
class HooksConfig:
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
    scontrol: str = _key("scontrol", "scontrol binary")
    sbatch: str = _key("sbatch", "sbatch binary")
    timeout_s: float = _key(10.0, "deadline of one scontrol/sbatch call")
    conf: str = _key("", "slurm.conf path; default `$SLURM_CONF` or /etc/slurm/slurm.conf")


@dataclass(frozen=True)
class GcpConfig:
    project: str = _key("", "default: metadata server")
    zone: str = _key("", "default: metadata server")
    compute_endpoint: str = _key("", "e.g. http://127.0.0.1:PORT for tests; default: Google's")


@dataclass(frozen=True)
class RepairConfig:
    strategy: str = _key("recreate", "recreate | report-faulty | none", ("recreate", "report-faulty", "none"))
    max_drained_fraction: float = _key(0.25, "circuit breaker: most nodes slurmagent may hold drained")
    retry_after_s: float = _key(3600.0, "ask the MIG again when a node is still `repairing` after this long")
    max_repairs_per_day: int = _key(3, "per node; beyond this it stays drained for an admin (or `repair --force`)")
    api_timeout_s: float = _key(30.0, "timeout of one Compute API request")
    operation_timeout_s: float = _key(120.0, "deadline of one repair request, retries and operation wait included")
    resume_wait_s: float = _key(300.0, "`resume-if-healthy` waits this long for slurmd to register")
    suppressed_ttl_s: float = _key(86400.0, "a circuit-breaker suppression mark older than this stops counting")
    journal_max_pending: int = _key(1000, "journal: most pending actions kept (beyond: logged loudly, oldest dropped)")
    journal_max_done: int = _key(500, "journal: done entries kept for `status`")
    journal_max_age_s: float = _key(86400.0, "journal: pending actions older than this are dropped")
    allow_non_root: bool = _key(
        False, "let non-root users run `repair` (honoured only from a root-owned config; `--dry-run` is always allowed)")


@dataclass(frozen=True)
class CheckpointConfig:
    remote: str = _key("", "gs://bucket/prefix; STORAGE_EMULATOR_HOST is honoured")
    sync_interval_s: float = _key(60.0, "background sync period of `slurmagent run`")
    grace_s: float = _key(90.0, "how long the child may take to checkpoint after the signal")
    max_requeues: int = _key(3, "requeue at most this many restarts in a row that committed no new checkpoint")
    signal_lead_s: int = _key(300, "`slurmagent sbatch`: end-of-time signal this long before the limit")


@dataclass(frozen=True)
class ExpiryConfig:
    termination_time: str = _key("", "RFC 3339 override; default: the Compute API")
    drain_lead_s: float = _key(1800.0, "drain this long before termination")
    flush_lead_s: float = _key(120.0, "flush running jobs this long before termination")
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
    refresh_s: float = _key(3600.0, "ask the Compute API again after this long (the answer is cached per boot)")
    api_timeout_s: float = _key(20.0, "deadline of the Compute API read (retries included)")
    metadata_timeout_s: float = _key(2.0, "deadline of one metadata server read (a long poll waits this much longer)")
    publish_run_file: bool = _key(
        True, "also write /run/slurmagent/expiry.json (world-readable) for wrappers running as the job's user")


@dataclass(frozen=True)
class MetricsConfig:
    textfile: str = _key("", "Prometheus textfile-collector file; default `<state_dir>/slurmagent.prom` (`%n` = node name)")


@dataclass(frozen=True)
class Config:
    state_dir: str = _key("/var/lib/slurmagent", "journal, kernel-log cursor, expiry state (`%n` = node name)")
    health: HealthConfig = field(default_factory=HealthConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    gcp: GcpConfig = field(default_factory=GcpConfig)
    repair: RepairConfig = field(default_factory=RepairConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    expiry: ExpiryConfig = field(default_factory=ExpiryConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
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
    "metrics": MetricsConfig,
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
    path, required = config_path(explicit)
    try:
        raw_bytes = path.read_bytes()
    except FileNotFoundError:
        if required:
            raise ConfigError(f"config {path}: file not found") from None
        return Config()
    except OSError as exc:
        raise ConfigError(f"config {path}: cannot read: {exc.strerror or exc}") from None
    if for_root_hook:
        check_safe_permissions(path)
    try:
        data = tomllib.loads(raw_bytes.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config {path}: not valid TOML: {exc}") from None
    return parse(data, str(path))


def check_safe_permissions(path: Path) -> None:
    """A root hook must not read a file (or a directory above it) that a non-root user can change."""
    for p in [path, *path.resolve().parents]:
        try:
            st = p.stat()
        except OSError as exc:
            raise ConfigError(f"config {path}: cannot stat {p}: {exc.strerror}") from None
        sticky = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
        if st.st_uid != 0 or (st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky):
            raise ConfigError(
                f"config {path}: refused: {p} is writable by non-root users or not owned by root "
                f"(owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)})"
            )
        if p == p.parent:
            break


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
    return Config(**kwargs)


def _section(cls: type, name: str, table: dict[str, Any], source: str) -> Any:
    known = {f.name for f in fields(cls)}
    out = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"config {source}: unknown key '{name}.{key}'")
        out[key] = _coerce(cls, key, value, source, f"{name}.{key}")
    return cls(**out)


_TYPE_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}


def _coerce(cls: type, key: str, value: Any, source: str, dotted: str) -> Any:
    f = next(f for f in fields(cls) if f.name == key)
    typ = str(f.type)
    ok = {
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
    }[typ]
    if not ok:
        raise ConfigError(f"config {source}: '{dotted}' must be {_TYPE_NAMES[typ]}, not {type(value).__name__}")
    if typ == "float" and not math.isfinite(value):
        raise ConfigError(f"config {source}: '{dotted}' must be a finite number, not {value}")
    if typ in ("int", "float") and value < 0:
        raise ConfigError(f"config {source}: '{dotted}' must not be negative")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"config {source}: '{dotted}' must be one of {', '.join(choices)}, not {value!r}")
    return float(value) if typ == "float" else value


def reference_markdown() -> str:
    """The config reference table for the README, generated from the schema."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for f in fields(Config):
        if f.metadata.get("internal"):
            continue
        if f.name == "state_dir":
            rows.append(f"| `state_dir` | `{f.default!r}` | {f.metadata['doc']} |".replace("'", '"'))
            continue
        for sf in fields(_SECTION_CLASSES[f.name]):
            default = sf.default
            shown = str(default).lower() if isinstance(default, bool) else repr(default).replace("'", '"')
            rows.append(f"| `{f.name}.{sf.name}` | `{shown}` | {sf.metadata['doc']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_markdown())
