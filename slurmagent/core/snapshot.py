"""The replay format (``"schema": 1``): a node's GPU state as read from NVML, or from a file.

Every measured field is optional: ``None`` (or an absent key in JSON) means "not measured"
and never counts as a fault. Unknown keys are ignored so newer writers stay readable.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SnapshotError

SCHEMA = 1


@dataclass
class Ecc:
    """ECC error counters of one GPU."""
    volatile_uncorrected: int | None = None
    aggregate_uncorrected: int | None = None
    volatile_corrected: int | None = None


@dataclass
class RemappedRows:
    """Row remapping state of one GPU."""
    correctable: int | None = None
    uncorrectable: int | None = None
    pending: bool | None = None
    failure: bool | None = None


@dataclass
class RetiredPages:
    """Retired pages of one GPU (pre-Ampere)."""
    sbe: int | None = None
    dbe: int | None = None
    pending: bool | None = None


@dataclass
class Pcie:
    """PCIe link generation and width, current and max."""
    gen: int | None = None
    max_gen: int | None = None
    width: int | None = None
    max_width: int | None = None


@dataclass
class NvLink:
    """One NVLink's state and error counters."""
    link: int
    active: bool | None = None
    replay_errors: int | None = None
    recovery_errors: int | None = None
    crc_errors: int | None = None


@dataclass
class Memory:
    """Frame buffer of one GPU in MiB (NVML's v2 memory info: `used` leaves out `reserved`)."""
    total_mib: int | None = None
    used_mib: int | None = None
    reserved_mib: int | None = None


@dataclass
class GpuProcess:
    """A compute process on one GPU (nvmlDeviceGetComputeRunningProcesses)."""
    pid: int
    used_mib: int | None = None
    name: str | None = None  # /proc/PID/comm when readable
    user: str | None = None


@dataclass
class Fabric:
    """The GPU's NVSwitch fabric (nvmlDeviceGetGpuFabricInfo[V]); absent where the GPU has none."""
    state: str | None = None  # "not_started" | "in_progress" | "completed"
    status: str | None = None  # NVML return name of the fabric's probe, "NVML_SUCCESS" when fine


@dataclass
class CudaProbe:
    """What `cuInit` + `cuDeviceGetCount` answered (the `cuda-init` check; a snapshot may carry it)."""
    devices: int | None = None
    error: str | None = None  # CUDA_ERROR_* name, "timeout" or "libcuda: ..." when it failed


@dataclass
class XidEvent:
    """One XID seen on a GPU."""
    xid: int
    time: str | None = None  # RFC 3339, UTC
    detail: str | None = None


@dataclass
class GpuState:
    """Everything the checks read about one GPU."""
    index: int
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    lost: bool = False
    temperature_c: float | None = None
    power_w: float | None = None
    persistence_mode: bool | None = None
    ecc: Ecc = field(default_factory=Ecc)
    remapped_rows: RemappedRows = field(default_factory=RemappedRows)
    retired_pages: RetiredPages = field(default_factory=RetiredPages)
    pcie: Pcie = field(default_factory=Pcie)
    nvlink: list[NvLink] = field(default_factory=list)
    clocks_event_reasons: list[str] | None = None
    recovery_action: int | None = None
    xid_events: list[XidEvent] = field(default_factory=list)
    memory: Memory = field(default_factory=Memory)
    processes: list[GpuProcess] | None = None  # None: not measured
    fabric: Fabric | None = None  # None: no fabric (or not measured)


@dataclass
class NodeSnapshot:
    """One reading of all the node's GPUs."""
    hostname: str | None = None
    driver_version: str | None = None
    nvml_error: str | None = None
    gpus: list[GpuState] = field(default_factory=list)
    schema: int = SCHEMA
    cuda: CudaProbe | None = None

    def to_dict(self) -> dict[str, Any]:
        return _prune(
            {
                "schema": self.schema,
                "hostname": self.hostname,
                "driver_version": self.driver_version,
                "nvml_error": self.nvml_error,
                "gpus": [_gpu_to_dict(g) for g in self.gpus],
                "cuda": None if self.cuda is None else _prune(vars(self.cuda)),
            },
            keep=("nvml_error",),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, data: Any, source: str = "snapshot") -> NodeSnapshot:
        if not isinstance(data, dict):
            raise SnapshotError(f"{source}: top level must be a JSON object")
        schema = data.get("schema")
        if schema != SCHEMA or isinstance(schema, bool):
            raise SnapshotError(f"{source}: unsupported schema {schema!r} (this slurmagent reads schema {SCHEMA})")
        gpus_raw = data.get("gpus", [])
        if not isinstance(gpus_raw, list):
            raise SnapshotError(f"{source}: 'gpus' must be a list")
        try:
            snap = cls(
                hostname=_opt(data, "hostname", str, "snapshot"),
                driver_version=_opt(data, "driver_version", str, "snapshot"),
                nvml_error=_opt(data, "nvml_error", str, "snapshot"),
                gpus=[_gpu_from_dict(g, i) for i, g in enumerate(gpus_raw)],
                cuda=_cuda_from(data.get("cuda")),
            )
        except (TypeError, ValueError) as exc:
            raise SnapshotError(f"{source}: {exc}") from None
        first_at: dict[int, int] = {}
        for position, gpu in enumerate(snap.gpus):  # one GPU listed twice would count twice toward expected_gpus
            if gpu.index in first_at:
                raise SnapshotError(f"{source}: gpus[{position}].index {gpu.index} repeats gpus[{first_at[gpu.index]}]'s")
            first_at[gpu.index] = position
        return snap


