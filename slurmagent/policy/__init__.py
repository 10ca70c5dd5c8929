"""Pure decisions: the drain breaker, drain arbitration, eviction, expiry and repair."""
