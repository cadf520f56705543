"""Real clusters on this one machine, for trying jobs before a real cluster (and for CI)."""
