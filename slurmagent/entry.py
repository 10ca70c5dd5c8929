"""Console-script entry. Slurm hooks take a fast path that skips click: the prolog runs
before every job, so its start-up cost is paid by every job on the cluster."""

from __future__ import annotations

import sys

HOOKS = ("prolog", "epilog")


def hook_invocation(args: list[str]) -> tuple[str, str | None] | None:
    """(hook, --config FILE) when `args` is `[--config FILE | --config=FILE] prolog|epilog`, else None
    (click parses anything else, the hooks included, and passes `--config` on just the same)."""
    config_path = None
    rest = list(args)
    while len(rest) > 1:
        if rest[0] == "--config" and len(rest) > 2:
            config_path, rest = rest[1], rest[2:]
        elif rest[0].startswith("--config="):
            config_path, rest = rest[0].partition("=")[2], rest[1:]
        else:
            return None
    if rest and rest[0] in HOOKS and config_path != "":
        return rest[0], config_path
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    hook = hook_invocation(args)
    if hook is not None:
        import gc

        gc.disable()  # a hook lives a tenth of a second: collecting its import garbage costs more than it frees
        from .hookmain import hook_main  # no click on the hooks' path: start-up speed

        code = hook_main(*hook)
        if argv is None:  # this process is the hook: skip the interpreter's teardown too (files are closed)
            _exit_now(code)
        return code
    from .cli import main as cli_main  # click only for the other commands: start-up speed

    return cli_main(args)


def _exit_now(code: int) -> None:
    """Exit with `code` after flushing stdout/stderr, without the interpreter's teardown."""
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
