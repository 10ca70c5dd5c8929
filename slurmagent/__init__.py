"""slurmagent: keep long GPU jobs alive on Slurm clusters of Google Cloud VMs."""

__version__ = "0.1.0"
