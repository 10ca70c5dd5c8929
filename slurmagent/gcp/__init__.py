"""Google Cloud outside the checkpoint store: the metadata server, its events, the Compute API."""
