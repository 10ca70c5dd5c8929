"""The trainer helper: resumed() with or without a bucket, atomic_write under concurrent
writers, and ranks agreeing on a checkpoint request (torch.distributed, gloo).

The same subject without a cluster, emulator or fake server: tests/unit/test_wrapper_trainer.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from support import REPO, need_module
from slurmagent.devtools.localcluster import free_ports


RANK = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from slurmagent import trainer
    dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2)
    flag = sys.argv[1] == "1"  # only rank 1 got the signal
    print(trainer.any_rank(flag), trainer.any_rank(False))
    dist.destroy_process_group()
""")


def test_ranks_agree_when_only_one_got_the_signal(tmp_path):
    need_module("torch")
    env = dict(os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]))
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert [r[0].split() for r in results] == [["True", "False"], ["True", "False"]]
