"""Qwen-Image-Edit: ``QwenImageEditPipeline``, Qwen-Image's transformer, VAE and Qwen2.5-VL trained to edit: the
target is denoised beside the reference image's latents, conditioned on the instruction read with the reference.

As ``QwenImageEditPipeline`` conditions and predicts (``qwen_image_edit_parts``):

* the text: each instruction in the edit template (64 system-prompt tokens dropped), the reference through
  Qwen2.5-VL's processor and vision tower (its image tokens are conditioning), ``hidden_states[-1]``, the real
  tokens first with the mask, as ``encode_prompt(prompt, image=...)`` returns them;
* the image: the reference's normalised posterior (``_encode_vae_image``) packed 2x2 after the noisy target's
  tokens, ``img_shapes`` [target, reference], the loss on the target's tokens only (``noise_pred[:, :n]``);
  the timestep is sigma and the dynamic shift reads the target's token count, as the pipeline's.

What training does where the pipeline resizes: the pipeline brings the reference to ~1 Mpx of its aspect ratio
(``calculate_dimensions(1024 * 1024, ratio)``) and feeds that one image to the VAE and to the VL encoder, with the
output at the same size. Training keeps that invariant at the run's resolution: the reference as the data
loader aligns it to the target (``dataset.params.reference_crop``), at the target's size, for both the VAE and the
VL encoder (whose processor puts it on its 28 px grid within its min / max pixels). At 1024 px this is the
pipeline's own sizing; at smaller sizes the model learns the pairs it is given instead of an upscaled reference.
Samples do the same (:class:`EditSampling`: the reference at the sample's size, which also keeps CPU grids small).

Text in latent shards (``qwen_image_edit_text``): the text states depend on the reference's pixels, which latent
shards do not hold, so ``scripts/precompute_latents.py --references N --text-embeddings`` stores each sample's
states read with its references (and its empty instruction's, for caption dropout), and a latent-shard run trains
from those (``dataset.type: latents`` with ``dataset.params.text_embeddings: true``, required: the step cannot
encode the text without the pixels; the text encoder cannot train there). ``model.llm.max_length`` counts the tokens
after the system prompt before the image's expansion (the vision markers, the instruction and the template's
end); the pipeline itself does not cut, so instructions longer than it are cut in training only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError
from ..config.dataset import is_latent_type
from ..config.schema import TrainConfig
from ..data.buckets import target_sizes
from ..data.latent_checks import StoredText
from ..data.latents import TEXT_STATES_KEY
from ..outputs.export import unwrap
from . import qwen_image_edit_parts as eparts
from . import qwen_image_edit_text as etext
from . import qwen_image_parts as parts
from . import reference_models as references
from .components import llm_text
from .components.text import TextEncoding
from .qwen_image import QWEN_IMAGE_SCHEDULER, GuidedByTrueCFG, QwenImage, QwenImageModels, load_prompt_tokenizer
from .tiny import save, tokenizer_folder

# QwenImageEditPipeline._get_qwen_prompt_embeds: the edit template, the last layer, 64 prefix tokens dropped, the
# real tokens with a mask; 512 tokens by default (its __call__'s max_sequence_length), 1024 at most (check_inputs).
EDIT_TEXT = llm_text.LLMTextSettings(layers=(-1,), max_length=512, limit=1024, template=eparts.EDIT_TEMPLATE,
                                     drop_prefix=eparts.EDIT_PREFIX_TOKENS, masked=True)
PLUS_TEXT = dataclasses.replace(EDIT_TEXT, template=eparts.plus_template(1))  # QwenImageEditPlusPipeline's, one picture
NEEDS_STORED_TEXT = ("reads the instruction together with the reference images (Qwen2.5-VL's vision tower), and "
                     "latent shards hold the references' latents, not their pixels")


@dataclass
class QwenImageEditModels(QwenImageModels):
    processor: Any = None  # the pipeline's Qwen2VLProcessor: the reference's pixels and image tokens for Qwen2.5-VL


def load_processor(cfg) -> Any:
    """The pipeline's ``processor/`` (``Qwen2VLProcessor``), read from ``model.pretrained``."""
    from transformers import AutoProcessor

    from ..loading import load_component

    if cfg.pretrained is None:
        raise ConfigError("Qwen-Image-Edit reads its processor (processor/: the reference image's preprocessing for "
                          "Qwen2.5-VL) from model.pretrained: set it to a QwenImageEditPipeline folder or hub id")
    kw = dict(revision=cfg.revision) if cfg.revision else {}
    return load_component(AutoProcessor.from_pretrained, cfg.pretrained, "processor", "model.pretrained", **kw)


