"""The Kaggle session's platform, beside the stages: `env` (paths, mounts, TPU presence), `secrets`,
`credential` and `calls` (the session's own Kaggle API calls), `packages` (what an image lacks, installed pinned),
`facts` (what a session found and measured), `disk`, `bootstrap` (a built kernel's start), `checkpoint_files`,
`publish` and `proof` (the checkpoint dataset and its versions) and `models` (the eval's Kaggle Model upload). The
stages may use it; it uses only the common modules (shared/*.py)."""
