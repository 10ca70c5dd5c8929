"""Test-only: one node agent that hangs in one sync round (issue 21 item 10's cluster test).

Put this folder on a job's PYTHONPATH and Python imports this file at every start-up. It acts
only in `node-agent sync` on node index SLURMAGENT_TEST_HANG_INDEX, once: the first such agent
to create the file SLURMAGENT_TEST_HANG_ONCE ignores SIGTERM and sleeps, like an agent stuck
on a dead disk. Every other process (the wrapper, the trainer, later agents) is left alone.
"""

import os
import signal
import sys
import time

if sys.argv[1:3] == ["node-agent", "sync"] and os.environ.get("SLURM_NODEID") == os.environ.get(
        "SLURMAGENT_TEST_HANG_INDEX"):
    try:
        fd = os.open(os.environ["SLURMAGENT_TEST_HANG_ONCE"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except (KeyError, OSError):
        pass
    else:
        os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(3600)
