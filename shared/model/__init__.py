"""The model: GPT-2 and its parts. `model` (nanoGPT-style, padded vocabulary, checkpoint tensors), `attention`
(the one owner of attention: which kernels a session on a TPU generation tries, and the `AttentionChoice` the model
is built with), `splash` (jax's splash attention called from torch) and `loss_head` (the tied projection and
cross-entropy a chunk of positions at a time). It imports only the common modules (shared/*.py): what the model
is, not where it runs (shared/runtime/) or how it is trained (shared/train/)."""
