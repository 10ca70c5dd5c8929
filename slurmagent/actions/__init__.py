"""The only way slurmagent changes Slurm or Compute state: one API over one journaled executor."""
