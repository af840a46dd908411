#!/usr/bin/env bash
# Set up everything on a fresh machine: a virtualenv in .venv with the project, its TPU stack (torch 2.9.0 +
# torch_xla 2.9.0) and test tools, plus GPT-2's BPE ranks taken from the package index (no other network).
#
#   bash scripts/setup.sh                 # .venv, and .venv-tpu: the TPU compiler (scripts/tpu_compile.py)
#   bash scripts/setup.sh --kaggle-image  # also .venv-kaggle-tpu and .venv-kaggle-cpu: stand-ins for Kaggle's images
#                                         # (docs/kaggle-tpu.md), which the local Kaggle runs sessions in
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
UV_VERSION=0.13.9
# uv installs each wheel once into its cache and hard-links it into every virtualenv: torch's CUDA build with its
# nvidia wheels (about 7 GB unpacked; torch 2.8.0's are 2.9.0's versions but for nccl) then
# takes its disk once, not once per virtualenv (three with --kaggle-image: about 11 GB in all instead of 23). The
# cache sits under build/, on the virtualenvs' disk, as hard links need (elsewhere uv copies, and /tmp may be a
# small tmpfs).
# UV_NATIVE_TLS: the system's certificates, as pip uses them (a company proxy's own CA included).
export UV_CACHE_DIR="$PWD/build/uv-cache" UV_LINK_MODE=hardlink UV_NO_PROGRESS=1 UV_NATIVE_TLS=1
export TMPDIR="$PWD/build/setup-tmp"
mkdir -p "$TMPDIR"
trap 'rm -rf "$TMPDIR"' EXIT
NEED_GB=$([ "${1:-}" = "--kaggle-image" ] && echo 13 || echo 10)
FREE_GB=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
echo "setup: ${FREE_GB} GB free on the disk of $PWD; it needs about ${NEED_GB} GB"
if [ "$FREE_GB" -lt "$NEED_GB" ]; then
  echo "warning: about ${NEED_GB} GB are needed and ${FREE_GB} GB are free: installs may stop with 'No space left on device'" >&2
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-cache-dir "uv==$UV_VERSION"
install() {  # install VENV PACKAGE...: into that virtualenv (made with venv, so it keeps its own pip)
  local venv=$1; shift
  .venv/bin/uv pip install --quiet --python "$venv/bin/python" "$@"
}
install .venv -e '.[test]'
# torch_xla's wheel carries its own torchax/ (an older one that imports flax), which may land over PyPI's;
# torch_xla's scan over layers imports torchax: put PyPI's back on top.
install .venv --reinstall-package torchax --no-deps "$(.venv/bin/python -c \
  "import importlib.metadata as m; print('torchax==' + m.version('torchax'))")"
.venv/bin/python -c "from shared.tokenize.tokenizer import fetch_gpt2_ranks; print('GPT-2 ranks:', fetch_gpt2_ranks())"
# The TPU compiler, as Kaggle's TPU image pins it (Kaggle/docker-python tpu/Dockerfile: libtpu 0.0.17 "compatible
# with both jax 0.7.2 and torch 2.8.0"): libtpu's compile-only client compiles the train step for v5e-8/v6e-8 here
# (scripts/tpu_compile.py). Its own virtualenv: the project's keeps torch_xla 2.9's jax 0.7.1. About 260 MB to
# download (libtpu 135 MB, jaxlib 78 MB, scipy), 800 MB installed.
[ -x .venv-tpu/bin/python ] || "$PYTHON" -m venv .venv-tpu
install .venv-tpu jax==0.7.2 jaxlib==0.7.2 libtpu==0.0.17 numpy
if [ "${1:-}" = "--kaggle-image" ]; then
  # Stand-ins for Kaggle's images, which the local Kaggle runs sessions in: each holds its image's versions of
  # the packages the kernels import, and nothing the image lacks. Each image's list, with its sources, is in
  # scripts/image_pins/ (docs/kaggle-tpu.md, section 5).
  # TPU image (Kaggle/docker-python tpu/): torch/torch_xla 2.8.0 (CPU backend here) and what it leaves unpinned;
  # no kaggle, tiktoken or wandb. (jax is left out: the kernels import it only on a TPU, for the Pallas kernel.)
  [ -x .venv-kaggle-tpu/bin/python ] || "$PYTHON" -m venv .venv-kaggle-tpu
  install .venv-kaggle-tpu -r scripts/image_pins/kaggle-tpu.txt
  # CPU image (Colab's CPU runtime + kaggle_requirements.txt): the versions of Colab's freeze, one list with its
  # sources (scripts/image_pins/kaggle-cpu.txt), and torch 2.9.0, the project's own, hard-linked from uv's cache
  # (Colab's is 2.10.0+cpu); no tiktoken or wandb.
  [ -x .venv-kaggle-cpu/bin/python ] || "$PYTHON" -m venv .venv-kaggle-cpu
  install .venv-kaggle-cpu torch==2.9.0 -r scripts/image_pins/kaggle-cpu.txt
  for image in tpu cpu; do
    .venv-kaggle-$image/bin/python - "$image" <<'PY'
import importlib.util, sys
import torch
has = [m for m in ("tiktoken", "wandb", "kaggle") if importlib.util.find_spec(m)]
print(f"Kaggle {sys.argv[1].upper()} image stand-in: torch {torch.__version__}; of tiktoken, wandb and kaggle "
      f"it has {', '.join(has) or 'none'}")
PY
  done
fi
# Bytecode for every installed module, made once here: uv writes none, and where PYTHONDONTWRITEBYTECODE is set
# (as on the machines the tests run on) Python would otherwise compile torch's and torch_xla's sources afresh in
# every process: `import torch, torch_xla` took 10.4 s of CPU without it and 4.8 s with it (docs/usage.md), and
# every kernel, session and compile the tests start pays that. compileall skips what is already up to date.
for venv in .venv .venv-tpu .venv-kaggle-tpu .venv-kaggle-cpu; do
  [ -x "$venv/bin/python" ] || continue
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$venv/bin/python" -m compileall -q -j 0 "$site" || echo "setup: some modules in $venv have no bytecode" >&2
done
