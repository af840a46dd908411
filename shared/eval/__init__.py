"""Stage 3, eval: `evaluate` (the eval kernel's settings and run), `report` (report.md and plots), `hf` (🤗
transformers import and export). HellaSwag and sampling, which the trainer uses first, are the train stage's
(shared/train/hellaswag.py, shared/train/sampling.py)."""
