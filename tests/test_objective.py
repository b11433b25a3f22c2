"""The objective: targets, weights, noise and timesteps checked against the diffusers scheduler math."""

import math

import pytest
import torch
import torch.nn.functional as F

from sd_training.config import ConfigError
from sd_training.families.tiny import SD_SCHEDULER
from sd_training.families.components.ddpm import (
    ObjectiveConfig,
    configure_schedulers,
    diffusion_loss,
    min_snr_weights,
    pyramid_noise,
    sample_noise,
    sample_timesteps,
    snr,
    training_target,
    validate_objective_config,
)


def ddpm(**over):
    from diffusers import DDPMScheduler

    return DDPMScheduler.from_config({**SD_SCHEDULER, **over})


class RecordingUNet(torch.nn.Module):
    """A small deterministic stand-in for the UNet that remembers its input."""

    def __init__(self, channels=4):
        super().__init__()
        torch.manual_seed(123)
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.inputs = []

    def forward(self, x, t, encoder_hidden_states, return_dict=False):
        self.inputs.append(x.detach().clone())
        out = self.conv(x) + encoder_hidden_states.mean() + t.float().view(-1, 1, 1, 1) / 1000
        return (out,)


def _reference_loss(unet, noise_scheduler, latents, encoder_hidden_states, noise=None, timesteps=None):
    """diffusion_loss as it was before the objective options (the exact-resume baseline)."""
    if noise is None:
        noise = torch.randn_like(latents)
    if timesteps is None:
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device)
    timesteps = timesteps.long()
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    target = training_target(noise_scheduler, latents, noise, timesteps)
    pred = unet(noisy, timesteps, encoder_hidden_states, return_dict=False)[0]
    per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    return per_sample.mean(), per_sample.detach(), timesteps


def _batch(b=6, hw=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 4, hw, hw, generator=g), torch.randn(b, 7, 16, generator=g)


# ---------------------------------------------------------------------------------------------- defaults


@pytest.mark.parametrize("cfg", [None, ObjectiveConfig()], ids=["none", "defaults"])
def test_defaults_are_bit_identical_and_draw_the_same_random_numbers(cfg):
    latents, hidden = _batch()
    unet = RecordingUNet()
    torch.manual_seed(7)
    ref = _reference_loss(unet, ddpm(), latents, hidden)
    ref_rng = torch.get_rng_state()
    torch.manual_seed(7)
    new = diffusion_loss(unet, ddpm(), latents, hidden, cfg)
    assert torch.equal(torch.get_rng_state(), ref_rng)
    for a, b in zip(ref, new):
        assert torch.equal(a, b)
    # Fixed noise and timesteps (validation), passed by keyword as the loop does.
    noise, t = torch.randn_like(latents), torch.tensor([0, 10, 200, 500, 900, 999])
    ref = _reference_loss(unet, ddpm(), latents, hidden, noise=noise, timesteps=t)
    new = diffusion_loss(unet, ddpm(), latents, hidden, cfg, noise=noise, timesteps=t)
    for a, b in zip(ref, new):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- targets and weights


def test_v_prediction_target_is_the_schedulers_velocity():
    sched = ddpm(prediction_type="v_prediction")
    latents, _ = _batch()
    noise = torch.randn_like(latents)
    t = torch.tensor([0, 1, 250, 500, 750, 999])
    target = training_target(sched, latents, noise, t)
    assert torch.equal(target, sched.get_velocity(latents, noise, t))
    ac = sched.alphas_cumprod[t].view(-1, 1, 1, 1)
    torch.testing.assert_close(target, ac.sqrt() * noise - (1 - ac).sqrt() * latents)
    assert torch.equal(training_target(ddpm(prediction_type="sample"), latents, noise, t), latents)


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction", "sample"])
def test_min_snr_weights_follow_the_diffusers_formula(kind):
    from diffusers.training_utils import compute_snr

    sched = ddpm(prediction_type=kind)
    gamma = 5.0
    t = torch.arange(0, 1000, 7)
    s = compute_snr(sched, t)
    torch.testing.assert_close(snr(sched, t), s)
    torch.testing.assert_close(snr(sched, t), sched.alphas_cumprod[t] / (1 - sched.alphas_cumprod[t]), rtol=1e-5, atol=0)
    # examples/text_to_image/train_text_to_image.py:
    capped = torch.stack([s, gamma * torch.ones_like(t)], dim=1).min(dim=1)[0]
    expected = {"epsilon": capped / s, "v_prediction": capped / (s + 1), "sample": capped}[kind]
    torch.testing.assert_close(min_snr_weights(sched, t, gamma), expected)
    # The loss is the unweighted per-sample MSE times those weights.
    latents, hidden = _batch()
    unet = RecordingUNet()
    tt = torch.tensor([0, 30, 300, 600, 900, 999])
    noise = torch.randn_like(latents)
    _, plain, _ = diffusion_loss(unet, sched, latents, hidden, ObjectiveConfig(), noise=noise, timesteps=tt)
    loss, weighted, _ = diffusion_loss(unet, sched, latents, hidden, ObjectiveConfig(loss_weighting="min_snr"), noise=noise, timesteps=tt)
    torch.testing.assert_close(weighted, plain * min_snr_weights(sched, tt, gamma))
    torch.testing.assert_close(loss, weighted.mean())


