"""Slurm: one node/job model, one table of SLURM_* variables, every scontrol/squeue/srun argv."""
