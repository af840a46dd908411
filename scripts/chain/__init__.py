"""Building the kernels and chaining Kaggle sessions through them; runs on the user's machine, never in a kernel.

From one config (`config`), `Chain` (`chain`) pushes the missing tokenize parts, then train sessions one after
another that resume from and publish to a checkpoint dataset, then the eval kernel (`tokenize_stage`,
`train_stage`, `eval_stage`). Every push is recorded in a JSON state file (`state`) before and after it happens,
with a push id written into the pushed code (`context`), so a chain killed at any point and started again
continues without pushing a session twice. Each kernel is built into one self-contained file (`build`); the
Kaggle API is reached through a small retrying client (`client`).

The modules stand in layers, each importing only those below it (tests/test_layout.py finds any import circle):
1. `limits`, `state`, `build`: Kaggle's limits, the state file, the kernel builder; `sections`: the config's
   train, tokenize and eval sections, typed; `checkpoint_room`: where a session's checkpoints live and what
   publishing them takes;
2. `config`: the chain's config and its checks;
3. `client`, `sizing`; then `context`, which the stages share;
4. the stages: `checkpoints`, `notebooks`, `hellaswag`, `tokenize_stage`, `train_stage`, `eval_stage`;
5. `chain`, which runs them; `plan` (`--plan`) and `smoke` (`--smoke`) on top.
This file imports none of them, so any one can be imported, read and tested alone.

Module-level imports are the standard library and `shared`'s light modules only (the chain never needs torch).
"""
