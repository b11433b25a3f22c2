"""The flow-matching quickstart learns visibly: ``configs/quickstart_mmdit.yaml``, trained exactly as shipped
(a tiny MMDiT from scratch, SD3's family, rectified flow), exports a StableDiffusion3Pipeline that draws
the background, colour and shape of held-out captions; the same pipeline untrained does not."""

import os

import pytest
from helpers import train_config, val_losses
from omegaconf import OmegaConf
from test_quickstart import follow_rate, held_out_captions, meets_the_bar, prompts_of, read_grid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "quickstart_mmdit.yaml")
NO_T5 = dict(text_encoder_3=None, tokenizer_3=None)


@pytest.fixture(scope="session")
def mmdit_run(tmp_path_factory):
    """The shipped config, run from a scratch folder (its data/ and runs/ land there)."""
    work = tmp_path_factory.mktemp("quickstart_mmdit")
    train_config(CONFIG, work)
    return work / "runs" / "quickstart_mmdit"


def sampling(cfg) -> dict:
    """The quickstart's sampling settings: its guidance, and T5's trained length of zero tokens."""
    return dict(guidance=cfg.experiment.sample_guidance_scale, max_sequence_length=cfg.model.t5.max_length)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the fixture trains the whole quickstart (~4 min idle; 15+ min on a loaded machine)
def test_the_mmdit_quickstart_draws_the_shapes_and_colours_of_held_out_captions(mmdit_run):
    from diffusers import StableDiffusion3Pipeline

    cfg = OmegaConf.load(CONFIG)
    # Saved without T5 (model.t5.use: false): diffusers loads such a pipeline with text_encoder_3=None.
    pipe = StableDiffusion3Pipeline.from_pretrained(mmdit_run / "current_pipeline", **NO_T5)
    assert pipe.text_encoder_3 is None and pipe.tokenizer.model_max_length == cfg.model.text_encoder.max_length
    assert pipe.vae.config.shift_factor == 0.0  # the quickstart VAE has none: exported with 0, as trained
    shard = mmdit_run.parents[1] / cfg.validation.path
    rate = follow_rate(pipe, held_out_captions(shard), **sampling(cfg))
    assert meets_the_bar(rate), rate
    # The run's own final grid (4 prompts x 4 seeds) draws the colours.
    steps = cfg.experiment.num_examples_to_see // cfg.system.batch_size
    final = read_grid(mmdit_run / "samples" / f"step_{steps:08d}.png", prompts_of(CONFIG))
    assert final["background"] + final["colour"] >= 1.5, final
    # Held-out flow-matching loss (fixed noise and t) falls well below the untrained model's.
    val = val_losses(mmdit_run)
    assert val[steps] < 0.25 * val[0], val


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_an_untrained_mmdit_fails_the_same_bar(mmdit_run):
    """The bar means something: the exported pipeline with the transformer and both CLIPs at their step-0
    weights (the seeded from-scratch transformer, the tiny pipeline's random CLIPs) does not meet it."""
    import torch
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    cfg = OmegaConf.load(CONFIG)
    pipe = StableDiffusion3Pipeline.from_pretrained(mmdit_run / "current_pipeline", **NO_T5)
    torch.manual_seed(0)
    pipe.transformer = SD3Transformer2DModel(**OmegaConf.to_container(cfg.model.transformer.params))
    tiny = mmdit_run.parents[1] / cfg.quickstart.tiny_pipeline
    pipe.text_encoder = CLIPTextModelWithProjection.from_pretrained(tiny / "text_encoder")
    pipe.text_encoder_2 = CLIPTextModelWithProjection.from_pretrained(tiny / "text_encoder_2")
    rate = follow_rate(pipe, held_out_captions(mmdit_run.parents[1] / cfg.validation.path), **sampling(cfg))
    assert not meets_the_bar(rate), rate