EDIT_MODULE, PLUS_MODULE = "pipeline_qwenimage_edit", "pipeline_qwenimage_edit_plus"


@contextlib.contextmanager
def reference_size(width: int, height: int, module: str = EDIT_MODULE):
    """The edit pipelines size the references for the VAE (and Edit's VL encoder) as ``calculate_dimensions(1024 *
    1024, ratio)`` (~1 Mpx): within this block, a reference of the output's aspect ratio is brought to the output's
    size (training's aligned pair) and any other to the output's area at its own ratio; Plus's VL images keep their
    ``CONDITION_IMAGE_SIZE``. ``module``: the pipeline's module in ``diffusers.pipelines.qwenimage``, whose
    ``calculate_dimensions`` its ``__call__`` looks up."""
    import importlib

    mod = importlib.import_module(f"diffusers.pipelines.qwenimage.{module}")
    original = mod.calculate_dimensions
    n = len(original(1024, 1.0))  # Edit's returns (w, h, None), Plus's (w, h)
    vl_area = getattr(mod, "CONDITION_IMAGE_SIZE", None)

    def at_output_size(area, ratio):
        if area == vl_area:
            return original(area, ratio)
        if abs(ratio - width / height) < 1e-6:
            return (width, height, None)[:n]
        return original(width * height, ratio)

    mod.calculate_dimensions = at_output_size
    try:
        yield
    finally:
        mod.calculate_dimensions = original


class EditSampling(GuidedByTrueCFG):
    """The edit pipeline as sample grids and eval images call it: :class:`GuidedByTrueCFG` (guidance as
    ``true_cfg_scale``, the trained text length), and with ``height`` and ``width`` given, the references sized as
    in training (:func:`reference_size`) instead of ~1 Mpx: what the model learned, and CPU grids stay small."""

    module = EDIT_MODULE

    def __call__(self, *args, **kwargs):
        prompt, image = kwargs.get("prompt"), kwargs.get("image")
        if isinstance(prompt, list) and image is not None and not isinstance(image, list):
            kwargs["image"] = [image] * len(prompt)  # encode_prompt pairs prompt i with image i: one each
        return self.sized(*args, **kwargs)

    def sized(self, *args, **kwargs):
        height, width = kwargs.get("height"), kwargs.get("width")
        if not (height and width):
            return super().__call__(*args, **kwargs)
        with reference_size(int(width), int(height), self.module):
            return super().__call__(*args, **kwargs)


class PlusSampling(EditSampling):
    """:class:`EditSampling` for ``QwenImageEditPlusPipeline``, which takes one prompt per call (its ``image`` list
    is that prompt's references): a list of prompts is generated prompt by prompt, each with its generator."""

    module = PLUS_MODULE

    def __call__(self, *args, **kwargs):
        prompt = kwargs.get("prompt")
        if not isinstance(prompt, list) or len(prompt) == 1:
            return self.sized(*args, **{**kwargs, "prompt": prompt[0] if isinstance(prompt, list) else prompt})
        gens = kwargs.get("generator")
        outs = [self.sized(*args, **{**kwargs, "prompt": p, "generator": gens[i] if isinstance(gens, list) else gens})
                for i, p in enumerate(prompt)]
        images = [im for out in outs for im in out.images]
        if kwargs.get("output_type") == "np":
            import numpy as np

            images = np.stack(images)
        return type(outs[0])(images=images)


