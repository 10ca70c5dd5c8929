"""The GPUs of this node: NVML under a deadline and the kernel log's XIDs."""
