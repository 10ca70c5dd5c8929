"""One runtime per command: health, hooks, healthcheck, watch, expiry, repair, status, journal, doctor, install."""
