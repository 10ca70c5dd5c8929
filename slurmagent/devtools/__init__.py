"""The dev harness: a local Slurm cluster, a Cloud Storage emulator and the demo scenario.

It stands outside the product's layers (it may import anything); the product imports it
only in the `demo` command.
"""
