"""`slurmagent run`: the job-step wrapper, single- and multi-node."""
