"""The step loop, the elastic data plan and the sync phase."""
