"""The architecture the README promises, checked: the trainer, checkpointing, strategies and export name
no model family, and the config schema imports no model, objective or data code."""

import ast
import io
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "sd_training"
GENERIC = ["loop.py", "checkpoint.py", "parallel.py", "export.py", "ema.py", "optim.py", "run_guard.py",
           "preemption.py", "trackers.py"]
# Identifiers that belong to a family: its components, its classes, how it is chosen.
FAMILY_NAMES = {
    "sdxl", "vae", "unet", "text_encoder", "text_encoder_2", "tokenizer_2", "train_target", "StableDiffusion",
    "StableDiffusionXL", "Autoencoder", "StableDiffusionPipeline", "StableDiffusionXLPipeline", "AutoencoderKL",
    "UNet2DConditionModel", "CLIPTextModel", "CLIPTextModelWithProjection", "encode_text", "encode_images",
    "diffusion_loss", "vae_loss",
}


def names_in(path: Path) -> dict[str, list[int]]:
    """Identifiers and attribute names in code (strings and comments excluded), with their lines."""
    found: dict[str, list[int]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.NAME and tok.string in FAMILY_NAMES:
            found.setdefault(tok.string, []).append(tok.start[0])
    return found


def family_imports(path: Path) -> list[str]:
    """``from .families.sd import ...`` / ``from .families import sdxl``: a generic module reaching into one family."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and "families" in node.module.split("."):
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [p for p in parts if p in ("sd", "sdxl", "autoencoder")]
    return found


@pytest.mark.parametrize("name", GENERIC)
def test_generic_code_names_no_family(name):
    path = PKG / name
    assert not names_in(path), f"{name} names family-specific things: {names_in(path)}"
    assert not family_imports(path), f"{name} imports a family module: {family_imports(path)}"


def test_the_check_sees_a_family_name(tmp_path):
    """The scan above would catch a branch on a family (it is not vacuous)."""
    bad = tmp_path / "bad.py"
    bad.write_text('if cfg.model.train_target == "vae":\n    net = models.unet  # comment: sdxl\n')
    assert set(names_in(bad)) == {"train_target", "unet"}


def test_config_schema_imports_no_model_objective_or_data_code():
    """The config package, its schema and loading included (all but ``checks``), imports no torch and no
    model, objective or data code; a family's own sections come from the torch-free families.options."""
    imports = "import sys, sd_training.config, sd_training.config.schema, sd_training.config.loading; "
    code = imports + "print(sorted(m for m in sys.modules if m.startswith('sd_training')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(ast.literal_eval(out))
    allowed = {"sd_training", "sd_training.config", "sd_training.families", "sd_training.families.options"}
    allowed |= {f"sd_training.config.{m}" for m in ("fields", "schema", "dataset", "loading", "rules")}
    extra = loaded - allowed
    assert not extra, f"sd_training.config imports {sorted(extra)}"
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", imports + "print(' '.join(sys.modules))"],
        capture_output=True, text=True, check=True).stdout.split()
