"""Families are whole plug-ins: adding a family is its module and a line in ``families/registry.py``; every
script takes its choices from the registry and every family's tiny pipeline is detected as that family.
(That no module outside ``families/`` names a family: ``test_architecture.py``.)"""

import sys
from pathlib import Path

import forked

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "sd_training"
FAMILIES_DIR = PKG / "families"
def test_scripts_take_families_from_the_registry(tmp_path):
    """--family choices are the registry's names (a new family shows up with no script edit)."""
    from sd_training.families.registry import FAMILIES

    for script in ("make_tiny_pipeline.py", "precompute_latents.py"):
        out = forked.run([sys.executable, str(ROOT / "scripts" / script), "--help"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
        for name in FAMILIES:
            assert name in out, (script, name)
