"""Flow matching (``families/flow_matching.py``) against diffusers' reference: the scheduler's sigma table,
``compute_density_for_timestep_sampling`` / ``compute_loss_weighting_for_sd3`` and the loss as
``examples/dreambooth/train_dreambooth_sd3.py`` writes it; per-sample draws from the sample seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from sd_training.config import ConfigError
from sd_training.families.components import flow_matching as fm
from sd_training.families.options import FlowMatchingConfig


def sd3_scheduler():
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


def flux_scheduler():
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096)


def test_sigma_table_is_the_schedulers():
    s = sd3_scheduler()
    assert torch.equal(fm.sigma_table(FlowMatchingConfig(), s), s.sigmas)
    # A static shift of the config replaces the scheduler's.
    s1 = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.5)
    assert torch.equal(fm.sigma_table(FlowMatchingConfig(shift=1.5), s), s1.sigmas)
    # Flux: the scheduler's sigmas are unshifted; the resolution shift is its time_shift at mu (calculate_shift).
    f = flux_scheduler()
    assert fm.uses_resolution_shift(FlowMatchingConfig(), f) and not fm.uses_resolution_shift(FlowMatchingConfig(), s)
    assert not fm.uses_resolution_shift(FlowMatchingConfig(shift=2.0), f)
    seq = 1024
    table = fm.sigma_table(FlowMatchingConfig(), f, image_seq_len=seq)
    mu = (1.15 - 0.5) / (4096 - 256) * (seq - 256) + 0.5
    ref = FlowMatchEulerDiscreteScheduler.from_config(f.config)
    ref.set_timesteps(sigmas=f.sigmas.numpy(), mu=mu)  # as FluxPipeline sets its inference sigmas
    torch.testing.assert_close(table, ref.sigmas[:-1].float(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="image_seq_len"):
        fm.sigma_table(FlowMatchingConfig(), f)


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal", "mode"])
def test_sigmas_follow_the_sd3_example(sampling):
    """Global RNG: u from compute_density_for_timestep_sampling, indices = (u * 1000).long(), sigmas and
    timesteps from the scheduler's tables (train_dreambooth_sd3.py)."""
    cfg = FlowMatchingConfig(timestep_sampling=sampling, logit_mean=0.3, logit_std=1.2, mode_scale=1.29)
    s = sd3_scheduler()
    torch.manual_seed(5)
    sigmas = fm.sample_sigmas(cfg, s, 64, torch.device("cpu"))
    torch.manual_seed(5)
    u = compute_density_for_timestep_sampling(sampling, 64, logit_mean=0.3, logit_std=1.2, mode_scale=1.29)
    indices = (u * s.config.num_train_timesteps).long()
    assert torch.equal(sigmas, s.sigmas[indices])
    assert torch.equal(sigmas * 1000, s.timesteps[indices])
    assert sigmas.dtype == torch.float32 and bool(((sigmas > 0) & (sigmas <= 1)).all())


def test_weights_are_diffusers():
    sig = torch.tensor([0.1, 0.5, 0.9])
    for w in fm.WEIGHTINGS:
        assert torch.equal(fm.loss_weights(FlowMatchingConfig(weighting=w), sig),
                           compute_loss_weighting_for_sd3(w, sig).float())
    torch.testing.assert_close(fm.loss_weights(FlowMatchingConfig(weighting="cosmap"), sig),
                               2 / (math.pi * (1 - 2 * sig + 2 * sig**2)))


@pytest.mark.parametrize("weighting", ["none", "sigma_sqrt", "cosmap"])
def test_loss_is_the_sd3_examples(weighting):
    """Given noise and sigmas, flow_loss's input, timesteps, target and loss are the example's."""
    torch.manual_seed(0)
    x0, noise = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    sigmas = torch.tensor([0.2, 0.6, 1.0])
    proj = torch.nn.Conv2d(4, 4, 1)
    seen = {}

    def predict(noisy, t):
        seen["noisy"], seen["t"] = noisy, t
        return proj(noisy) * t.view(-1, 1, 1, 1) / 1000

    cfg = FlowMatchingConfig(weighting=weighting)
    loss, per_sample, timesteps = fm.flow_loss(predict, x0, cfg, sd3_scheduler(), noise=noise, sigmas=sigmas)
    s = sigmas.view(-1, 1, 1, 1)
    noisy = (1.0 - s) * x0 + s * noise  # the example's noisy_model_input
    assert torch.equal(seen["noisy"], noisy) and torch.equal(seen["t"], sigmas * 1000)
    pred = proj(noisy) * (sigmas * 1000).view(-1, 1, 1, 1) / 1000
    weight = compute_loss_weighting_for_sd3(weighting, s)
    ref = torch.mean((weight.float() * (pred.float() - (noise - x0).float()) ** 2).reshape(3, -1), 1)
    torch.testing.assert_close(per_sample, ref, rtol=0, atol=0)
    torch.testing.assert_close(loss, ref.mean(), rtol=0, atol=0)
    assert timesteps.dtype == torch.int64 and timesteps.tolist() == [200, 600, 1000]
    loss.backward()
    assert proj.weight.grad is not None


def test_a_samples_draws_depend_on_its_seed_only():
    """With sample seeds, a sample's sigma, noise and loss are the same in any batch split and whatever the
    global RNG."""
    cfg = FlowMatchingConfig(weighting="cosmap")
    s = sd3_scheduler()
    x0 = torch.randn(4, 2, 3, 3)
    seeds = torch.tensor([11, 12, 13, 14])

    def run(rows):
        torch.manual_seed(int(rows[0]) * 7)  # a different global state each time
        return fm.flow_loss(lambda x, t: x * 0.5, x0[rows], cfg, s, sample_seeds=seeds[rows])

    _, whole, t_whole = run([0, 1, 2, 3])
    _, a, t_a = run([0, 1])
    _, b, t_b = run([2, 3])
    torch.testing.assert_close(torch.cat([a, b]), whole, rtol=1e-6, atol=1e-7)
    assert torch.equal(torch.cat([t_a, t_b]), t_whole)
    u = fm.sample_u(cfg, 4, torch.device("cpu"), seeds)
    assert len(set(u.tolist())) == 4  # distinct seeds, distinct draws
    noise = fm.sample_noise(x0, [11, 12, 13, 14])
    assert torch.equal(noise[2:], fm.sample_noise(x0[2:], [13, 14]))
    with pytest.raises(ValueError, match="sample seeds for a batch"):
        fm.sample_u(cfg, 3, torch.device("cpu"), seeds)


def test_mode_sampling_stays_in_range():
    cfg = FlowMatchingConfig(timestep_sampling="mode", mode_scale=fm.MODE_SCALE_MAX)
    sig = fm.sample_sigmas(cfg, sd3_scheduler(), 2000, torch.device("cpu"), sample_seeds=np.arange(2000).tolist())
    assert bool(((sig > 0) & (sig <= 1)).all())


@pytest.mark.parametrize("kw, key", [
    (dict(timestep_sampling="beta"), "flow_matching.timestep_sampling"),
    (dict(weighting="min_snr"), "flow_matching.weighting"),
    (dict(logit_std=0.0), "flow_matching.logit_std"),
    (dict(shift=2.0, resolution_shift=True), "flow_matching.shift"),
    (dict(timestep_sampling="mode", mode_scale=2.5), "flow_matching.mode_scale"),
])
def test_validate_names_the_key(kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        fm.validate(FlowMatchingConfig(**kw))
    fm.validate(FlowMatchingConfig())
