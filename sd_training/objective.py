"""One training step's loss: encode, sample timesteps and noise, predict, compare with the target."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def encode_images(vae, pixel_values: torch.Tensor, scale: float) -> torch.Tensor:
    """Pixels in [-1, 1] -> scaled latents (a sample of the VAE posterior, as Stable Diffusion trains)."""
    latents = vae.encode(pixel_values.to(vae.dtype)).latent_dist.sample()
    return latents * scale


@torch.no_grad()
def encode_text(text_encoder, input_ids: torch.Tensor) -> torch.Tensor:
    """Token ids -> the last hidden states the UNet cross-attends to."""
    return text_encoder(input_ids, return_dict=False)[0]


def training_target(noise_scheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """What the UNet is asked to predict, following the scheduler's ``prediction_type``."""
    kind = noise_scheduler.config.prediction_type
    if kind == "epsilon":
        return noise
    if kind == "v_prediction":
        return noise_scheduler.get_velocity(latents, noise, timesteps)
    if kind == "sample":
        return latents
    raise ValueError(f"unsupported prediction_type '{kind}' in the training noise scheduler")


def diffusion_loss(
    unet, noise_scheduler, latents: torch.Tensor, encoder_hidden_states: torch.Tensor,
    noise: torch.Tensor | None = None, timesteps: torch.Tensor | None = None,
):
    """Mean-squared error of the UNet's prediction; also returns the per-sample losses and timesteps.

    Noise and timesteps not given are drawn from the global torch RNG of the latents' device, which the
    checkpoint saves and restores, so a resumed run draws the same ones. Fixed ones give a loss that is
    comparable across steps (validation).
    """
    if noise is None:
        noise = torch.randn_like(latents)
    if timesteps is None:
        timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device)
    timesteps = timesteps.long()
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    target = training_target(noise_scheduler, latents, noise, timesteps)
    pred = unet(noisy, timesteps, encoder_hidden_states, return_dict=False)[0]
    # The loss in fp32 even under autocast: a bf16 mean over millions of elements loses precision.
    per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    return per_sample.mean(), per_sample.detach(), timesteps
