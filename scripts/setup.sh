#!/usr/bin/env bash
# Set up everything on a fresh machine: a virtualenv in .venv with the project, its TPU stack (torch 2.9.0 +
# torch_xla 2.9.0) and test tools, plus GPT-2's BPE ranks taken from the package index (no other network).
#
#   bash scripts/setup.sh                 # .venv
#   bash scripts/setup.sh --kaggle-image  # also .venv-kaggle-tpu: the torch/torch_xla of Kaggle's TPU image
#                                         # (2.8.0, docs/kaggle-tpu.md), for the test that trains on them
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PIP_FLAGS=(--quiet --disable-pip-version-check)
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install "${PIP_FLAGS[@]}" -e '.[test]'
# torch_xla's wheel carries its own torchax/ (an older one that imports flax) and overwrites PyPI's when pip
# installs it after torchax; torch_xla's scan over layers imports torchax: put PyPI's back on top.
.venv/bin/python -m pip install "${PIP_FLAGS[@]}" --force-reinstall --no-deps "$(.venv/bin/python -c \
  "import importlib.metadata as m; print('torchax==' + m.version('torchax'))")"
.venv/bin/python -c "from shared.tokenize.tokenizer import fetch_gpt2_ranks; print('GPT-2 ranks:', fetch_gpt2_ranks())"
if [ "${1:-}" = "--kaggle-image" ]; then
  # Kaggle's TPU image pins torch and torch_xla 2.8.0 (Kaggle/docker-python tpu/requirements.in); the train
  # kernel runs on what the image ships, so the tests train on these versions too (CPU build of the kernel's
  # imports: torch, torch_xla, numpy, safetensors, tqdm, matplotlib).
  [ -x .venv-kaggle-tpu/bin/python ] || "$PYTHON" -m venv .venv-kaggle-tpu
  .venv-kaggle-tpu/bin/python -m pip install "${PIP_FLAGS[@]}" torch==2.8.0 torch_xla==2.8.0 numpy safetensors \
    tqdm matplotlib
  .venv-kaggle-tpu/bin/python -c "import torch, torch_xla; print('Kaggle TPU image stack:', torch.__version__, \
torch_xla.__version__)"
fi
