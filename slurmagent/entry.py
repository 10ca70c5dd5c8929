"""Console-script entry. Slurm hooks take a fast path that skips click: the prolog runs
before every job, so its start-up cost is paid by every job on the cluster."""

from __future__ import annotations

import sys

HOOKS = ("prolog", "epilog")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 1 and args[0] in HOOKS:
        from .hookmain import hook_main  # no click on the hooks' path: start-up speed

        return hook_main(args[0])
    from .cli import main as cli_main  # click only for the other commands: start-up speed

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
