"""Flux Kontext: FLUX.1's transformer trained to edit a reference image (``FluxKontextPipeline``).

Everything of ``flux.py`` (T5 states and CLIP's pooled output, 2x2-packed latents, the guidance embedding
fed ``model.guidance_embed``, the resolution shift), and one reference image per sample
(``dataset.params.references: 1``), as ``FluxKontextPipeline`` conditions on it and diffusers'
``examples/dreambooth/train_dreambooth_lora_flux_kontext.py`` trains it:

* the reference's latents in the target's units (``(z - shift_factor) * scaling_factor``), packed 2x2 as the
  target's and concatenated after the noisy target's tokens along the sequence; they carry no noise;
* their position ids are the packed grid's (row, column) with first coordinate 1 (the target's is 0), as
  ``FluxKontextPipeline.prepare_latents`` sets them: the transformer tells the two images apart by it;
* the prediction keeps the target's tokens (``noise_pred[:, :target_len]``): the loss is on the target
  alone, and the resolution shift counts the target's tokens (the pipeline's ``image_seq_len``);
* the reference's VAE latents are drawn as the target's are (``model.vae.latent_sampling``, each reference
  from its own seeds; latent shards store a posterior sample of each): the example script takes one
  ``--vae_encode_mode`` for both too. Its default, and the pipeline at inference (``sample_mode="argmax"``),
  use the posterior mode: set ``model.vae.latent_sampling: mean`` to train exactly as the example does by
  default; ``sample`` (the default here, as for every family) adds the posterior's small noise to both, a mild
  augmentation of the reference.

Samples and eval images pass each prompt's reference (``experiment.sample_references``,
``experiment.eval_reference_file``) as ``image=`` with ``_auto_resize=False``: the pipeline would otherwise
resize it to the preferred Kontext resolution of its aspect ratio (about 1 Mpx, e.g. 1024 x 1024), far from
the sample size the run trains and samples at; the reference already is the sample's size
(``outputs.sample_references.load``). ``max_area`` is the reference's area: the pipeline scales the output's
height and width to ``max_area`` (1 Mpx by default) whatever size is asked.
"""

from __future__ import annotations

import torch
from PIL import Image

from .components.packing import image_ids, pack
from .flux import Flux


class FluxKontext(Flux):
    name = "flux_kontext"
    text_tag = "flux"  # the same T5 and CLIP conditioning as Flux's: latent shards of either serve both
    display_name = "Flux Kontext"
    pipeline_classes = ("FluxKontextPipeline",)
    card_tags = ("flux", "flux-kontext", "image-to-image", "flux-diffusers")
    reference_images = (1, 1)

    def join_references(self, latents: torch.Tensor, refs: list[torch.Tensor],
                        inputs: dict) -> tuple[torch.Tensor, dict]:
        """The reference packed 2x2 as the target; its ids (1, row, column) after the target's (0, row, column)."""
        (ref,) = refs
        ids = image_ids(ref)
        ids[..., 0] = 1
        return pack(ref), dict(inputs, img_ids=torch.cat([inputs["img_ids"], ids], dim=0))

    @classmethod
    def reference_call(cls, images: list[Image.Image]) -> dict:
        """``image=`` the reference at the sample's size, not resized to ~1 Mpx (the module); ``max_area`` its
        area, because the pipeline scales the requested height and width to ``max_area`` (1024^2 by default)
        whatever size is asked: the images come out at the sample's size, the reference's."""
        (image,) = images
        return dict(image=image, _auto_resize=False, max_area=image.width * image.height)

    # -- estimates: the reference's tokens join the target's in every block -------------------------------
    # (the memory plan counts them from dataset.params.references: memory.activations.transformer_sample_elements)
    @classmethod
    def reference_models(cls) -> dict:
        """None of its own: FLUX.1 Kontext [dev]'s transformer is shaped as FLUX.1-dev's (the memory table's
        Flux.1-dev row), its step carrying the reference's tokens too."""
        return {}

    def flops_inputs(self, config, h: int, w: int) -> dict:
        """Flux's inputs with the reference's tokens (the target's size) after the target's."""
        inputs = super().flops_inputs(config, h, w)
        n = inputs["hidden_states"].shape[1] * (1 + self.reference_images[1])
        return dict(inputs, hidden_states=torch.empty(1, n, config.in_channels, device="meta"),
                    img_ids=torch.zeros(n, 3, device="meta"))
