"""The base of the flow-matching transformer families (SD3 in ``sd3.py``, Flux in ``flux.py``): a diffusion
transformer trained with flow matching (``components.flow_matching``, the ``flow_matching`` config section)
on the latents of a VAE with a shift factor, conditioned on text states and a pooled text embedding.

It holds the text-conditioning plumbing (states and pooled from latent shards, else encoded by the family),
the latents (``(z - shift_factor) * scaling_factor``, ``components.vae``), the flow-matching loss around the
transformer's forward, validation batches, the transformer's compile and FSDP2 units, LoRA presets, config
checks of the UNet families' keys, and pipelines that pad the text to the trained length. A family declares
its components (``build_models``), how captions become (states, pooled) (``encode_condition``), its
pipeline, and overrides the few hooks where its transformer differs:

* ``transformer_inputs``: the conditioning as the forward's keyword arguments (default: SD3's and Flux's
  ``encoder_hidden_states`` and ``pooled_projections``; Flux adds position ids and the guidance embedding);
* ``pack`` / ``unpack``: latents -> the transformer's input and its output -> latents (Flux: 2x2 patches);
* ``transformer_timestep``: the timestep as the transformer takes it (``sigma * 1000``; Flux: sigma), and
  ``forward_names`` the forward's names for it and the latents;
* ``image_seq_len``: the image's token count for a resolution-dependent shift (None: no such shift);
* ``validation_timesteps``: the held-out batch's fixed timesteps (default: spread over the sigma table);
* ``flops_inputs`` / ``text_encoder_runs``: one image's forward inputs and the text encoders' runs, for MFU;
* ``join_references``: an edit family's reference images in the transformer's input (below).

Edit training (``dataset.params.references`` > 0; ``Family.reference_images`` says how many a family takes).
The references are clean latents (``PipelineFamily.reference_latents``: stored in latent shards or VAE-encoded,
in the target's units) that the transformer sees as more image tokens after the noisy target's, as the edit
pipelines concatenate them (``FluxKontextPipeline``, ``QwenImageEditPipeline``, ``Flux2Pipeline``). The hook's
contract: ``join_references(latents, refs, inputs) -> (tokens, inputs)`` is given the target's latents [B, C,
h, w], one [B, C, h', w'] tensor per reference and the forward's keyword arguments (``transformer_inputs``); it
returns the references' tokens [B, N_ref, D] (the family's own packing, as ``pack`` packs the target) and the
keyword arguments with what the transformer needs to tell the references apart (Kontext: their position ids
with first coordinate 1; Qwen-Image-Edit: ``img_shapes`` listing the target's and each reference's grid;
FLUX.2: position ids with a time offset per reference). It is called once per step (the references carry no
noise), the tokens are concatenated after the packed noisy target's along the sequence (dim 1) at every
forward, and the prediction keeps the target's tokens only (``out[:, :target_len]``, as the pipelines do)
before ``unpack``: the loss is on the target alone, and the resolution shift counts the target's tokens (the
pipelines' ``image_seq_len``).
"""

from __future__ import annotations

import abc
import inspect

import torch

from ..config import ConfigError
from ..config.schema import TrainConfig
from ..data.latents import POOLED_KEY, TEXT_STATES_KEY
from ..memory import activations
from ..speed.flops import StepFlops, count_net_flops, encoder_flops, latent_size_of, vae_encode_flops
from .base import LossOut
from .components import flow_matching
from .components import vae as vae_encoding
from .components.transformer import ADAPTER_PRESETS, TrainedLength, shard_units, transformer_blocks, validate_common
from .options import T5Config
from .pipeline_family import PipelineFamily, is_latent_data


def llm_text_refusals(cfg: TrainConfig, display_name: str) -> list[tuple[bool, str]]:
    """The keys of other families' text encoders, refused by a family whose one text encoder is an LLM
    (Z-Image, FLUX.2, Qwen-Image): (refused, message) pairs."""
    m = cfg.model
    return [
        (any(getattr(m, k).pretrained is not None for k in ("text_encoder_2", "tokenizer_2", "text_encoder_3",
                                                            "tokenizer_3")),
         f"{display_name} has one text encoder (model.text_encoder / model.tokenizer): model.text_encoder_2/3 "
         "and tokenizer_2/3 are other families'"),
        (m.t5 != T5Config(), f"model.t5 is SD3's and Flux.1's T5; {display_name}'s text encoder is an LLM whose "
                             "length is model.llm.max_length"),
        (m.text_encoder.max_length is not None,
         f"model.text_encoder.max_length: {display_name}'s LLM length is model.llm.max_length"),
    ]