def test_min_snr_is_finite_at_zero_terminal_snr():
    sched = ddpm(rescale_betas_zero_snr=True)  # epsilon with SNR 0 at t=999: the weight is 1, not 0/0
    w = min_snr_weights(sched, torch.tensor([0, 999]), 5.0)
    assert torch.isfinite(w).all() and w[1] == 1.0


# ---------------------------------------------------------------------------------------------- schedulers


def test_zero_terminal_snr_rescales_both_schedulers():
    from diffusers import DDIMScheduler
    from diffusers.schedulers.scheduling_ddpm import rescale_zero_terminal_snr

    train, infer = ddpm(), DDIMScheduler.from_config(SD_SCHEDULER)
    cfg = ObjectiveConfig(zero_terminal_snr=True, prediction_type="v_prediction")
    new_train, new_infer = configure_schedulers(train, infer, cfg)
    assert new_train is not train and train.config.prediction_type == "epsilon"  # inputs untouched
    assert new_train.alphas_cumprod[-1].item() == pytest.approx(0.0, abs=1e-12)
    assert train.alphas_cumprod[-1].item() > 1e-3
    torch.testing.assert_close(new_train.betas, rescale_zero_terminal_snr(train.betas))
    torch.testing.assert_close(new_train.alphas_cumprod[0], train.alphas_cumprod[0])  # first step unchanged
    assert type(new_infer) is DDIMScheduler
    c = new_infer.config
    assert (c.prediction_type, c.rescale_betas_zero_snr, c.timestep_spacing) == ("v_prediction", True, "trailing")
    torch.testing.assert_close(new_infer.alphas_cumprod, new_train.alphas_cumprod)
    new_infer.set_timesteps(10)
    assert new_infer.timesteps[0] == 999  # sampling starts at the SNR-0 step
    # The loss stays finite with v-prediction and min-SNR at the terminal step.
    latents, hidden = _batch()
    obj = ObjectiveConfig(zero_terminal_snr=True, prediction_type="v_prediction", loss_weighting="min_snr")
    loss, per, _ = diffusion_loss(RecordingUNet(), new_train, latents, hidden, obj, timesteps=torch.full((6,), 999))
    assert torch.isfinite(per).all() and torch.equal(per, torch.zeros_like(per))  # weight min(0, g)/(0+1) = 0


def test_scheduler_that_cannot_rescale_becomes_ddim(caplog):
    from diffusers import DDIMScheduler, PNDMScheduler

    cfg = ObjectiveConfig(zero_terminal_snr=True, prediction_type="v_prediction")
    _, infer = configure_schedulers(ddpm(), PNDMScheduler.from_config(SD_SCHEDULER), cfg)
    assert type(infer) is DDIMScheduler and infer.config.rescale_betas_zero_snr
    assert "DDIMScheduler" in caplog.text


