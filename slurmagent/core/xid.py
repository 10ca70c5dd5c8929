"""The XID catalog: what each NVIDIA XID means and whether it drains the node.

The table follows NVIDIA's XID catalog for Ampere and newer GPUs
(docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html), column
"Resolution Bucket (Immediate Action)". That column is the automatable recovery step,
so it is what decides a drain here; the "investigatory" column is left to humans.

Bucket -> action:

* ``RESET_GPU``, ``WORKFLOW_XID_48``, ``WORKFLOW_NVLINK_ERR``, ``WORKFLOW_NVLINK5_ERR``
  -> ``RESET_GPU`` (drain)
* ``RESTART_BM`` (bare metal) and ``RESTART_VM`` (the VM is the node here) -> ``REBOOT_NODE``
  (drain)
* ``CONTACT_SUPPORT``, ``CHECK_MECHANICALS`` -> ``HW_FAULT`` (drain). ``CONTACT_SUPPORT``
  is the bucket of codes marked "Unused" on current GPUs: seeing one on a data-centre GPU
  is itself reason to take the node out of service.
* ``RESTART_APP`` -> ``RESTART_APP`` (warning only)
* ``IGNORE``, ``WORKFLOW_XID_45`` (cleanup after another XID: follow that one) -> ``IGNORE``

Two families depend on the message text, not the code alone; :func:`classify` reads it:
XID 144-150 (NVLink5) say ``Fatal`` or ``Nonfatal``, and XID 154 names the recovery action
the driver now requires. :func:`lookup` gives the conservative code-only answer that the
NVML event path (which has no text) uses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class XidAction(str, Enum):
    """What the node needs after an XID; the first three take it out of service."""

    RESET_GPU = "reset_gpu"
    REBOOT_NODE = "reboot_node"
    HW_FAULT = "hw_fault"
    RESTART_APP = "restart_app"
    IGNORE = "ignore"
    UNKNOWN = "unknown"


DRAIN_ACTIONS = frozenset({XidAction.RESET_GPU, XidAction.REBOOT_NODE, XidAction.HW_FAULT})


@dataclass(frozen=True)
class XidInfo:
    """One catalog row. ``meaning`` is short enough for a Slurm drain reason."""

    code: int
    meaning: str
    action: XidAction
    drains: bool
    bucket: str = ""  # NVIDIA's immediate-action bucket, for the policy table and logs


def _row(code: int, meaning: str, action: XidAction, bucket: str) -> XidInfo:
    return XidInfo(code, meaning, action, action in DRAIN_ACTIONS, bucket)


_R, _B, _H = XidAction.RESET_GPU, XidAction.REBOOT_NODE, XidAction.HW_FAULT
_A, _I = XidAction.RESTART_APP, XidAction.IGNORE

_ROWS: tuple[tuple[int, str, XidAction, str], ...] = (
    (8, "gpu stopped processing (idle timeout)", _A, "RESTART_APP"),
    (11, "invalid push buffer stream", _A, "RESTART_APP"),
    (13, "graphics engine exception", _A, "RESTART_APP"),
    (14, "injected test error", _I, "IGNORE"),
    (25, "illegal push buffer stream", _A, "RESTART_APP"),
    (31, "gpu memory page fault", _A, "RESTART_APP"),
    (32, "corrupted push buffer stream", _A, "RESTART_APP"),
    (37, "driver firmware error", _I, "IGNORE"),
    (38, "driver firmware watchdog timeout", _I, "IGNORE"),
    (39, "copy engine exception", _A, "RESTART_APP"),
    (40, "copy engine exception", _A, "RESTART_APP"),
    (41, "copy engine exception", _A, "RESTART_APP"),
    (43, "channel stopped after app fault", _I, "IGNORE"),
    (44, "graphics fault during context switch", _I, "IGNORE"),
    (45, "preemptive cleanup after earlier error", _I, "WORKFLOW_XID_45"),
    (46, "gpu stopped processing (timeout)", _R, "RESET_GPU"),
    (48, "double bit ecc error", _R, "WORKFLOW_XID_48"),
    (54, "auxiliary power not connected", _H, "CHECK_MECHANICALS"),
    (56, "display engine error", _H, "CONTACT_SUPPORT"),
    (57, "video memory interface programming error", _H, "CONTACT_SUPPORT"),
    (58, "unstable video memory interface", _H, "CONTACT_SUPPORT"),
    (60, "video processor exception", _A, "RESTART_APP"),
    (61, "micro-controller breakpoint", _H, "CONTACT_SUPPORT"),
    (62, "micro-controller halt", _R, "RESET_GPU"),
    (63, "memory row remap/page retirement recorded", _I, "IGNORE"),
    (64, "memory row remap/page retirement failed", _R, "RESET_GPU"),
    (66, "illegal register access by driver", _I, "IGNORE"),
    (67, "illegal access by driver", _I, "IGNORE"),
    (68, "video decoder exception", _A, "RESTART_APP"),
    (69, "graphics engine class error", _A, "RESTART_APP"),
    (70, "copy engine error", _A, "RESTART_APP"),
    (71, "copy engine error", _A, "RESTART_APP"),
    (72, "copy engine error", _A, "RESTART_APP"),
    (74, "nvlink error", _R, "WORKFLOW_NVLINK_ERR"),
    (75, "copy engine error", _A, "RESTART_APP"),
    (76, "copy engine error", _A, "RESTART_APP"),
    (77, "copy engine error", _A, "RESTART_APP"),
    (79, "fallen off the bus", _B, "RESTART_BM"),
    (80, "corrupted data sent to gpu", _A, "RESTART_APP"),
    (82, "jpeg engine error", _A, "RESTART_APP"),
    (83, "video decoder error", _A, "RESTART_APP"),
    (84, "video decoder error", _A, "RESTART_APP"),
    (85, "copy engine error", _A, "RESTART_APP"),
    (86, "optical flow engine error", _A, "RESTART_APP"),
    (88, "video decoder error", _A, "RESTART_APP"),
    (89, "video decoder error", _A, "RESTART_APP"),
    (92, "high single-bit ecc error rate", _I, "IGNORE"),
    (93, "inforom wear limit exceeded", _I, "IGNORE"),
    (94, "contained memory error", _A, "RESTART_APP"),
    (95, "uncontained memory error", _R, "RESET_GPU"),
    *((c, "video decoder error", _A, "RESTART_APP") for c in (96, 97, 98)),
    *((c, "jpeg engine error", _A, "RESTART_APP") for c in range(99, 106)),
    (106, "smbpbi test message", _I, "IGNORE"),
    (107, "smbpbi test message", _I, "IGNORE"),
    (108, "nvlink remote translation error", _I, "IGNORE"),
    (109, "context switch timeout", _R, "RESET_GPU"),
    (110, "security fault", _R, "RESET_GPU"),
    (119, "gsp rpc timeout", _R, "RESET_GPU"),
    (120, "gsp error", _R, "RESET_GPU"),
    (121, "corrected c2c link errors", _I, "IGNORE"),
    (122, "spi pmu rpc read failure", _H, "CONTACT_SUPPORT"),
    (123, "spi pmu rpc write failure", _H, "CONTACT_SUPPORT"),
    (124, "spi pmu rpc erase failure", _H, "CONTACT_SUPPORT"),
    *((c, "copy engine error", _A, "RESTART_APP") for c in range(126, 136)),
    (136, "nvlink training failed", _R, "RESET_GPU"),
    (137, "nvlink privilege error", _I, "IGNORE"),
    (139, "optical flow engine error", _A, "RESTART_APP"),
    (140, "unrecovered ecc error", _R, "RESET_GPU"),
    (141, "cuda fast path error", _I, "IGNORE"),
    (143, "gpu initialization error", _R, "RESET_GPU"),
    (144, "nvlink saw error", _R, "WORKFLOW_NVLINK5_ERR"),
    (145, "nvlink rlw error", _R, "WORKFLOW_NVLINK5_ERR"),
    (146, "nvlink tlw error", _R, "WORKFLOW_NVLINK5_ERR"),
    (147, "nvlink trex error", _R, "WORKFLOW_NVLINK5_ERR"),
    (148, "nvlink nvlpw_ctrl error", _R, "WORKFLOW_NVLINK5_ERR"),
    (149, "nvlink netir error", _R, "WORKFLOW_NVLINK5_ERR"),
    (150, "nvlink mse error", _R, "WORKFLOW_NVLINK5_ERR"),
    (151, "key rotation error", _B, "RESTART_VM"),
    (154, "gpu recovery action changed", _R, "XID_154"),
    (155, "nvlink link down (software)", _R, "RESET_GPU"),
    (156, "resource retirement event", _R, "RESET_GPU"),
    (157, "resource retirement failure", _I, "IGNORE"),
    (158, "gpu fatal timeout", _R, "RESET_GPU"),
    # CHECK_UVM: "RESET_GPU if UVM is in use" - every CUDA process uses nvidia-uvm.
    (159, "chi non-data error", _R, "CHECK_UVM"),
    (160, "channel retirement event", _I, "IGNORE"),
    (161, "channel retirement failure", _I, "IGNORE"),
)

CATALOG: dict[int, XidInfo] = {code: _row(code, m, a, b) for code, m, a, b in _ROWS}

NVLINK5_XIDS = frozenset(range(144, 151))
RECOVERY_ACTION_XID = 154


def lookup(code: int) -> XidInfo:
    """The catalog row for ``code``; unknown codes never drain (they are reported as such)."""
    info = CATALOG.get(code)
    if info is None:
        return XidInfo(code, "unknown xid", XidAction.UNKNOWN, drains=False)
    return info


# XID 154 text: "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)".
# The numbers are NVML's nvmlDeviceGpuRecoveryAction_t; the names vary between drivers.
_XID154_TO = re.compile(r"\bto\s+(0x[0-9a-fA-F]+|\d+)(?:\s*\(([^)]*)\))?")
_RECOVERY: dict[int, tuple[XidAction, str]] = {
    0: (XidAction.IGNORE, "recovery action cleared"),
    1: (XidAction.RESET_GPU, "gpu reset required"),
    2: (XidAction.REBOOT_NODE, "node reboot required"),
    3: (XidAction.RESET_GPU, "drain p2p required"),
    4: (XidAction.RESET_GPU, "drain and reset required"),
}
_NONFATAL = re.compile(r"\bnon-?fatal\b", re.IGNORECASE)
_FATAL = re.compile(r"\bfatal\b", re.IGNORECASE)


def classify(code: int, detail: str = "") -> XidInfo:
    """Like :func:`lookup`, refined by the message text where the catalog says to decode it.

    XID 154 carries the recovery action the driver requires (0 none .. 4 drain and reset);
    XID 144-150 say whether the NVLink5 error was ``Fatal`` (GPU reset) or ``Nonfatal``.
    Without recognisable text the code-only answer stands.
    """
    base = lookup(code)
    if code == RECOVERY_ACTION_XID:
        m = _XID154_TO.search(detail)
        if m:
            try:
                value = int(m.group(1), 0)
            except ValueError:
                return base
            if value in _RECOVERY:
                action, meaning = _RECOVERY[value]
                return _row(code, meaning, action, base.bucket)
        return base
    if code in NVLINK5_XIDS:
        # Fatal wins when both words appear: the text may carry a process name (`name=x, Nonfatal`)
        # that a job chose, and it must not talk a fatal error down.
        if _FATAL.search(_NONFATAL.sub(" ", detail)):
            return _row(code, base.meaning + " (fatal)", XidAction.RESET_GPU, base.bucket)
        if _NONFATAL.search(detail):
            return _row(code, base.meaning + " (nonfatal)", XidAction.IGNORE, base.bucket)
    return base


def drains(code: int, detail: str = "") -> bool:
    """True when this XID takes the node out of service."""
    return classify(code, detail).drains


def table_markdown() -> str:
    """The policy table of docs/admin/health.md: one row per catalogued code, in code order."""
    lines = [
        "| xid | meaning | action | drains | NVIDIA immediate action |",
        "|---:|---|---|---|---|",
    ]
    for code in sorted(CATALOG):
        info = CATALOG[code]
        lines.append(
            f"| {code} | {info.meaning} | {info.action.value} | "
            f"{'yes' if info.drains else 'no'} | `{info.bucket}` |"
        )
    return "\n".join(lines) + "\n"
