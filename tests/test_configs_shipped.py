"""Every config in configs/ loads (its ??? filled), alone or on top of a per-model base config."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sd_training.configure import load

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "base" not in p.parts)
BASES = sorted((ROOT / "configs" / "base").glob("*.yaml"))


def fill_missing(paths, tmp_path) -> list[str]:
    merged = OmegaConf.merge(*[OmegaConf.load(p) for p in paths])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\n")
    values = {"num_examples_to_see": "1000", "eval_caption_file": str(prompts)}
    return [f"{k}={values.get(k.rsplit('.', 1)[-1], 'placeholder')}" for k in OmegaConf.missing_keys(merged)]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_recipe_loads(recipe, tmp_path):
    cfg = load([f"config={recipe}", *fill_missing([recipe], tmp_path)])
    assert cfg.experiment.num_examples_to_see > 0


@pytest.mark.parametrize("base", BASES, ids=lambda p: p.stem)
def test_base_plus_finetune_recipe(base, tmp_path):
    recipe = ROOT / "configs" / "laion" / "finetune.yaml"
    overrides = [o for o in fill_missing([base, recipe], tmp_path) if not o.startswith("model.pretrained=")]
    base_pretrained = OmegaConf.load(base).model.pretrained
    # The recipe's model.pretrained: ??? does not override the base's value (a ??? never replaces a value).
    cfg = load([f"config={base}", f"config={recipe}", *overrides])
    assert cfg.model.pretrained == base_pretrained
    assert cfg.dataset.params.resolution == 512  # the recipe's, applied after the base
