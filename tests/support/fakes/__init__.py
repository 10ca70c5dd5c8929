"""Stand-ins for what the tests cannot run for real in a unit test (the real local Slurm
cluster is in slurmagent/devtools/localcluster.py)."""
