#!/usr/bin/env bash
# Create .venv/ at the repo root and install raytrain-hybrid with its dev tools.
# On a machine without an NVIDIA GPU, torch is pinned to the CPU build so that
# setup never downloads the multi-GB CUDA wheels; with a GPU, the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"

# uv installs the same requirements as pip in seconds instead of about two minutes (one
# resolution, parallel downloads and unpacking; the suite's time is counted with setup). pip
# stays the fallback: where uv cannot be installed, or fails, pip does the same install.
# uv does not read pip's configuration, so the wheel directories pip is told of (find-links,
# where a machine keeps a local torch build) are handed on to it. --compile-bytecode as pip does:
# with PYTHONDONTWRITEBYTECODE set (CI's environment) every process would compile what it imports.
if [ "${RAYTRAIN_SETUP_PIP_ONLY:-0}" != 1 ] && $PIP install -q uv >/dev/null 2>&1; then
  links=$($PIP config list 2>/dev/null | sed -n "s/^[^.]*\.find-links='\(.*\)'$/\1/p" | tr ' \n' ',,' | sed 's/,*$//')
  install() {
    UV_FIND_LINKS="${UV_FIND_LINKS:-$links}" .venv/bin/uv pip install --compile-bytecode --python .venv/bin/python "$@" \
      || { echo "setup: uv failed; installing with pip"; $PIP install "$@"; }
  }
else
  install() { $PIP install "$@"; }
fi

TORCH_VERSION=2.13.0
if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; then
  echo "setup: torch $TORCH_VERSION already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  install "torch==$TORCH_VERSION"
else
  # "+cpu" exists only as the CPU build (a local wheel or PyTorch's CPU index), never on PyPI,
  # so this cannot resolve to a CUDA wheel.
  install "torch==$TORCH_VERSION+cpu" \
    || install "torch==$TORCH_VERSION+cpu" --index-url https://download.pytorch.org/whl/cpu
fi
# The torch installed above, pinned: a dependency that asks for torch (peft, through accelerate)
# must not make the resolver swap the CPU build for a CUDA wheel from PyPI.
TORCH_PIN=$(.venv/bin/python -c "import torch; print(torch.__version__)")
install -q -e ".[dev]" "torch==$TORCH_PIN"
echo "setup: done ($(.venv/bin/python -c 'import torch, ray; print("torch", torch.__version__, "ray", ray.__version__)'))"
