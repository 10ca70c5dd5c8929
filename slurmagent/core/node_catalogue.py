"""The node's own checks beyond the GPUs (issue 39): GPU NICs, local mounts, full
filesystems, DCGM diagnostics; catalogue.CATALOGUE lists them after the GPU checks."""

from __future__ import annotations

from .check_spec import CheckSpec

GPU_NICS = "gpu-nics"
LOCAL_MOUNTS = "local-mounts"
FILESYSTEM_FULL = "filesystem-full"
DCGM_DIAG = "dcgm-diag"

NODE_CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec(GPU_NICS, ("epilog", "healthcheck", "resume"), "drain", True,
              "every NIC Google attached (metadata `network-interfaces`, by MAC) is in the guest and up "
              "(netdev operstate, RDMA port ACTIVE); one missing or down drains, named",
              ("GCM", "NHC")),
    CheckSpec(LOCAL_MOUNTS, ("prolog", "epilog", "healthcheck", "resume"), "drain", True,
              "each `[health] mounts` entry is a mount, not remounted read-only, and takes a probe file "
              "(create+fsync+unlink under a deadline); one that fails drains (hardware: repaired); a hung probe "
              "drains in resume only, else warns",
              ("GCM", "NHC")),
    CheckSpec(FILESYSTEM_FULL, ("prolog", "epilog", "healthcheck", "resume"), "warn", True,
              "the mounts and `[health] ckpt_filesystem` below `[health] full_warn_percent` used: "
              "a full disk is the user's, a warning only (never a drain, never a VM recreate)",
              ("GCM", "NHC")),
    CheckSpec(DCGM_DIAG, ("resume",), "drain", True,
              "`dcgmi diag -r N -j` where DCGM's host engine runs: a failing test drains, named; level "
              "`[health] dcgm_resume_level` in resume-if-healthy (node drained), `dcgm_healthcheck_level` "
              "(0: off, 1 at most) in healthcheck; absent DCGM or a timeout is a warning",
              ("CTK", "GCM", "CycleCloud")),
)

