"""GCE machine type -> the number of NVIDIA GPUs it comes with (pure: a table and a rule).

The expected GPU count when Slurm does not say it (`commands/health.expected`): the
accelerator-optimized series attach a fixed number of GPUs per machine type. A2/A3/A4/A4X
name it in the type (`a3-highgpu-8g`: 8, `a4x-highgpu-4g`: 4, `a2-megagpu-16g`: 16, a suffix
such as `-nolssd` after it changes nothing); G2 and G4 do not, so they are a table (Compute
Engine's GPU machine types page: g2-standard-4/8/12/16/32 one L4, -24 two, -48 four, -96
eight; g4-standard-48/96/192/384 one, two, four, eight RTX PRO 6000). N1 with attached GPUs,
custom and unknown types: None (the type does not say; the PCI bus still may).
"""

from __future__ import annotations

import re

G_SERIES = {
    "g2-standard-4": 1, "g2-standard-8": 1, "g2-standard-12": 1, "g2-standard-16": 1, "g2-standard-32": 1,
    "g2-standard-24": 2, "g2-standard-48": 4, "g2-standard-96": 8,
    "g4-standard-48": 1, "g4-standard-96": 2, "g4-standard-192": 4, "g4-standard-384": 8,
}
# a2-highgpu-1g, a2-megagpu-16g, a2-ultragpu-8g, a3-highgpu-8g, a3-megagpu-8g, a3-ultragpu-8g,
# a3-edgegpu-8g, a4-highgpu-8g, a4x-highgpu-4g(-nolssd), a4x-maxgpu-4g(-metal)
_A_SERIES = re.compile(r"a[2-9]x?-[a-z]+gpu-(?P<n>[0-9]{1,2})g(?:-[a-z0-9-]+)?")


def gpus_for_machine_type(machine_type: str) -> int | None:
    """`a3-highgpu-8g` -> 8; also the metadata server's `projects/N/machineTypes/a3-highgpu-8g`."""
    name = machine_type.strip().rsplit("/", 1)[-1].lower()
    if name in G_SERIES:
        return G_SERIES[name]
    m = _A_SERIES.fullmatch(name)
    if m and int(m["n"]) > 0:
        return int(m["n"])
    return None
