"""The running half of the benchmark: the servers, the clients that drive them, the raw engine."""
