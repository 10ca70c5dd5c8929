"""A node's VM as `repair` knows it: the facts `gcp/compute` reads and `policy/repair` decides by.

A pure-core type, so that the adapter and the decision both import it from below."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GPU_MACHINE_FAMILIES = ("a2-", "a3-", "a4-", "a4x-", "g2-", "g4-")


@dataclass(frozen=True)
class VmFacts:
    """What `repair` needs to know about a node's VM (one instances.get, or a list entry)."""

    zone: str
    status: str = ""  # RUNNING, TERMINATED, ...
    machine_type: str = ""  # the last segment: a3-ultragpu-8g
    provisioning_model: str = ""  # STANDARD | SPOT | FLEX_START | RESERVATION_BOUND | "" (STANDARD)
    reservation: str = ""  # reservationAffinity.consumeReservationType
    mig: dict[str, str] | None = None  # the MIG of `created-by` (MigRef.to_dict), None: in no MIG
    gpus: int = 0  # guestAccelerators, summed

    def to_dict(self) -> dict[str, Any]:
        return {"zone": self.zone, "status": self.status, "machine_type": self.machine_type,
                "provisioning_model": self.provisioning_model, "reservation": self.reservation, "mig": self.mig,
                "gpus": self.gpus}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VmFacts:
        return cls(str(d.get("zone", "")), str(d.get("status", "")), str(d.get("machine_type", "")),
                   str(d.get("provisioning_model", "")), str(d.get("reservation", "")), d.get("mig"),
                   int(d.get("gpus", 0) or 0))

    @property
    def reservation_bound(self) -> bool:
        """Created through a reservation: the reservation-bound model (or a standard VM that
        consumes a specific reservation)."""
        return self.provisioning_model == "RESERVATION_BOUND" or (
            self.provisioning_model in ("", "STANDARD") and self.reservation == "SPECIFIC_RESERVATION")

    @property
    def gpu_vm(self) -> bool:
        return self.gpus > 0 or self.machine_type.startswith(GPU_MACHINE_FAMILIES)
