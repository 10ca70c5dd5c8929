"""`slurmagent prolog|epilog` without click: config, health, decision, exit code."""

from __future__ import annotations

import os
import sys

from .state import config as config_mod
from .commands.health import evaluator
from .commands.hooks import HookContext, run_hook


def hook_main(hook: str, config_path: str | None = None) -> int:
    """`config_path` is `--config FILE`; without it, $SLURMAGENT_CONFIG or the default file."""
    ctx = HookContext.from_env(hook, os.environ)
    return run_hook(ctx, lambda: config_mod.load(config_path, for_root_hook=os.geteuid() == 0),
                    evaluator(hook, job=ctx.job_id),
                    stderr=sys.stderr, verify_in_background=True)
