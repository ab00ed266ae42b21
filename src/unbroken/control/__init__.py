"""Control plane: the coordinator, node sessions, membership, epochs and plans."""
