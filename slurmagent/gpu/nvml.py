"""Read this node's GPU state through NVML into a :class:`NodeSnapshot`.

This is the only module that touches ``pynvml``, and it imports it lazily so that paths
which never read NVML (replayed snapshots, the CLI's help) pay nothing for it.

Error mapping (why: a health check must tell "not measured" from "broken"):

- ``NVML_ERROR_NOT_SUPPORTED`` / ``NO_PERMISSION`` / ``FUNCTION_NOT_FOUND`` on a query, or a
  binding too old to have the function: the field stays ``None`` ("not measured").
- ``NVML_ERROR_GPU_IS_LOST`` on any per-GPU call: ``lost=True`` and that GPU is not read further.
- Any other NVML error on a per-GPU query: the field stays ``None`` and a warning is logged.
- ``nvmlInit`` / ``nvmlDeviceGetCount`` failing: ``nvml_error`` holds the ``NVML_ERROR_*`` name.

XID events: :class:`NvmlXidEvents` subscribes to XID critical errors (``nvmlEventSetCreate``,
``nvmlDeviceRegisterEvents``, bounded ``nvmlEventSetWait_v2``) for the watch daemon.

A read with a hard deadline (a child process that is abandoned when the driver hangs) is
:mod:`slurmagent.gpu.nvml_deadline`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pwd
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..errors import SlurmagentError
from ..core.kernel_xid import normalize_pci
from ..core.snapshot import (Ecc, Fabric, GpuProcess, GpuState, Memory, NodeSnapshot, NvLink, Pcie, RemappedRows,
                             RetiredPages)

log = logging.getLogger(__name__)

# Documented NVML return codes, used when a (fake or old) binding lacks the constant.
_DOCUMENTED_CODES = {
    "NVML_SUCCESS": 0,
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_RESET_REQUIRED": 16,
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": 18,
    "NVML_ERROR_UNKNOWN": 999,
}
_UNMEASURED = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND")
# A link index past the part's last link answers one of these (varies by driver).
_NO_SUCH_LINK = (*_UNMEASURED, "NVML_ERROR_INVALID_ARGUMENT")

# (snapshot name, suffix of nvmlClocksEventReason*/nvmlClocksThrottleReason*, documented bit)
CLOCK_REASONS = (
    ("gpu_idle", "GpuIdle", 0x1),
    ("applications_clocks_setting", "ApplicationsClocksSetting", 0x2),
    ("sw_power_cap", "SwPowerCap", 0x4),
    ("hw_slowdown", "HwSlowdown", 0x8),
    ("sync_boost", "SyncBoost", 0x10),
    ("sw_thermal_slowdown", "SwThermalSlowdown", 0x20),
    ("hw_thermal_slowdown", "HwThermalSlowdown", 0x40),
    ("hw_power_brake_slowdown", "HwPowerBrakeSlowdown", 0x80),
    ("display_clock_setting", "DisplayClockSetting", 0x100),
)

# nvmlValueType_t -> member of the c_nvmlValue_t union.
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

NVML_WAIT_MS = 500  # one nvmlEventSetWait_v2: bounds how long a stop waits on the event thread
_XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError


# --- in-process read ------------------------------------------------------------------------


def read_snapshot(nvml: Any = None, hostname: str | None = None) -> NodeSnapshot:
    """Read every GPU of this node; NVML failing to start is data (``nvml_error``), not an exception."""
    nv = load(nvml)
    snap = NodeSnapshot(hostname=hostname or socket.gethostname())
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        snap.nvml_error = error_name(exc, nv)
        return snap
    try:
        snap.driver_version = text(_query(nv, "nvmlSystemGetDriverVersion"))
        try:
            count = int(nv.nvmlDeviceGetCount())
        except nv.NVMLError as exc:
            snap.nvml_error = error_name(exc, nv)
            return snap
        snap.gpus = [_read_gpu(nv, index) for index in range(count)]
        return snap
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)


def error_name(exc: BaseException, nvml: Any = None) -> str:
    """The ``NVML_ERROR_*`` constant name for an NVMLError, looked up in the binding itself."""
    value = getattr(exc, "value", None)
    for name in dir(nvml) if nvml is not None else ():
        if name.startswith("NVML_ERROR_") and getattr(nvml, name) == value:
            return name
    for name, code in _DOCUMENTED_CODES.items():
        if name.startswith("NVML_ERROR_") and code == value:
            return name
    return f"NVML_ERROR_{value}"


def decode_clocks_event_reasons(mask: int, nvml: Any = None) -> list[str]:
    """Bitmask -> lower-case reason names; unknown bits appear as ``unknown_0x...`` so none is lost."""
    names: list[str] = []
    known = 0
    for name, suffix, documented in CLOCK_REASONS:
        older = getattr(nvml, "nvmlClocksThrottleReason" + suffix, documented)
        bit = int(getattr(nvml, "nvmlClocksEventReason" + suffix, older))
        known |= bit
        if mask & bit:
            names.append(name)
    rest = mask & ~known
    while rest:
        lowest = rest & -rest
        names.append(f"unknown_{lowest:#x}")
        rest ^= lowest
    return names


def load(nvml: Any = None) -> Any:
    """The pynvml module (imported here only), or the injected stand-in."""
    if nvml is not None:
        return nvml
    try:
        import pynvml  # the only import of pynvml in slurmagent
    except ImportError as exc:
        raise SlurmagentError(f"cannot import pynvml ({exc}); install the nvidia-ml-py package") from None
    return pynvml


def _const(nv: Any, name: str) -> int:
    return int(getattr(nv, name, _DOCUMENTED_CODES[name]))


def _query(nv: Any, func: str, *args: Any, unmeasured: tuple[str, ...] = _UNMEASURED) -> Any:
    """Call ``nv.<func>(*args)``; None when not measurable. Only GPU_IS_LOST propagates."""
    fn = getattr(nv, func, None)
    if fn is None:  # binding older than the query
        return None
    try:
        return fn(*args)
    except nv.NVMLError as exc:
        value = getattr(exc, "value", None)
        if value == _const(nv, "NVML_ERROR_GPU_IS_LOST"):
            raise
        if value not in {_const(nv, name) for name in unmeasured}:
            log.warning("NVML %s failed: %s (%s); field left unmeasured", func, error_name(exc, nv), exc)
        return None


def _read_gpu(nv: Any, index: int) -> GpuState:
    gpu = GpuState(index=index)
    try:
        handle = _query(nv, "nvmlDeviceGetHandleByIndex", index)
        if handle is not None:
            _fill_gpu(nv, handle, gpu)
    except nv.NVMLError:  # _query lets only GPU_IS_LOST through
        gpu.lost = True
    return gpu


def _fill_gpu(nv: Any, h: Any, gpu: GpuState) -> None:
    """Fill ``gpu`` field by field, so a GPU lost half-way keeps what was read before."""
    gpu.uuid = text(_query(nv, "nvmlDeviceGetUUID", h))
    gpu.name = text(_query(nv, "nvmlDeviceGetName", h))
    pci = _query(nv, "nvmlDeviceGetPciInfo", h)
    gpu.pci_bus_id = text(getattr(pci, "busId", None)) or None
    gpu.temperature_c = _query(nv, "nvmlDeviceGetTemperature", h, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
    power_mw = _query(nv, "nvmlDeviceGetPowerUsage", h)
    gpu.power_w = None if power_mw is None else power_mw / 1000.0
    mode = _query(nv, "nvmlDeviceGetPersistenceMode", h)
    gpu.persistence_mode = None if mode is None else mode == getattr(nv, "NVML_FEATURE_ENABLED", 1)
    gpu.ecc = _read_ecc(nv, h)
    gpu.remapped_rows = _read_remapped_rows(nv, h)
    gpu.retired_pages = _read_retired_pages(nv, h)
    gpu.pcie = Pcie(
        gen=_query(nv, "nvmlDeviceGetCurrPcieLinkGeneration", h),
        max_gen=_query(nv, "nvmlDeviceGetMaxPcieLinkGeneration", h),
        width=_query(nv, "nvmlDeviceGetCurrPcieLinkWidth", h),
        max_width=_query(nv, "nvmlDeviceGetMaxPcieLinkWidth", h),
    )
    gpu.nvlink = _read_nvlinks(nv, h)
    mask = _query(nv, "nvmlDeviceGetCurrentClocksEventReasons", h)
    if mask is None:  # drivers/bindings before the "event" rename
        mask = _query(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", h)
    gpu.clocks_event_reasons = None if mask is None else decode_clocks_event_reasons(int(mask), nv)
    gpu.recovery_action = _read_recovery_action(nv, h)
    gpu.memory = _read_memory(nv, h)
    gpu.processes = _read_processes(nv, h)
    gpu.fabric = _read_fabric(nv, h)


_MIB = 1 << 20
_FABRIC_STATES = {1: "not_started", 2: "in_progress", 3: "completed"}  # 0: not supported (no fabric)


def _read_memory(nv: Any, h: Any) -> Memory:
    """v2 memory info (used leaves reserved out); a binding or driver without it: v1, no reserved."""
    version = getattr(nv, "nvmlMemory_v2", None)
    info = _query(nv, "nvmlDeviceGetMemoryInfo", h, version) if version is not None else None
    reserved = None if info is None else getattr(info, "reserved", None)
    if info is None:
        info = _query(nv, "nvmlDeviceGetMemoryInfo", h)
    if info is None:
        return Memory()
    return Memory(total_mib=int(info.total) // _MIB, used_mib=int(info.used) // _MIB,
                  reserved_mib=None if reserved is None else int(reserved) // _MIB)


def _read_processes(nv: Any, h: Any, proc: str = "/proc") -> list[GpuProcess] | None:
    """The GPU's compute processes with their memory, name and user (from /proc, when readable)."""
    found = _query(nv, "nvmlDeviceGetComputeRunningProcesses", h)
    if found is None:
        return None
    out = []
    for p in found:
        used = getattr(p, "usedGpuMemory", None)
        name, user = process_identity(int(p.pid), proc)
        out.append(GpuProcess(int(p.pid), None if used is None else int(used) // _MIB, name, user))
    return sorted(out, key=lambda p: p.pid)


def process_identity(pid: int, proc: str = "/proc") -> tuple[str | None, str | None]:
    """(command name, user name) of a pid; None for what cannot be read (gone, another namespace)."""
    try:
        name = Path(proc, str(pid), "comm").read_text().strip() or None
        uid = os.stat(Path(proc, str(pid))).st_uid
    except (OSError, ValueError):
        return None, None
    try:
        return name, pwd.getpwuid(uid).pw_name
    except KeyError:
        return name, str(uid)


def _read_fabric(nv: Any, h: Any) -> Fabric | None:
    """nvmlDeviceGetGpuFabricInfoV (or the older nvmlDeviceGetGpuFabricInfo); None without a fabric."""
    for func, struct in (("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfoV_t"),
                         ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t")):
        cls = getattr(nv, struct, None)
        if cls is None or getattr(nv, func, None) is None:
            continue
        info = cls()
        if _query(nv, func, h, ctypes.byref(info)) is None:
            return None
        state = _FABRIC_STATES.get(int(info.state))
        if state is None:
            return None
        return Fabric(state=state, status=error_name(SimpleNamespace(value=int(info.status)), nv)
                      if int(info.status) else "NVML_SUCCESS")
    return None


def _read_ecc(nv: Any, h: Any) -> Ecc:
    unc = getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    cor = getattr(nv, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
    vol = getattr(nv, "NVML_VOLATILE_ECC", 0)
    agg = getattr(nv, "NVML_AGGREGATE_ECC", 1)
    return Ecc(
        volatile_uncorrected=_query(nv, "nvmlDeviceGetTotalEccErrors", h, unc, vol),
        aggregate_uncorrected=_query(nv, "nvmlDeviceGetTotalEccErrors", h, unc, agg),
        volatile_corrected=_query(nv, "nvmlDeviceGetTotalEccErrors", h, cor, vol),
    )


def _read_remapped_rows(nv: Any, h: Any) -> RemappedRows:
    rows = _query(nv, "nvmlDeviceGetRemappedRows", h)
    if rows is None:  # pre-Ampere parts retire pages instead
        return RemappedRows()
    correctable, uncorrectable, pending, failure = rows
    return RemappedRows(int(correctable), int(uncorrectable), bool(pending), bool(failure))


def _read_retired_pages(nv: Any, h: Any) -> RetiredPages:
    sbe_cause = getattr(nv, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0)
    dbe_cause = getattr(nv, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1)
    sbe = _query(nv, "nvmlDeviceGetRetiredPages", h, sbe_cause)
    dbe = _query(nv, "nvmlDeviceGetRetiredPages", h, dbe_cause)
    pending = _query(nv, "nvmlDeviceGetRetiredPagesPendingStatus", h)
    return RetiredPages(
        sbe=None if sbe is None else len(sbe),
        dbe=None if dbe is None else len(dbe),
        pending=None if pending is None else bool(pending),
    )


def _read_nvlinks(nv: Any, h: Any) -> list[NvLink]:
    """Every link the part has; indices past its last link (or without NVLink) are skipped."""
    counters = (
        ("replay_errors", getattr(nv, "NVML_NVLINK_ERROR_DL_REPLAY", 0)),
        ("recovery_errors", getattr(nv, "NVML_NVLINK_ERROR_DL_RECOVERY", 1)),
        ("crc_errors", getattr(nv, "NVML_NVLINK_ERROR_DL_CRC_FLIT", 2)),
    )
    links: list[NvLink] = []
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        state = _query(nv, "nvmlDeviceGetNvLinkState", h, link, unmeasured=_NO_SUCH_LINK)
        if state is None:
            continue
        entry = NvLink(link=link, active=state == getattr(nv, "NVML_FEATURE_ENABLED", 1))
        for attr, counter in counters:
            value = _query(nv, "nvmlDeviceGetNvLinkErrorCounter", h, link, counter, unmeasured=_NO_SUCH_LINK)
            setattr(entry, attr, None if value is None else int(value))
        links.append(entry)
    return links


def _read_recovery_action(nv: Any, h: Any) -> int | None:
    """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (drivers 565+); None where the binding or GPU lacks it."""
    field_id = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if field_id is None:
        return None
    values = _query(nv, "nvmlDeviceGetFieldValues", h, [field_id])
    if not values:
        return None
    fv = values[0]
    ret = int(getattr(fv, "nvmlReturn", 0))
    if ret == _const(nv, "NVML_ERROR_GPU_IS_LOST"):
        raise nv.NVMLError(ret)
    if ret != _const(nv, "NVML_SUCCESS"):
        return None
    member = _VALUE_MEMBER.get(int(getattr(fv, "valueType", 1)), "uiVal")
    return int(getattr(fv.value, member))


def text(value: Any) -> str | None:
    """Older bindings return bytes for strings; the snapshot wants str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return None if value is None else str(value)


# --- XID event subscription ----------------------------------------------------------------


@dataclass(frozen=True)
class GpuRef:
    """What the XID judge needs to know of a GPU: its index and PCI address."""

    index: int
    pci_bus_id: str | None = None


@dataclass
class XidEvent:
    xid: int
    gpu: int | None
    source: str  # "nvml" | "kernel_log"
    detail: str = ""
    raw: str | None = None
    pci: str | None = None
    seen: float = field(default_factory=time.monotonic)  # when the watcher saw it


class NvmlUnavailable(SlurmagentError):
    """NVML XID events cannot be followed here (no driver, no library, no supported GPU)."""


class NvmlXidEvents:
    """The pynvml event calls for XID critical errors, with an injectable ``nvml`` module."""

    def __init__(self, nvml: Any = None, wait_ms: int = NVML_WAIT_MS):
        self._nvml = nvml
        self.wait_ms = wait_ms
        self.nv: Any = None
        self.event_set: Any = None
        self.gpus: list[GpuRef] = []
        self.unsupported: list[int] = []  # GPU indices that cannot deliver XID events
        self._initialized = False

    def error(self, exc: BaseException) -> str:
        """The NVML_ERROR_* name of an error raised by this binding."""
        return error_name(exc, self.nv)

    def open(self) -> list[GpuRef]:
        """nvmlInit, one event set, every GPU registered for XID critical errors."""
        try:
            self.nv = load(self._nvml)
        except SlurmagentError as exc:
            raise NvmlUnavailable(str(exc)) from None
        nv = self.nv
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            raise NvmlUnavailable(f"nvmlInit failed ({self.error(exc)})") from None
        self._initialized = True
        try:
            kind = int(getattr(nv, "nvmlEventTypeXidCriticalError", _XID_CRITICAL))
            count = int(nv.nvmlDeviceGetCount())
            self.event_set = nv.nvmlEventSetCreate()
            self.gpus, self.unsupported = [], []
            for index in range(count):
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                pci = None
                with contextlib.suppress(nv.NVMLError, AttributeError):
                    pci = text(getattr(nv.nvmlDeviceGetPciInfo(handle), "busId", None))
                try:
                    nv.nvmlDeviceRegisterEvents(handle, kind, self.event_set)
                except nv.NVMLError as exc:
                    if getattr(exc, "value", None) != _const(nv, "NVML_ERROR_NOT_SUPPORTED"):
                        raise
                    self.unsupported.append(index)
                self.gpus.append(GpuRef(index, pci))
        except nv.NVMLError as exc:
            self.close()
            raise NvmlUnavailable(f"cannot register for XID events ({self.error(exc)})") from None
        except BaseException:
            self.close()
            raise
        if count == 0:
            self.close()
            raise NvmlUnavailable("NVML sees no GPU")
        if len(self.unsupported) == count:
            self.close()
            raise NvmlUnavailable("XID events are not supported on these GPUs (NVML_ERROR_NOT_SUPPORTED)")
        return self.gpus

    def wait(self) -> XidEvent | None:
        """One bounded wait; the XID event, or None on timeout or another event type.

        Raises the NVMLError of a failed wait (GPU_IS_LOST included) to the caller."""
        nv = self.nv
        waiter = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        try:
            data = waiter(self.event_set, self.wait_ms)
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) == _const(nv, "NVML_ERROR_TIMEOUT"):
                return None
            raise
        kind = int(getattr(nv, "nvmlEventTypeXidCriticalError", _XID_CRITICAL))
        if not int(getattr(data, "eventType", 0)) & kind:
            return None
        return XidEvent(xid=int(data.eventData), gpu=self._index_of(data.device), source="nvml")

    def gpu_lost(self, exc: BaseException) -> bool:
        return getattr(exc, "value", None) == _const(self.nv, "NVML_ERROR_GPU_IS_LOST")

    def _index_of(self, handle: Any) -> int | None:
        nv = self.nv
        with contextlib.suppress(Exception):
            return int(nv.nvmlDeviceGetIndex(handle))
        with contextlib.suppress(Exception):
            pci = normalize_pci(text(nv.nvmlDeviceGetPciInfo(handle).busId) or "")
            for g in self.gpus:
                if g.pci_bus_id and normalize_pci(g.pci_bus_id) == pci:
                    return g.index
        return None

    def close(self) -> None:
        nv = self.nv
        if nv is None:
            return
        if self.event_set is not None:
            with contextlib.suppress(Exception):
                nv.nvmlEventSetFree(self.event_set)
            self.event_set = None
        if self._initialized:
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()
            self._initialized = False