def load(path: str | os.PathLike[str]) -> NodeSnapshot:
    """Read a replay snapshot; any problem is a SnapshotError naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SnapshotError(f"snapshot {path} is not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SnapshotError(f"snapshot {path} is not valid JSON: line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    except RecursionError:  # the parser's own limit; a real snapshot nests four levels deep
        raise SnapshotError(f"snapshot {path} is not a snapshot: JSON nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise SnapshotError(f"snapshot {path} is not a snapshot: {exc}") from None
    return NodeSnapshot.from_dict(data, source=f"snapshot {path}")


# --- conversion helpers -------------------------------------------------------------------

_SUB = {"ecc": Ecc, "remapped_rows": RemappedRows, "retired_pages": RetiredPages, "pcie": Pcie, "memory": Memory}


def _gpu_to_dict(g: GpuState) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": g.index,
        "uuid": g.uuid,
        "name": g.name,
        "pci_bus_id": g.pci_bus_id,
        "lost": g.lost,
        "temperature_c": g.temperature_c,
        "power_w": g.power_w,
        "persistence_mode": g.persistence_mode,
    }
    for key in _SUB:
        sub = _prune(vars(getattr(g, key)))
        if sub:
            out[key] = sub
    if g.nvlink:
        out["nvlink"] = [_prune(vars(link)) for link in g.nvlink]
    out["clocks_event_reasons"] = g.clocks_event_reasons
    out["recovery_action"] = g.recovery_action
    if g.xid_events:
        out["xid_events"] = [_prune(vars(e)) for e in g.xid_events]
    if g.processes is not None:
        out["processes"] = [_prune(vars(p)) for p in g.processes]
    if g.fabric is not None:
        out["fabric"] = _prune(vars(g.fabric))
    return _prune(out)


def _gpu_from_dict(d: Any, position: int) -> GpuState:
    if not isinstance(d, dict):
        raise TypeError(f"gpus[{position}] must be an object")
    where = f"gpus[{position}]"
    index = d.get("index", position)
    if not isinstance(index, int) or isinstance(index, bool):
        raise TypeError(f"{where}.index must be an integer")
    if index < 0:
        raise ValueError(f"{where}.index must not be negative, not {index}")
    kwargs: dict[str, Any] = {"index": index}
    for key, typ in (
        ("uuid", str),
        ("name", str),
        ("pci_bus_id", str),
        ("lost", bool),
        ("temperature_c", (int, float)),
        ("power_w", (int, float)),
        ("persistence_mode", bool),
        ("recovery_action", int),
    ):
        value = _opt(d, key, typ, where)
        if value is not None:
            kwargs[key] = value
    for key, cls in {**_SUB, "fabric": Fabric}.items():  # fabric: None where the GPU has none
        sub = d.get(key)
        if sub is None:
            continue
        if not isinstance(sub, dict):
            raise TypeError(f"{where}.{key} must be an object")
        kwargs[key] = _build(cls, sub, f"{where}.{key}")
    links = d.get("nvlink") or []
    if not isinstance(links, list):
        raise TypeError(f"{where}.nvlink must be a list")
    kwargs["nvlink"] = []
    for i, link in enumerate(links):
        if not isinstance(link, dict):
            raise TypeError(f"{where}.nvlink[{i}] must be an object")
        raw = {**link, "link": i if link.get("link") is None else link["link"]}  # null = absent: the position
        kwargs["nvlink"].append(_build(NvLink, raw, f"{where}.nvlink[{i}]"))
    reasons = d.get("clocks_event_reasons")
    if reasons is not None:
        if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
            raise TypeError(f"{where}.clocks_event_reasons must be a list of strings")
        kwargs["clocks_event_reasons"] = list(reasons)
    events = d.get("xid_events") or []
    if not isinstance(events, list):
        raise TypeError(f"{where}.xid_events must be a list")
    kwargs["xid_events"] = []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or not isinstance(e.get("xid"), int) or isinstance(e.get("xid"), bool):
            raise TypeError(f"{where}.xid_events[{i}] needs an integer 'xid'")
        at = f"{where}.xid_events[{i}]"
        kwargs["xid_events"].append(
            XidEvent(xid=e["xid"], time=_opt(e, "time", str, at), detail=_opt(e, "detail", str, at))
        )
    procs = d.get("processes")
    if procs is not None:
        if not isinstance(procs, list):
            raise TypeError(f"{where}.processes must be a list")
        kwargs["processes"] = []
        for i, p in enumerate(procs):
            at = f"{where}.processes[{i}]"
            if not isinstance(p, dict) or not isinstance(p.get("pid"), int) or isinstance(p.get("pid"), bool):
                raise TypeError(f"{at} needs an integer 'pid'")
            kwargs["processes"].append(_build(GpuProcess, p, at))
    return GpuState(**kwargs)


def _cuda_from(raw: Any) -> CudaProbe | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TypeError("cuda must be an object")
    return _build(CudaProbe, raw, "cuda")


def _build(cls: Any, raw: dict[str, Any], where: str) -> Any:
    """Build a small dataclass from a dict, checking each known field against its annotation."""
    kwargs = {}
    for name, f in cls.__dataclass_fields__.items():
        value = raw.get(name)
        if value is None:
            continue
        want = bool if str(f.type).startswith("bool") else str if str(f.type).startswith("str") else int
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise TypeError(f"{where}.{name} must be {want.__name__}, not {type(value).__name__}")
        kwargs[name] = value
    return cls(**kwargs)


def _opt(d: dict[str, Any], key: str, typ: Any, where: str) -> Any:
    value = d.get(key)
    if value is None:
        return None
    name = typ.__name__ if isinstance(typ, type) else "a number"
    if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
        raise TypeError(f"{where}.{key} must be {name}, not {type(value).__name__}")
    return value


def _prune(d: dict[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None or k in keep}
