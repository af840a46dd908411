"""Stage 3, eval: `evaluate` (the eval kernel's settings and run), `report` (report.md and plots), `hf` (🤗
transformers import and export). HellaSwag and sampling, which the trainer uses too, are shared/hellaswag.py and
shared/sampling.py."""