def test_prediction_type_alone_keeps_the_inference_class(tmp_path):
    from diffusers import EulerDiscreteScheduler

    euler = EulerDiscreteScheduler.from_config(SD_SCHEDULER)
    train, infer = configure_schedulers(ddpm(), euler, ObjectiveConfig(prediction_type="v_prediction"))
    assert train.config.prediction_type == infer.config.prediction_type == "v_prediction"
    assert type(infer) is EulerDiscreteScheduler and not infer.config.rescale_betas_zero_snr
    # What an exported pipeline writes and reads back.
    infer.save_config(tmp_path)
    assert EulerDiscreteScheduler.from_pretrained(tmp_path).config.prediction_type == "v_prediction"
    # Defaults change nothing: the same objects come back.
    a, b = ddpm(), EulerDiscreteScheduler.from_config(SD_SCHEDULER)
    assert configure_schedulers(a, b, ObjectiveConfig()) == (a, b)
    assert configure_schedulers(a, b, None) == (a, b)
    # A pipeline whose two scheduler configs disagree samples with the training one's parameterisation.
    _, fixed = configure_schedulers(ddpm(prediction_type="v_prediction"), EulerDiscreteScheduler.from_config(SD_SCHEDULER), None)
    assert fixed.config.prediction_type == "v_prediction"


def test_zero_terminal_snr_with_epsilon_is_refused():
    from diffusers import DDIMScheduler

    with pytest.raises(ConfigError, match="objective.prediction_type"):
        configure_schedulers(ddpm(), DDIMScheduler.from_config(SD_SCHEDULER), ObjectiveConfig(zero_terminal_snr=True))
    with pytest.raises(ConfigError, match="objective.prediction_type"):
        validate_objective_config(ObjectiveConfig(zero_terminal_snr=True, prediction_type="epsilon"))
    # x0-prediction is defined at SNR 0.
    configure_schedulers(ddpm(), DDIMScheduler.from_config(SD_SCHEDULER), ObjectiveConfig(zero_terminal_snr=True, prediction_type="sample"))


def test_loss_refuses_a_scheduler_not_configured_for_the_objective():
    latents, hidden = _batch()
    with pytest.raises(ValueError, match="configure_schedulers"):
        diffusion_loss(RecordingUNet(), ddpm(), latents, hidden, ObjectiveConfig(prediction_type="v_prediction"))


# ---------------------------------------------------------------------------------------------- noise


def test_offset_noise_has_the_stated_zero_frequency_std():
    torch.manual_seed(0)
    offset, hw = 0.1, 8
    latents = torch.zeros(8192, 4, hw, hw)
    noise = sample_noise(latents, ObjectiveConfig(noise_offset=offset))
    channel_means = noise.mean(dim=(2, 3))  # the zero-frequency component of each (sample, channel)
    expected = math.sqrt(offset**2 + 1 / hw**2)  # the offset plus the mean of hw*hw unit normals
    assert channel_means.std().item() == pytest.approx(expected, rel=0.03)
    plain = sample_noise(latents, ObjectiveConfig()).mean(dim=(2, 3)).std().item()
    assert plain == pytest.approx(1 / hw, rel=0.03)


def test_pyramid_noise_is_normalised_and_low_frequency_heavy():
    torch.manual_seed(0)
    for hw in (1, 2, 8, 64):
        base = torch.randn(64, 4, hw, hw)
        noise = pyramid_noise(base, 0.8)
        assert noise.shape == base.shape and torch.isfinite(noise).all()
        if hw > 1:
            torch.testing.assert_close(noise.std(dim=(1, 2, 3)), torch.ones(64))
    # At 64x64 the per-channel mean varies far more than white noise's 1/64.
    noise = pyramid_noise(torch.randn(256, 4, 64, 64), 0.8)
    assert noise.mean(dim=(2, 3)).std().item() > 5 / 64
    assert abs(noise.mean().item()) < 0.05
    # Off at 0: exactly the default draw.
    torch.manual_seed(3)
    a = sample_noise(torch.zeros(2, 4, 8, 8), ObjectiveConfig())
    torch.manual_seed(3)
    assert torch.equal(a, torch.randn(2, 4, 8, 8))


