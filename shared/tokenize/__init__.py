"""Stage 1, tokenize: a text stream (FineWeb-Edu, or local files) into GPT-2 token shards, one resumable part at a
time: `part` (settings and the run loop), `source` (the stream), `workers` (tokenizer processes), `manifest`
(shard bookkeeping across parts), `tokenizer` (GPT-2's BPE), `demo_corpus` (a small offline corpus)."""
