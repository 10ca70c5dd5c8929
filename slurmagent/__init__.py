"""slurmagent: keep long GPU jobs alive on Slurm clusters of Google Cloud VMs."""


def __getattr__(name: str) -> str:
    """`slurmagent.__version__`, read from the installed metadata on first use (never at import)."""
    if name == "__version__":
        from .state.build import version  # start-up speed: only when asked

        return version()
    raise AttributeError(f"module 'slurmagent' has no attribute {name!r}")
