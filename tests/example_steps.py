"""Training steps written as diffusers' example scripts compute them, for the families' step-equality tests
(``helpers.step_equals_example`` runs the family's step against one): Qwen-Image and its edit pipelines
(test_qwen_image.py, test_qwen_image_edit.py) and FLUX.2 with and without reference images (test_flux2.py,
test_flux2_references.py). Each takes u and the noise, so that the test draws them as the family does."""

from __future__ import annotations

import torch
from PIL import Image


def pil(values: torch.Tensor) -> Image.Image:
    """A uint8 [3, H, W] image (the loader's ``reference_values`` layout) as a PIL image."""
    return Image.fromarray(values.permute(1, 2, 0).numpy())


def scheduled(pipe, model_input, u, noise):
    """The examples' timesteps, sigmas and noisy input from u: the scheduler's unshifted table, indexed by
    ``u * num_train_timesteps`` (sigmas shaped to broadcast over ``model_input``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    timesteps = scheduler.timesteps[(u * scheduler.config.num_train_timesteps).long()]
    step_indices = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[step_indices].flatten().view(-1, *[1] * (model_input.ndim - 1))
    return timesteps, sigmas, (1.0 - sigmas) * model_input + sigmas * noise


def flow_loss(model_pred, target, sigmas, weighting_scheme):
    """The examples' loss: the weighted squared error per sample, averaged."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    bsz = target.shape[0]
    return torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(bsz, -1), 1).mean()


def qwen_step(pipe, transformer, target, prompts, u, noise, weighting_scheme, length=None, refs=None,
              vl_images=None):
    """One step as examples/dreambooth/train_dreambooth_lora_qwen_image.py computes it, given u and the noise (in
    its [B, C, 1, h, w] layout): each prompt's ``encode_prompt`` (at ``length`` tokens where given), padded to the
    longest with the masks materialised (``concat_prompt_embedding_batches``), the target's posterior mode
    normalised per channel, the frame axis moved before packing. With ``refs`` (uint8 [B, k, 3, H, W]) as the
    edit pipelines' forward adds them: each prompt encoded with its references (``vl_images(its references)``;
    None: the images themselves), each reference's ``_encode_vae_image`` packed after the noisy target's tokens
    in order (``prepare_latents`` and the denoising loop), ``img_shapes`` [target, each reference], the
    prediction's target tokens (``noise_pred[:, : latents.size(1)]``)."""
    cls, vae = type(pipe), pipe.vae
    z, vsf = vae.config.z_dim, 2 ** len(vae.temperal_downsample)
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
    k = 0 if refs is None else refs.shape[1]
    encode = {} if length is None else {"max_sequence_length": length}
    with torch.no_grad():
        if k:
            per_prompt = [[pil(refs[i, j]) for j in range(k)] for i in range(len(prompts))]
            encode_images = vl_images or (lambda images: images)
            pairs = [pipe.encode_prompt(p, image=encode_images(ims), device="cpu", **encode)
                     for p, ims in zip(prompts, per_prompt)]
        else:
            pairs = [pipe.encode_prompt(p, device="cpu", **encode) for p in prompts]
        model_input = vae.encode(target.unsqueeze(2)).latent_dist.mode()
        image_latents = [pipe._encode_vae_image(refs[:, j].float().div(127.5).sub(1).unsqueeze(2), generator=None)
                         for j in range(k)]
    n = max(e.shape[1] for e, _ in pairs)
    masks = [torch.ones(e.shape[:2], dtype=torch.long) if m is None else m for e, m in pairs]
    prompt_embeds = torch.cat([torch.cat([e, e.new_zeros(1, n - e.shape[1], e.shape[2])], 1) for e, _ in pairs])
    prompt_embeds_mask = torch.cat([torch.cat([m, m.new_zeros(1, n - m.shape[1])], 1) for m in masks])
    model_input = (model_input - latents_mean) * latents_std
    bsz = model_input.shape[0]
    timesteps, sigmas, noisy_model_input = scheduled(pipe, model_input, u, noise)
    h, w = model_input.shape[3], model_input.shape[4]
    shapes = [(1, h // 2, w // 2), *[(1, x.shape[3] // 2, x.shape[4] // 2) for x in image_latents]]
    img_shapes = [shapes] * bsz if k else [shapes[0]] * bsz  # the text-to-image example: one shape per sample
    packed = cls._pack_latents(noisy_model_input.permute(0, 2, 1, 3, 4), bsz, z, h, w)
    packed_images = [cls._pack_latents(x, bsz, z, x.shape[3], x.shape[4]) for x in image_latents]
    model_pred = transformer(hidden_states=torch.cat([packed, *packed_images], dim=1),
                             encoder_hidden_states=prompt_embeds, encoder_hidden_states_mask=prompt_embeds_mask,
                             timestep=timesteps / 1000, img_shapes=img_shapes, return_dict=False)[0]
    model_pred = cls._unpack_latents(model_pred[:, : packed.size(1)], h * vsf, w * vsf, vsf)
    return flow_loss(model_pred, noise - model_input, sigmas, weighting_scheme), timesteps


def flux2_step(pipe, transformer, target, prompts, u, noise, guidance_scale, length, conds=(),
               weighting_scheme="none"):
    """One step as diffusers' examples/dreambooth/train_dreambooth_lora_flux2_klein.py (and _flux2.py for dev's
    guidance) computes it, given u and the noise (patchified): the posterior mode, patchified and batch-norm
    normalised, the unshifted table, the guidance embedding where the transformer has one. With ``conds``
    (images in [-1, 1]) as train_dreambooth_lora_flux2_klein_img2img.py (and _flux2_img2img.py) computes it: each
    condition's tokens packed after the target's with ``_prepare_image_ids`` ids from the first sample, expanded
    over the batch, the prediction cut to the target's tokens. Several conditions are joined as
    ``prepare_image_latents`` joins them (the script takes one: ``_prepare_image_ids([cond[0:1]])``, the list of
    one). The img2img scripts weight uniformly (``weighting_scheme="none"``)."""
    cls, vae = type(pipe), pipe.vae
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    with torch.no_grad():
        prompt_embeds, text_ids = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=length)
        model_input = vae.encode(target).latent_dist.mode()
        cond_inputs = [vae.encode(c).latent_dist.mode() for c in conds]
    model_input = (cls._patchify_latents(model_input) - mean) / std
    cond_inputs = [(cls._patchify_latents(c) - mean) / std for c in cond_inputs]
    ids = cls._prepare_latent_ids(model_input)
    bsz = model_input.shape[0]
    timesteps, sigmas, noisy = scheduled(pipe, model_input, u, noise)
    packed = cls._pack_latents(noisy)
    n = packed.shape[1]
    if cond_inputs:
        cond_ids = cls._prepare_image_ids([c[0:1] for c in cond_inputs]).expand(bsz, -1, -1)
        packed = torch.cat([packed, *[cls._pack_latents(c) for c in cond_inputs]], dim=1)
        ids = torch.cat([ids, cond_ids], dim=1)
    guidance = torch.full([1], guidance_scale).expand(bsz) if transformer.config.guidance_embeds else None
    model_pred = transformer(hidden_states=packed, timestep=timesteps / 1000, guidance=guidance,
                             encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=ids, return_dict=False)[0]
    model_pred = cls._unpack_latents_with_ids(model_pred[:, :n, :], ids[:, :n, :])
    return flow_loss(model_pred, noise - model_input, sigmas, weighting_scheme), timesteps
