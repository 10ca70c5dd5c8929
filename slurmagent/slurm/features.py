"""What the running Slurm does itself that slurmagent would otherwise do by hand (25.11+).

One `scontrol show config` tells both, and whether the controller turned them on:

* the expedited requeue (`sbatch --requeue=expedite`, honoured only with
  `SlurmctldParameters=enable_expedited_requeue`; sbatch refuses the option without it): a
  requeued job is eligible at once, with the highest priority, instead of waiting
  `requeue_delay` (default: `cred_expire`, 120 s) after each requeue, ours included; Slurm
  requeues it itself on a node failure. The price: a job that fails by itself (non-zero exit,
  every Epilog fine) is held (REQUEUE_HOLD) instead of FAILED.
* slurmctld's own OpenMetrics endpoint (`MetricsType=metrics/openmetrics`; `GET /metrics/jobs`,
  `/metrics/nodes`, ... on SlurmctldPort): cluster-wide job and node gauges beside our per-node
  textfile metrics, open to anyone unless PrivateData or MetricsAuthUsers restrict it.

Pure: the parsers and decisions take text and options, never run a command.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SINCE = (25, 11)  # both came with Slurm 25.11
EXPEDITE = "--requeue=expedite"
METRICS_PATHS = ("/metrics/jobs", "/metrics/nodes", "/metrics/partitions", "/metrics/scheduler")


def parse_show_config(text: str) -> dict[str, str]:
    """`scontrol show config` as {key: value}; Slurm's "(null)" reads as ""."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(" = ")
        key, value = key.strip(), value.strip()
        if sep and key and " " not in key and key not in out:  # the first section (slurm.conf) wins
            out[key] = "" if value == "(null)" else value
    return out


def parse_version(text: str) -> tuple[int, ...]:
    """"26.05.5" -> (26, 5, 5); a suffix ("24.11.0-0rc1") ends it; () when unreadable."""
    parts = []
    for piece in text.strip().split("."):
        digits = ""
        for ch in piece:
            if ch not in "0123456789":  # str.isdigit() is also true of "²"
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


def _names(value: str) -> frozenset[str]:
    """A comma list of parameters ("a,b=3") by name: {"a", "b"}."""
    return frozenset(p.split("=", 1)[0].strip().lower() for p in value.split(",") if p.strip())


VERSION_KEY = "SLURM_VERSION"  # a key of `scontrol show config`'s output, not an environment variable


@dataclass(frozen=True)
class SlurmFeatures:
    version: tuple[int, ...] = ()
    ctld_params: frozenset[str] = frozenset()
    metrics_type: str = ""
    metrics_params: frozenset[str] = frozenset()
    metrics_auth_users: str = ""
    private_data: str = ""
    comm_params: frozenset[str] = frozenset()
    ctld_port: int | None = None

    @classmethod
    def from_config(cls, conf: dict[str, str]) -> SlurmFeatures:
        port = conf.get("SlurmctldPort", "").split("-", 1)[0]  # a range "6817-6818" listens on its first
        return cls(version=parse_version(conf.get(VERSION_KEY, "")),
                   ctld_params=_names(conf.get("SlurmctldParameters", "")),
                   metrics_type=conf.get("MetricsType", ""), metrics_params=_names(conf.get("MetricsParameters", "")),
                   metrics_auth_users=conf.get("MetricsAuthUsers", ""),
                   private_data="" if conf.get("PrivateData", "").lower() in ("", "none") else conf["PrivateData"],
                   comm_params=_names(conf.get("CommunicationParameters", "")),
                   ctld_port=int(port) if port.isdigit() else None)

    @property
    def version_text(self) -> str:
        return ".".join(f"{v:02d}" if i == 1 else str(v) for i, v in enumerate(self.version)) or "unknown"

    @property
    def expedited_requeue(self) -> bool:
        """The controller honours `--requeue=expedite` (and sbatch accepts it)."""
        return self.version >= SINCE and "enable_expedited_requeue" in self.ctld_params

    @property
    def openmetrics(self) -> bool:
        """slurmctld answers `GET /metrics/...` on SlurmctldPort."""
        return (self.version >= SINCE and self.metrics_type == "metrics/openmetrics"
                and "disable_http" not in self.comm_params)

    @property
    def metrics_need_token(self) -> bool:
        """Only root, SlurmUser and MetricsAuthUsers may read it (with a JWT): a plain scrape is refused."""
        return bool(self.metrics_auth_users) or (bool(self.private_data)
                                                 and "ignore_private_data" not in self.metrics_params)


def user_chose_requeue(sbatch_opts: list[str], env: dict[str, str] | None = None) -> bool:
    """The user's own --requeue[=...] / --no-requeue (or SBATCH_REQUEUE / SBATCH_NO_REQUEUE) wins."""
    if any(o in ("--requeue", "--no-requeue") or o.startswith("--requeue=") for o in sbatch_opts):
        return True
    return bool(env) and any(k in env for k in ("SBATCH_REQUEUE", "SBATCH_NO_REQUEUE"))


def user_chose_open_mode(sbatch_opts: list[str], env: dict[str, str] | None = None) -> bool:
    """The user's own --open-mode (or SBATCH_OPEN_MODE) wins over the `append` slurmagent adds:
    Slurm truncates the job's output at each requeue otherwise, and the first attempt's lines
    (the flush, the hang evidence's context) go with it."""
    if any(o == "--open-mode" or o.startswith("--open-mode=") for o in sbatch_opts):
        return True
    return bool(env) and "SBATCH_OPEN_MODE" in env


def requeue_option(features: SlurmFeatures | None) -> str:
    """What `slurmagent sbatch` adds when the user chose nothing: the expedited requeue where the
    controller honours it, else `--requeue` (an unreadable config: `--requeue`, as before 25.11)."""
    return EXPEDITE if features is not None and features.expedited_requeue else "--requeue"


def controller_address(conf: dict[str, str]) -> str:
    """The primary slurmctld's address: `SlurmctldHost[0] = name(addr)` -> addr, else name."""
    value = conf.get("SlurmctldHost[0]") or conf.get("SlurmctldHost") or ""
    m = re.fullmatch(r"([^(\s]+)(?:\(([^)]+)\))?", value.strip())
    return (m.group(2) or m.group(1)) if m else ""


def doctor_line(features: SlurmFeatures, url: str, answer: str | None) -> tuple[bool, str, bool]:
    """`doctor`'s (ok, detail, skipped): what the controller runs, and why its metrics endpoint
    did not answer (None: it did, or was not asked). Fails only for an endpoint configured but silent."""
    if features.version < SINCE:
        return True, f"Slurm {features.version_text}: none (the expedited requeue and the metrics endpoint came in 25.11)", True
    parts = [("expedited requeue on: slurmagent sbatch submits --requeue=expedite" if features.expedited_requeue
              else "expedited requeue off (SlurmctldParameters=enable_expedited_requeue turns it on)")]
    ok = True
    if not features.openmetrics:
        parts.append("slurmctld metrics off (MetricsType=metrics/openmetrics turns them on)")
    elif answer is not None:
        ok = False
        parts.append(f"slurmctld metrics configured at {url} but it does not answer: {answer}")
    else:
        need = " (needs a JWT: PrivateData/MetricsAuthUsers)" if features.metrics_need_token else ""
        parts.append(f"slurmctld metrics on at {url}{need} (scrape: contrib/prometheus/scrape.yml)")
    return ok, f"Slurm {features.version_text}: " + "; ".join(parts), False
