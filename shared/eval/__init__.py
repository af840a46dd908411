"""Stage 3, eval: `evaluate` (validation loss, the eval kernel's settings and run), `hellaswag`, `sampling` (KV
cache), `report` (report.md and plots), `hf` (🤗 transformers import and export)."""