class QwenImageEdit(QwenImage):
    name = text_tag = "qwen_image_edit"
    display_name = "Qwen-Image-Edit"
    pipeline_classes = ("QwenImageEditPipeline",)
    card_tags = ("qwen-image-edit", "qwen-image-diffusers", "image-editing")
    text_settings = EDIT_TEXT
    reference_images = (1, 1)
    text_reads_references = True

    def build_models(self) -> QwenImageEditModels:
        m = super().build_models()
        fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.init}
        return QwenImageEditModels(**fields, processor=load_processor(self.cfg.model))

    @classmethod
    def refusals(cls, cfg: TrainConfig) -> list[tuple[bool, str]]:
        latent, stored = is_latent_type(cfg.dataset.type), bool(cfg.dataset.params.text_embeddings)
        trains_text = bool(cfg.model.text_encoder.train) or bool(cfg.model.adapter.text_encoders.train)
        redo = (f"scripts/precompute_latents.py --references {cfg.dataset.params.references or 1} --text-embeddings "
                "stores each sample's text read with its references")
        return [*super().refusals(cfg),
                (latent and trains_text,
                 f"dataset.type={cfg.dataset.type} with a trained text encoder (model.text_encoder.train or "
                 f"model.adapter.text_encoders.train): {cls.display_name} {NEEDS_STORED_TEXT}, so its text encoder "
                 "trains from image shards (webdataset, parquet, csv, folder) only"),
                (latent and not stored,
                 f"dataset.type={cfg.dataset.type} needs dataset.params.text_embeddings: true for {cls.display_name}: "
                 f"it {NEEDS_STORED_TEXT}, so the step cannot encode the text; {redo}")]

    @classmethod
    def sample_activation_elements(cls, conf: dict, sample, checkpointing: bool) -> float:
        # the references' latent tokens go through the blocks beside the target's (as many again each: counted by
        # memory.activations from sample.references), and their VL image tokens lengthen the text
        text = sample.text_tokens + sample.references * cls.vl_tokens(int(sample.resolution), int(sample.resolution))
        return super().sample_activation_elements(conf, dataclasses.replace(sample, text_tokens=text), checkpointing)

    # -- the text, read with the reference image ----------------------------------------------------
    vl_rule = etext.TARGET_SIZE  # how the VL encoder reads a reference (latents_info.json's text_vl_images)

    def condition(self, batch: dict, validation: bool = False):
        """(the real tokens first [B, n, D] float32, their mask [B, n] or None): stored in latent shards (read with
        the references at precompute time), else the instruction and the reference images (``reference_values``)
        through Qwen2.5-VL, as ``encode_prompt(prompt, image=...)``."""
        if TEXT_STATES_KEY in batch:
            return super().condition(batch, validation)  # Qwen-Image's: the stored states, the mask their last channel
        refs = batch.get("reference_values")
        if refs is None:
            raise ValueError(f"{self.display_name} reads each instruction with its reference images, and the batch has "
                             "no reference_values (nor stored text states): set dataset.params.references and give "
                             "each sample its references")
        m = self.models
        states, mask = etext.encode_with_references(m.text_encoder, m.processor, m.tokenizer.pad_token_id,
                                                    batch["input_ids"], refs, self.vl_rule,
                                                    parts.vae_factor(m.vae.vae), self.text_settings.drop_prefix)
        return parts.front_padded(states.to(self.device), mask.to(self.device))

    def vl_images(self, refs: torch.Tensor) -> list:
        """The images the VL encoder reads, prompt by prompt (the family's :data:`vl_rule`)."""
        return etext.VL_RULES[self.vl_rule](refs, parts.vae_factor(self.models.vae.vae))

    def encode_condition(self, batch: dict, validation: bool):
        return self.condition({k: v for k, v in batch.items() if k != TEXT_STATES_KEY}, validation)

    @classmethod
    def text_encoding(cls, pipeline: str, device: torch.device, clip_skip: int = 0, max_length: int | None = None,
                      references: int = 0, sizes=()) -> TextEncoding:
        """The states latent shards store: each caption read with its sample's ``references`` images
        (:class:`~.qwen_image_edit_text.EditTextEncoding`), padded to the longest ``sizes`` ((width, height) of the
        targets) give."""
        from diffusers import AutoencoderKLQwenImage

        if not references:
            raise ValueError(f"{cls.display_name} {NEEDS_STORED_TEXT}: add --references "
                             f"{cls.reference_images[0]} so the text is read with each sample's references")
        if clip_skip:
            raise ValueError(f"{cls.display_name} conditions on Qwen2.5-VL's last hidden states: clip skip does not "
                             "apply")
        settings = cls.text_settings if cls.reference_images[1] == 1 else dataclasses.replace(
            cls.text_settings, template=eparts.plus_template(references))
        length = llm_text.check_length(max_length, settings, "--max-length", cls.pipeline_classes[0])
        tokenizer = load_prompt_tokenizer(pipeline, {}, "the pipeline's tokenizer/", length, settings)
        encoder = llm_text.load_llm(pipeline, "text_encoder", "the pipeline's text_encoder/", device)
        processor = load_processor(types.SimpleNamespace(pretrained=pipeline, revision=None))
        factor = 2 ** len(AutoencoderKLQwenImage.load_config(pipeline, subfolder="vae")["temperal_downsample"])
        stored = etext.stored_length(processor, cls.vl_rule, factor, references, length, sizes)
        return etext.EditTextEncoding(cls.text_tag, tokenizer, encoder, processor, settings, cls.vl_rule, references,
                                      stored, factor)

    def stored_text(self) -> StoredText:
        """The shards' text: Qwen-Image's width, the length the run's sizes give, read with the run's references
        by the family's rule."""
        p = self.cfg.dataset.params
        sizes = target_sizes(int(p.resolution), bool(p.aspect_buckets), int(p.bucket_step),
                                   float(p.max_aspect_ratio))
        length = etext.stored_length(self.models.processor, self.vl_rule, parts.vae_factor(self.models.vae.vae),
                                     self.reference_count, self.max_sequence_length, sizes)
        return dataclasses.replace(super().stored_text(), length=length, references=self.reference_count,
                                   vl_images=self.vl_rule)

    # -- the step: the reference's tokens after the target's (FlowFamily.loss calls the hook) ---------------
    def join_references(self, latents: torch.Tensor, refs: list[torch.Tensor],
                        inputs: dict) -> tuple[torch.Tensor, dict]:
        """Each reference packed 2x2 as the target, in order; ``img_shapes`` the target's grid then each
        reference's (``prepare_latents`` and ``__call__``)."""
        fewest, most = self.reference_images
        if not fewest <= len(refs) <= most:
            raise ValueError(f"{self.display_name} takes {fewest} to {most} reference images per sample, the batch has "
                             f"{len(refs)} (dataset.params.references)")
        return eparts.reference_tokens(refs), dict(inputs, img_shapes=eparts.joint_img_shapes(latents, refs))

    def validation_batch(self, batch, generator, index) -> dict:
        """The base's fixed latents (the reference's posterior mean too), keeping the reference's pixels for the
        VL encoder."""
        b = super().validation_batch(batch, generator, index)
        if "reference_values" in batch:
            b["reference_values"] = batch["reference_values"]
        return b

    def flops_inputs(self, config, h: int, w: int) -> dict:
        """One image's forward: the target's and the reference's tokens, the text with the VL image's tokens."""
        n, factor, k = (h // 2) * (w // 2), parts.vae_factor(self.models.vae.vae), self.reference_count
        length = self.max_sequence_length + k * self.vl_tokens(h * factor, w * factor)  # + the VL images' tokens
        return dict(hidden_states=torch.empty(1, (1 + k) * n, config.in_channels, device="meta"),
                    encoder_hidden_states=torch.empty(1, length, config.joint_attention_dim, device="meta"),
                    timestep=torch.ones(1, device="meta"), img_shapes=[[(1, h // 2, w // 2)] * (1 + k)])

    @property
    def reference_count(self) -> int:
        return int(self.cfg.dataset.params.references)

    @classmethod
    def vl_tokens(cls, height: int, width: int) -> int:
        """About the VL tokens of a reference at the target's size (28 px per token: 14 px patches merged 2x2)."""
        return max(height // 28, 2) * max(width // 28, 2)

    def step_flops(self):
        """Qwen-Image's, with the VAE encoding the references too."""
        flops = super().step_flops()
        return dataclasses.replace(flops, vae_encode=flops.vae_encode * (1 + self.reference_count))

    # -- artifacts ---------------------------------------------------------------------------------
    def pipeline(self, transformer: torch.nn.Module, for_export: bool = False):
        """The family's edit pipeline of the run's components with ``transformer``; ``for_export``: the frozen parts
        in fp32 as loaded."""
        import copy

        import diffusers

        m = self.models
        vae, encoder = (m.full_precision(n) if for_export else getattr(m, n) for n in ("vae", "text_encoder"))
        pipeline_class = getattr(diffusers, self.pipeline_classes[0])
        return pipeline_class(scheduler=copy.deepcopy(m.inference_scheduler), tokenizer=m.tokenizer.tokenizer,
                              processor=m.processor, transformer=unwrap(transformer), vae=vae.vae, text_encoder=encoder)

    def inference_pipeline(self, net: torch.nn.Module):
        return self.sampling_class(self.pipeline(net), self.max_sequence_length)

    sampling_class = EditSampling

    @classmethod
    def reference_sizing(cls, width: int, height: int):
        """A block within which a plain edit pipeline sizes references as this family's samples do (tests and
        scripts that compare a loaded pipeline with the run's): :func:`reference_size`."""
        return reference_size(width, height, cls.sampling_class.module)

    @classmethod
    def reference_call(cls, images: list) -> dict:
        """The pipeline's keyword arguments for one prompt's reference (it takes one image)."""
        if len(images) != 1:
            raise ValueError(f"Qwen-Image-Edit takes one reference image per prompt, got {len(images)}")
        return {"image": images[0]}

    @classmethod
    def make_tiny_pipeline(cls, out: Path, scaling_factor: float | None = None) -> Path:
        """The family's edit pipeline: Qwen-Image's tiny VAE and transformer, a tiny Qwen2.5-VL whose vision tower
        reads the reference, the offline ``Qwen2VLProcessor`` (the edit template's system prompt in 64 tokens)."""
        import diffusers
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

        if scaling_factor is not None:
            raise ValueError(f"{cls.display_name}'s VAE normalises latents per channel (latents_mean / latents_std): "
                             "it has no scaling factor")
        scratch = tokenizer_folder(out, "processor")
        processor = eparts.build_edit_processor(scratch)
        pipeline_class = getattr(diffusers, cls.pipeline_classes[0])
        pipe = pipeline_class(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
                              vae=AutoencoderKLQwenImage(**parts.TINY_QWEN_VAE),
                              text_encoder=eparts.tiny_edit_qwen25_vl(processor.tokenizer),
                              tokenizer=processor.tokenizer, processor=processor,
                              transformer=QwenImageTransformer2DModel(**parts.TINY_QWEN_TRANSFORMER))
        return save(pipe, out, scratch)

    @classmethod
    def reference_models(cls) -> dict[str, references.ReferenceModel]:
        """None of its own: Qwen-Image-Edit's weights are shaped as Qwen-Image's 20B (the memory table's Qwen-Image
        row), its step carrying the references' tokens too."""
        return {}


class QwenImageEditPlus(QwenImageEdit):
    """Qwen-Image-Edit-2509 / 2511 (``QwenImageEditPlusPipeline``): one to three references per sample, named in the
    text ("Picture i: <image>" before the instruction, the same 64-token system prompt), each given to the VL
    encoder at ~384^2 of its aspect ratio (the pipeline's ``CONDITION_IMAGE_SIZE``, whatever the output's size) and
    to the VAE at the target's size (as Qwen-Image-Edit's), their tokens after the target's in order, ``img_shapes``
    the target's then each reference's."""

    name = text_tag = "qwen_image_edit_plus"
    display_name = "Qwen-Image-Edit-Plus"
    pipeline_classes = ("QwenImageEditPlusPipeline",)
    card_tags = ("qwen-image-edit-plus", "qwen-image-diffusers", "image-editing")
    reference_images = (1, 3)
    sampling_class = PlusSampling
    text_settings = PLUS_TEXT

    def __init__(self, cfg: TrainConfig, device: torch.device, seed: int, is_main: bool):
        # the text names each reference: the template holds as many pictures as the run's samples have references
        pictures = eparts.plus_template(int(cfg.dataset.params.references))
        self.text_settings = dataclasses.replace(PLUS_TEXT, template=pictures)
        super().__init__(cfg, device, seed, is_main)

    vl_rule = etext.CONDITION_SIZE  # each reference at ~384^2 of its aspect ratio, Lanczos, as the pipeline

    @classmethod
    def vl_tokens(cls, height: int, width: int) -> int:
        return (384 // 28) ** 2  # every VL image is ~384^2, whatever the target's size

    @classmethod
    def reference_call(cls, images: list) -> dict:
        """The pipeline's keyword arguments for one prompt's references (a list of one to three images)."""
        if not 1 <= len(images) <= 3:
            raise ValueError(f"Qwen-Image-Edit-Plus takes one to three reference images per prompt, got {len(images)}")
        return {"image": list(images)}


__all__ = ["EDIT_TEXT", "PLUS_TEXT", "QwenImageEdit", "QwenImageEditPlus", "QwenImageEditModels", "EditSampling"]
