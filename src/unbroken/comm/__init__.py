"""Data plane: per-epoch gloo process groups, collectives with deadlines, state transfer."""
