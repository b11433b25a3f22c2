"""Model building from a tiny pipeline folder, per component, and from scratch."""

import pytest
import torch

from sd_training.config import ComponentConfig, ConfigError
from sd_training.config.schema import ModelConfig, UNetConfig, VAEConfig
from sd_training.families.tiny import TINY_UNET, build_clip_tokenizer
from sd_training.families.components.unet import build_models
from sd_training.families.components.clip import TextEncoderConfig


def test_clip_tokenizer_matches_openai_ids(tmp_path):
    tok = build_clip_tokenizer(tmp_path / "tok")
    assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert len(tok) == 49408


def test_build_from_pipeline_folder(tiny_pipeline):
    m = build_models(ModelConfig(pretrained=str(tiny_pipeline)), torch.device("cpu"))
    # Frozen parts: eval mode, no gradients.
    for frozen in (m.vae, m.text_encoder):
        assert not frozen.training
        assert not any(p.requires_grad for p in frozen.parameters())
    assert m.unet.training and all(p.requires_grad for p in m.unet.parameters())
    assert m.latent_scale == pytest.approx(m.vae.config.scaling_factor)
    assert type(m.noise_scheduler).__name__ == "DDPMScheduler"
    assert type(m.inference_scheduler).__name__ == "DDIMScheduler"  # the class saved in scheduler/


def test_latent_scale_comes_from_vae_config(tmp_path):
    from sd_training.families.registry import make_tiny_pipeline

    p = make_tiny_pipeline(tmp_path / "p", scaling_factor=0.5)
    m = build_models(ModelConfig(pretrained=str(p)), torch.device("cpu"))
    assert m.latent_scale == 0.5


def test_build_per_component_with_scratch_unet(tiny_pipeline):
    cfg = ModelConfig(
        vae=VAEConfig(str(tiny_pipeline / "vae")),  # a component folder itself
        text_encoder=TextEncoderConfig(pretrained=str(tiny_pipeline)),  # a pipeline root
        tokenizer=ComponentConfig(str(tiny_pipeline)),
        noise_scheduler_training=ComponentConfig(str(tiny_pipeline)),
        noise_scheduler_inference=ComponentConfig(str(tiny_pipeline)),
        unet=UNetConfig(target="diffusers.UNet2DConditionModel", params={**TINY_UNET, "block_out_channels": [32, 64, 64]}),
    )
    m1 = build_models(cfg, torch.device("cpu"), seed=3)
    m2 = build_models(cfg, torch.device("cpu"), seed=3)
    assert tuple(m1.unet.config.block_out_channels) == (32, 64, 64)
    # From scratch is seeded: every rank and every restart builds the same weights.
    for a, b in zip(m1.unet.parameters(), m2.unet.parameters()):
        assert torch.equal(a, b)


def test_mismatched_cross_attention_dim_is_explained(tiny_pipeline):
    cfg = ModelConfig(pretrained=str(tiny_pipeline), unet=UNetConfig(params={**TINY_UNET, "cross_attention_dim": 32}))
    with pytest.raises(ConfigError, match="cross_attention_dim=64"):
        build_models(cfg, torch.device("cpu"))


def test_missing_local_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="model.text_encoder.pretrained.*not a directory"):
        build_models(ModelConfig(pretrained=str(tmp_path / "nope")), torch.device("cpu"))


def test_xformers_request_falls_back_to_sdpa_on_cpu(tiny_pipeline, caplog):
    m = build_models(ModelConfig(pretrained=str(tiny_pipeline), xformers=True), torch.device("cpu"))
    assert "xformers kernels run on CUDA only" in caplog.text
    procs = {type(p).__name__ for p in m.unet.attn_processors.values()}
    assert procs == {"AttnProcessor2_0"}


@pytest.mark.faults
def test_unet_target_names_model_classes_not_arbitrary_callables(monkeypatch, tmp_path):
    """``model.unet.target`` is resolved by import: a config must not be able to run ``subprocess.Popen``."""
    from sd_training.config import ConfigError
    from sd_training.families.components.unet import UNET_MODULES_ENV, resolve_unet_class

    monkeypatch.delenv(UNET_MODULES_ENV, raising=False)
    assert resolve_unet_class("diffusers.models.unets.unet_2d_condition.UNet2DConditionModel").__name__ == "UNet2DConditionModel"
    with pytest.raises(ConfigError, match=f"outside diffusers.*{UNET_MODULES_ENV}=subprocess"):
        resolve_unet_class("subprocess.Popen")
    with pytest.raises(ConfigError, match="is not a model class"):
        resolve_unet_class("diffusers.utils.logging.get_logger")
    # A user's own model module, allowed explicitly.
    (tmp_path / "my_unets.py").write_text(
        "from diffusers import UNet2DConditionModel\nclass MyUNet(UNet2DConditionModel):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="outside diffusers"):
        resolve_unet_class("my_unets.MyUNet")
    monkeypatch.setenv(UNET_MODULES_ENV, "other, my_unets")
    assert resolve_unet_class("my_unets.MyUNet").__name__ == "MyUNet"
