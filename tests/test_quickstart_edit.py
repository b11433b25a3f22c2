"""The edit quickstart learns an edit: ``configs/quickstart_edit.yaml``, trained exactly as shipped (a tiny Flux
Kontext-style transformer from scratch on paired shapes), exports a FluxKontextPipeline that, given held-out
reference images (pairs no shard holds) and "make the background blue", paints the background blue and keeps
the shape's colour, read back from the pixels (``synthetic.score_edit``); the same pipeline untrained does not."""

import json
import os

import numpy as np
import pytest
from helpers import train_config, val_losses
from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "quickstart_edit.yaml")
HELD_OUT = range(4, 36)  # edit_sample(i, 64, seed=1): seed 1 is no shard's (0..3 are the sample grid's references)


@pytest.fixture(scope="session")
def edit_run(tmp_path_factory):
    """The shipped config, run from a scratch folder (its data/ and runs/ land there)."""
    work = tmp_path_factory.mktemp("quickstart_edit")
    train_config(CONFIG, work)
    return work / "runs" / "quickstart_edit"


def edit_rate(pipe, pairs, steps: int, max_length: int) -> dict:
    """The share of ``pairs`` whose edit (seed i, the pipeline called as the run's samples call it) has a blue
    background, keeps the shape's colour, and both (``ok``)."""
    import torch

    from sd_training.data.synthetic import score_edit
    from sd_training.families.flux_kontext import FluxKontext

    pipe.set_progress_bar_config(disable=True)
    scores = []
    for i, pair in enumerate(pairs):
        ref = pair.references[0]
        with torch.no_grad():
            image = pipe(prompt=pair.caption, height=ref.height, width=ref.width, num_inference_steps=steps,
                         max_sequence_length=max_length, generator=torch.Generator().manual_seed(i),
                         **FluxKontext.reference_call([ref])).images[0]
        scores.append(score_edit(image, pair))
    return {"background": float(np.mean([s["background"] == "blue" for s in scores])),
            "colour": float(np.mean([s["colour"] == p.colour for s, p in zip(scores, pairs)])),
            "ok": float(np.mean([s["ok"] for s in scores]))}


def meets_the_bar(rate: dict) -> bool:
    """"Learned the edit": on held-out pairs, most backgrounds blue and most shapes their own colour (chance:
    1 in 8 each)."""
    return rate["background"] >= 0.8 and rate["colour"] >= 0.6


def held_out_pairs():
    from sd_training.data.synthetic import edit_sample

    return [edit_sample(i, 64, seed=1) for i in HELD_OUT]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the fixture trains the whole quickstart (a few minutes idle; 15+ min under load)
def test_the_edit_quickstart_edits_held_out_references(edit_run):
    from diffusers import FluxKontextPipeline
    from PIL import Image

    from sd_training.data.synthetic import edit_sample, score_edit

    cfg = OmegaConf.load(CONFIG)
    pipe = FluxKontextPipeline.from_pretrained(edit_run / "current_pipeline")
    rate = edit_rate(pipe, held_out_pairs(), cfg.experiment.sample_steps, cfg.model.t5.max_length)
    print("edit quickstart, held-out pairs:", rate)
    assert meets_the_bar(rate), rate
    # The run's own final grid: each row the shipped reference, then its edits, which read back right.
    steps = cfg.experiment.num_examples_to_see // cfg.system.batch_size
    grid = Image.open(edit_run / "samples" / f"step_{steps:08d}.png").convert("RGB")
    per, side = cfg.experiment.sample_per_prompt, 64
    assert grid.size == ((1 + per) * side, len(cfg.experiment.sample_prompts) * side)
    ok = [score_edit(grid.crop(((1 + c) * side, r * side, (2 + c) * side, (r + 1) * side)),
                     edit_sample(r, 64, seed=1))["ok"] for r in range(len(cfg.experiment.sample_prompts))
          for c in range(per)]
    assert np.mean(ok) >= 0.6, ok
    # Held-out flow-matching loss (fixed noise and t) falls well below the untrained model's.
    val = val_losses(edit_run)
    assert val[steps] < 0.3 * val[0], val


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_an_untrained_edit_model_fails_the_same_bar(edit_run):
    """The bar means something: the exported pipeline with the transformer at its step-0 weights (seeded from
    scratch as the run built it) does not meet it."""
    import torch
    from diffusers import FluxKontextPipeline, FluxTransformer2DModel

    cfg = OmegaConf.load(CONFIG)
    pipe = FluxKontextPipeline.from_pretrained(edit_run / "current_pipeline")
    torch.manual_seed(0)
    pipe.transformer = FluxTransformer2DModel(**OmegaConf.to_container(cfg.model.transformer.params))
    rate = edit_rate(pipe, held_out_pairs(), cfg.experiment.sample_steps, cfg.model.t5.max_length)
    assert not meets_the_bar(rate), rate


def test_the_shipped_references_are_the_held_out_pairs_they_claim():
    """The sample grid's references (sd_training/assets/quickstart_edit) are edit_sample(i, 64, seed=1)'s, pixel for
    pixel (PNG), as their provenance.json says: pairs no quickstart shard holds (the shards are seed 0)."""
    from PIL import Image

    from sd_training.config.loading import ASSETS
    from sd_training.data.synthetic import edit_sample

    folder = os.path.join(ASSETS, "quickstart_edit")
    made = json.load(open(os.path.join(folder, "provenance.json")))["images"]
    assert [m["file"] for m in made] == [os.path.basename(p) for p in
                                         OmegaConf.load(CONFIG).experiment.sample_references]
    for i, m in enumerate(made):
        pair = edit_sample(i, 64, seed=1)
        assert (m["shape"], m["colour"], m["background"]) == (pair.shape, pair.colour, pair.backgrounds[0])
        shipped = np.asarray(Image.open(os.path.join(folder, m["file"])).convert("RGB"))
        assert np.array_equal(shipped, np.asarray(pair.references[0].convert("RGB"))), m["file"]


def test_the_edit_dataset_is_written_once_and_rewritten_when_its_settings_change(tmp_path):
    """quickstart.edit_dataset: paired shards (target, reference, instruction) of the configured size, kept while
    quickstart.edit_* match, written again when they change."""
    import tarfile

    from sd_training.config.schema import QuickstartConfig
    from sd_training.quickstart import prepare

    cfg = QuickstartConfig(edit_dataset=str(tmp_path / "edit"), edit_samples=6, shapes_per_shard=4, shapes_size=32)
    prepare(cfg, True)
    shards = sorted((tmp_path / "edit").glob("*.tar"))
    assert len(shards) == 2
    with tarfile.open(shards[0]) as tar:
        names = tar.getnames()
    assert {"00000000.jpg", "00000000.ref.jpg", "00000000.txt"} <= set(names)
    stamp = shards[0].stat().st_mtime_ns
    prepare(cfg, True)
    assert shards[0].stat().st_mtime_ns == stamp  # kept
    prepare(QuickstartConfig(edit_dataset=str(tmp_path / "edit"), edit_samples=9, shapes_per_shard=4,
                             shapes_size=32), True)
    assert len(sorted((tmp_path / "edit").glob("*.tar"))) == 3
