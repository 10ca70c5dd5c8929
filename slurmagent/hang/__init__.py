"""A wrapped job's hang watch: its progress signals on this node, and the evidence of a hang (/proc, py-spy, GPU state)."""
