"""Inside a Kaggle session: `env` (paths, mounts, secrets, TPU presence) and `publish` (the checkpoint dataset)."""