def test_input_perturbation_changes_the_input_not_the_target():
    sched = ddpm()
    latents, hidden = _batch()
    gamma = 0.1
    unet = RecordingUNet()
    torch.manual_seed(5)
    noise = torch.randn_like(latents)
    t = torch.randint(0, 1000, (latents.shape[0],))
    extra = torch.randn_like(latents)
    torch.manual_seed(5)
    _, per, ts = diffusion_loss(unet, sched, latents, hidden, ObjectiveConfig(input_perturbation=gamma))
    assert torch.equal(ts, t)
    seen = unet.inputs[-1]
    torch.testing.assert_close(seen, sched.add_noise(latents, noise + gamma * extra, t))
    assert not torch.allclose(seen, sched.add_noise(latents, noise, t))
    # The target is still the unperturbed noise: the loss equals MSE(pred, noise).
    pred = unet(seen, t, hidden)[0]
    torch.testing.assert_close(per, F.mse_loss(pred, noise, reduction="none").mean(dim=(1, 2, 3)))


# ---------------------------------------------------------------------------------------------- timesteps


def _logit_normal_cdf(k: torch.Tensor, n: int, mean: float, std: float) -> torch.Tensor:
    """P(t <= k) when t = floor(n * sigmoid(N(mean, std))): Phi((logit((k + 1) / n) - mean) / std)."""
    x = (k.double() + 1) / n
    z = (torch.log(x) - torch.log1p(-x) - mean) / std
    return torch.where(k >= n - 1, torch.ones_like(z), torch.special.ndtr(z))


@pytest.mark.parametrize("mean, std", [(0.0, 1.0), (0.5, 0.7)])
def test_logit_normal_timesteps_have_the_logit_normal_distribution(mean, std):
    sched = ddpm()
    n = sched.config.num_train_timesteps
    torch.manual_seed(0)
    draws = 200_000
    t = sample_timesteps(sched, draws, torch.device("cpu"), ObjectiveConfig(timestep_sampling="logit_normal", logit_mean=mean, logit_std=std))
    assert t.dtype == torch.int64 and t.min() >= 0 and t.max() <= n - 1
    empirical = torch.bincount(t, minlength=n).cumsum(0).double() / draws
    expected = _logit_normal_cdf(torch.arange(n), n, mean, std)
    ks = (empirical - expected).abs().max().item()
    assert ks < 1.63 / math.sqrt(draws) * 1.5  # well inside the 1% Kolmogorov-Smirnov bound
    # And it is not uniform: the middle is favoured.
    uniform = torch.arange(1, n + 1).double() / n
    assert (expected - uniform).abs().max() > 0.05


def test_uniform_timesteps_are_the_default_randint():
    torch.manual_seed(1)
    t = sample_timesteps(ddpm(), 16, torch.device("cpu"), ObjectiveConfig())
    torch.manual_seed(1)
    assert torch.equal(t, torch.randint(0, 1000, (16,)))


# ---------------------------------------------------------------------------------------------- all together


def test_every_option_trains_a_real_unet(tiny_pipeline):
    from diffusers import DDIMScheduler, UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline, subfolder="unet")
    cfg = ObjectiveConfig(
        prediction_type="v_prediction", zero_terminal_snr=True, loss_weighting="min_snr", noise_offset=0.05,
        pyramid_noise_discount=0.5, input_perturbation=0.1, timestep_sampling="logit_normal",
    )
    validate_objective_config(cfg)
    train, _ = configure_schedulers(ddpm(), DDIMScheduler.from_config(SD_SCHEDULER), cfg)
    latents = torch.randn(2, 4, 8, 8)
    hidden = torch.randn(2, 77, unet.config.cross_attention_dim)
    torch.manual_seed(0)
    loss, per, t = diffusion_loss(unet, train, latents, hidden, cfg)
    loss.backward()
    assert torch.isfinite(loss) and per.shape == (2,) and t.shape == (2,)
    assert all(p.grad is not None for p in unet.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(prediction_type="eps"), "objective.prediction_type"),
        (dict(loss_weighting="snr"), "objective.loss_weighting"),
        (dict(timestep_sampling="cosine"), "objective.timestep_sampling"),
        (dict(snr_gamma=0.0), "objective.snr_gamma"),
        (dict(noise_offset=-0.1), "objective.noise_offset"),
        (dict(pyramid_noise_discount=1.0), "objective.pyramid_noise_discount"),
        (dict(input_perturbation=-1.0), "objective.input_perturbation"),
        (dict(logit_std=0.0), "objective.logit_std"),
    ],
)
def test_invalid_settings_name_the_key(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        validate_objective_config(ObjectiveConfig(**kwargs))