def patch_grid_refusal(cfg: TrainConfig, display_name: str) -> tuple[bool, str]:
    """(refused, message): a family that patches the 8x-downsampled latents 2x2 (Flux, FLUX.2, Qwen-Image)
    takes sizes on a 16 px grid only."""
    d = cfg.dataset.params
    return (bool(d.resolution % 16 or (d.aspect_buckets and d.bucket_step % 16)),
            f"{display_name} patches the 8x-downsampled latents 2x2: dataset.params.resolution ({d.resolution}) "
            f"and, with aspect buckets, dataset.params.bucket_step ({d.bucket_step}) must be multiples of 16")


class FlowFamily(PipelineFamily):
    """A flow-matching transformer family (see the module)."""

    net_name = "transformer"
    shard_units = staticmethod(shard_units)
    adapter_presets = ADAPTER_PRESETS
    display_name = ""  # how messages name the family ("SD3", "Flux")
    # the forward's argument names of the packed noisy latents and the timestep (Z-Image's: x, t)
    forward_names = ("hidden_states", "timestep")

    @classmethod
    def refusals(cls, cfg: TrainConfig) -> list[tuple[bool, str]]:
        """The family's own (refused, message) checks of ``cfg``, before the transformer families' common ones
        (e.g. :func:`llm_text_refusals`, :func:`patch_grid_refusal`)."""
        return []

    @classmethod
    def validate(cls, cfg: TrainConfig) -> None:
        for refused, message in cls.refusals(cfg):
            if refused:
                raise ConfigError(message)
        validate_common(cfg, cls.name, net_class=cls.transformer_class)

    # diffusers' SD3 and Flux pipelines refuse a longer max_sequence_length (their check_inputs); T5's own
    # tokenizer stops at 512 too
    t5_limit = 512

    @classmethod
    def text_limits(cls, cfg: TrainConfig) -> dict[str, tuple[int, str]]:
        return {"model.t5.max_length": (cls.t5_limit, f"{cls.pipeline_classes[0]}'s max_sequence_length limit")}

    @classmethod
    def transformer_class(cls) -> type:
        """The diffusers class of the trained transformer (``net_class``), imported when asked."""
        import diffusers

        return getattr(diffusers, cls.net_class)

    @classmethod
    def sample_activation_elements(cls, conf: dict, sample: activations.SampleShape, checkpointing: bool) -> float:
        """The latents' patches (16 channels: the flow families' VAE; packed or patchified alike) and the text
        tokens through the transformer's blocks (``memory.activations``)."""
        return activations.transformer_sample_elements(conf, sample, checkpointing, latent_channels=16)

    @classmethod
    def net_defaults(cls) -> dict:
        params = inspect.signature(cls.transformer_class().__init__).parameters.values()
        return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def compile_units(self, net: torch.nn.Module) -> list[torch.nn.Module]:
        """``model.compile``: each transformer block on its own (one graph per block shape)."""
        return transformer_blocks(net)

    @property
    @abc.abstractmethod
    def max_sequence_length(self) -> int:
        """The trained text length of the pipeline's long encoder (its ``max_sequence_length`` argument)."""

    def inference_pipeline(self, net: torch.nn.Module):
        """The pipeline as sample grids, eval images and ``scripts/generate_examples.py`` call it: padding the
        text to the trained length (the pipelines' own defaults are 256 for SD3 and 512 for Flux)."""
        return TrainedLength(self.pipeline(net), self.max_sequence_length)

    # -- conditioning -------------------------------------------------------------------------------
    def condition(self, batch: dict, validation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(states [B, L, D], pooled [B, P]) of the batch on the device, float32: stored in latent shards,
        else encoded. ``validation``: the encoders as modules, else as the trainer wrapped them."""
        if TEXT_STATES_KEY in batch:
            return self.stored_condition(batch)
        return self.encode_condition(batch, validation)

    def stored_condition(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The text conditioning latent shards store (``--text-embeddings``)."""
        if POOLED_KEY not in batch:
            raise ValueError(f"the batch has stored text embeddings but no {POOLED_KEY}: these latent shards were "
                             f"not made for {self.display_name} (scripts/precompute_latents.py with the run's "
                             "pipeline and --text-embeddings)")
        return (batch[TEXT_STATES_KEY].to(self.device, non_blocking=True).float(),
                batch[POOLED_KEY].to(self.device, non_blocking=True).float())

    @abc.abstractmethod
    def encode_condition(self, batch: dict, validation: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(states, pooled) from the batch's token ids (``input_ids``, ``input_ids_2``, ...)."""

    # -- the transformer's forward ------------------------------------------------------------------
    def transformer_inputs(self, latents: torch.Tensor, states: torch.Tensor, pooled: torch.Tensor | None) -> dict:
        """The forward's inputs besides the noisy latents and the timestep, for a batch of ``latents``."""
        return dict(encoder_hidden_states=states, pooled_projections=pooled)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def unpack(self, out: torch.Tensor, latents_shape: torch.Size) -> torch.Tensor:
        return out

    def transformer_timestep(self, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps

    def image_seq_len(self, latents: torch.Tensor) -> int | None:
        return None

    def join_references(self, latents: torch.Tensor, refs: list[torch.Tensor],
                        inputs: dict) -> tuple[torch.Tensor, dict]:
        """The references' tokens and the forward's inputs with their positions (the module's contract); a
        text-to-image family takes none (``configure.check_references`` refuses them at load)."""
        raise NotImplementedError(f"{self.display_name or self.name} takes no reference images "
                                  "(dataset.params.references must be 0)")

    # -- the step -----------------------------------------------------------------------------------
    def encode(self, pixels: torch.Tensor, mean: bool | None = None, sample_seeds=None) -> torch.Tensor:
        mean = self.cfg.model.vae.latent_sampling == "mean" if mean is None else mean
        shift, scale = vae_encoding.factors(self.models.vae)
        return vae_encoding.encode(self.models.vae, pixels, scale, shift, mean=mean, sample_seeds=sample_seeds)

    def loss(self, model, batch, autocast, fixed=None, validation=False) -> LossOut:
        """Flow matching; ``fixed`` noise and timesteps (sigma x 1000) are used as given (validation). The
        interpolation and the loss are float32 (``flow_matching.flow_loss``); the encoders and the
        transformer run under ``autocast``."""
        latents = self.latents(batch)
        fixed = dict(fixed or {})
        sigmas = fixed["timesteps"].float() / float(self.num_timesteps) if "timesteps" in fixed else None
        with autocast:
            states, pooled = self.condition(batch, validation)
        inputs = self.transformer_inputs(latents, states, pooled)
        refs = self.reference_latents(batch)  # edit training: [] for text-to-image batches
        ref_tokens = None
        if refs:
            ref_tokens, inputs = self.join_references(latents, refs, inputs)
        elif self.reference_images[0] > 0:  # an edit family would train as text-to-image, silently
            raise ValueError(f"{self.display_name} edits reference images, and this batch has none (no "
                             "reference_values or reference_latents): the data was read without "
                             "dataset.params.references")

        def predict(noisy, timesteps):
            with autocast:
                image, time = self.forward_names
                tokens = target = self.pack(noisy)
                if ref_tokens is not None:  # the references after the target's tokens; the loss on the target's
                    tokens = torch.cat([target, ref_tokens.to(target.dtype)], dim=1)
                out = model(**{image: tokens, time: self.transformer_timestep(timesteps)},
                            return_dict=False, **inputs)[0]
            return self.unpack(out if ref_tokens is None else out[:, :target.shape[1]], latents.shape)

        loss, per_sample, timesteps = flow_matching.flow_loss(
            predict, latents, self.cfg.flow_matching, self.models.noise_scheduler,
            sample_seeds=batch.get("sample_seeds"), noise=fixed.get("noise"), sigmas=sigmas,
            image_seq_len=self.image_seq_len(latents), loss_weight=batch.get("loss_weight"))
        return LossOut(loss, per_sample, timesteps, None)

    def validation_timesteps(self, n: int) -> torch.Tensor:
        """Timesteps (sigma x 1000) spread over the training sigma table."""
        table = flow_matching.sigma_table(self.cfg.flow_matching, self.models.noise_scheduler)
        index = torch.linspace(0, len(table) - 1, n).round().long()
        return table[index] * float(self.num_timesteps)

    # -- FLOPs --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def flops_inputs(self, config, h: int, w: int) -> dict:
        """The transformer's forward inputs for one image of an ``h`` x ``w`` latent grid, on the meta device
        (``config``: the transformer's)."""

    @abc.abstractmethod
    def text_encoder_runs(self) -> list[tuple[torch.nn.Module, int, int]]:
        """(encoder, tokens, passes) of each text encoder a step runs (passes: 1 frozen, 3 trained)."""

    def step_flops(self) -> StepFlops:
        """Counted once on the meta device: 3 x one transformer forward over one image's tokens and the text
        tokens (joint attention); hardware FLOPs add the VAE, and the text encoders when the steps run them on the
        device (not stored, not kept on the CPU)."""
        m, cfg = self.models, self.cfg
        res = cfg.dataset.params.resolution
        h, w = latent_size_of(m.vae, res)
        latent = is_latent_data(cfg)
        text = 0 if not self.step_encodes_text_on_device else sum(k * encoder_flops(e, n) for e, n, k in self.text_encoder_runs())
        return count_net_flops(self.net, lambda meta: self.flops_inputs(meta.config, h, w),
                               cfg.model.gradient_checkpointing,
                               vae_encode=0 if latent else vae_encode_flops(m.vae, res), text_encode=text)
