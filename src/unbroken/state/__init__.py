"""Training state: snapshots, digests, checkpoints."""
