"""The checkpoint store's local side: names, hashes, the hash cache, the manifest format."""
