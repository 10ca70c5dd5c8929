"""Pure core: the snapshot format, health checks, the XID catalogue, drain reasons, hostlists, time."""
