"""Config sections that belong to one family, registered with the schema (``register_fields`` at the end of
this module; torch-free: imports only ``sd_training.config``). The keys users type stay where they were:
``model.text_encoder_2.pretrained=...`` (SDXL's second encoder), ``vae_training.kl_weight=...`` (the
autoencoder stage)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..config.fields import ComponentConfig, ConfigError, f
from ..config.schema import register_fields

FLOW_FAMILIES = ("sd3", "flux", "zimage", "flux2_klein", "flux2_dev")  # the families trained with flow matching (families/flow_matching.py)


@dataclass
class VAEObjectiveConfig:
    """The ``vae_training`` section (the autoencoder stage's loss); checked by ``families.autoencoder_loss``."""

    reconstruction: str = f("l1", "pixel reconstruction loss, mean over pixel values in [-1, 1] units", choices=("l1", "l2"))
    kl_weight: float = f(1e-6, "weight of KL(posterior || N(0, I)) summed over the latent, per 3*H*W pixel values (LDM KL-f8: 1e-6)")
    perceptual_weight: float = f(0.0, "weight of the VGG16 perceptual distance, added per image (0: off; LDM uses 1.0 with LPIPS)")
    perceptual_weights: Optional[str] = f(None, "local path of a torchvision VGG16 state_dict (.pth/.pt/.safetensors) for the perceptual loss")


@dataclass
class FlowMatchingConfig:
    """The ``flow_matching`` section (rectified flow: x_t = (1 - t) x_0 + t noise, target noise - x_0), read by
    the sd3 and flux families; checked and computed by ``families.flow_matching``."""

    timestep_sampling: str = f("logit_normal", "density of t in (0, 1): uniform, logit_normal (SD3) or mode (heavy tails at the ends)",
                               choices=("uniform", "logit_normal", "mode"))
    logit_mean: float = f(0.0, "logit_normal: mean of the normal in logit(t) units", ge=None)
    logit_std: float = f(1.0, "logit_normal: std of the normal in logit(t) units", gt=0)
    mode_scale: float = f(1.29, "mode: the scale s of the mode density (SD3 paper; 0: uniform)", ge=None)
    shift: Optional[float] = f(None, "static time shift t' = s t / (1 + (s - 1) t) (None: the training scheduler's shift, SD3 3.0)", gt=0)
    resolution_shift: Optional[bool] = f(None, "Flux's shift that grows with the image's token count (None: the scheduler's use_dynamic_shifting)")
    weighting: str = f("none", "per-sample loss weight: none, sigma_sqrt or cosmap (SD3 paper)", choices=("none", "sigma_sqrt", "cosmap"))


@dataclass
class TransformerConfig:
    """``model.transformer``: the trained diffusion transformer of the sd3 and flux families."""

    pretrained: Optional[str] = f(None, "sd3/flux: pipeline root or transformer folder (None: model.pretrained, else from scratch)")
    params: Dict[str, Any] = f({}, "sd3/flux: constructor arguments of the family's transformer class for from-scratch training")


@dataclass
class T5Config:
    """``model.t5``: the T5 text encoder of the sd3 and flux families."""

    use: bool = f(True, "sd3: False leaves T5 out (its states are zeros, as a pipeline without text_encoder_3); flux needs it")
    max_length: Optional[int] = f(None, "T5 tokens per caption (None: the pipeline's default, sd3 256, flux 512)", ge=1)
    dropout: float = f(0.0, "sd3: probability that a training sample's T5 states are zeros (the SD3 paper drops T5 part of the time)",
                       ge=0, le=1)


@dataclass
class LLMConfig:
    """``model.llm``: the decoder-only LLM text encoder of the LLM families (zimage; its model and dtype are
    model.text_encoder's, as the pipeline's text_encoder/)."""

    max_length: Optional[int] = f(None, "zimage: LLM tokens per caption, chat template included (None: the pipeline's "
                                  "default max_sequence_length, 512)", ge=1)


ADAPTER_TYPES = ("lora", "lokr", "loha")  # peft's LoraConfig, LoKrConfig, LoHaConfig (sd_training.adapters)
ADAPTER_INITS = ("default", "gaussian")  # peft's init_lora_weights: True (Kaiming A, zero B) or "gaussian"
# model.adapter.base_quantization (families/components/quantized_base.py): named for what the base stores,
# the library in the help: nf4 / int8 bitsandbytes, int8_weight / fp8_weight torchao weight-only, a GGUF file
QUANTIZATIONS = ("none", "nf4", "int8", "int8_weight", "fp8_weight", "gguf")


@dataclass
class TextEncoderAdapterConfig:
    """``model.adapter.text_encoders``: LoRA on the family's CLIP text encoder(s) too (never T5)."""

    train: bool = f(False, "also train a LoRA on the text encoder(s) (sd: CLIP; sdxl/sd3: both CLIPs; flux: none)")
    rank: Optional[int] = f(None, "LoRA rank of the text-encoder adapter (None: model.adapter.rank)", ge=1)
    alpha: Optional[float] = f(None, "LoRA alpha of the text-encoder adapter (None: its rank, a scale of 1)", gt=0)
    learning_rate: Optional[float] = f(None, "peak LR of the text-encoder adapter (None: model.adapter.learning_rate)", gt=0)
    targets: str = f("attention", "preset: attention (q/k/v/out projections) or all_linear (+ the MLPs)",
                     choices=("attention", "all_linear"))


@dataclass
class AdapterConfig:
    """``model.adapter``: train a peft adapter on the family's net instead of all its weights (sd_training.adapters).
    The base weights stay frozen; exports are diffusers LoRA folders (``pipe.load_lora_weights(folder)``)."""

    type: Optional[str] = f(None, "unset: a full fine-tune; lora (DoRA with use_dora), lokr (LyCORIS LoKr: a Kronecker "
                            "product) or loha (LyCORIS LoHa: a Hadamard product of two low-rank updates) on the targets",
                            choices=ADAPTER_TYPES)
    rank: int = f(16, "rank r (LoRA: the update B A has r columns; LoKr: of the factors it decomposes, a rank of at "
                  "least half a factor's side keeps that factor whole; LoHa: of each of its two low-rank terms)", ge=1)
    alpha: Optional[float] = f(None, "alpha: the update is scaled by alpha / rank (None: rank, a scale of 1)", gt=0)
    dropout: float = f(0.0, "dropout probability on the LoRA branch's input", ge=0, le=1)
    use_dora: bool = f(False, "DoRA: a learned magnitude per output channel beside the LoRA direction")
    init: str = f("default", "init of the LoRA matrices: default (Kaiming A, zero B) or gaussian (B still zero)",
                  choices=ADAPTER_INITS)
    targets: str = f("attention", "family preset of the adapted layers: attention, attention_ffn or all_linear "
                     "(UNets: + the convolutions); model.adapter.target_modules / target_regex replace it",
                     choices=("attention", "attention_ffn", "all_linear"))
    target_modules: List[str] = f([], "explicit layer names (a name or its dotted suffix, e.g. to_q, attn1.to_k) "
                                  "instead of the preset")
    target_regex: Optional[str] = f(None, "a regular expression the full layer names must match, instead of the preset "
                                    "(Python re syntax; all names matched within 2 s, else refused)")
    learning_rate: Optional[float] = f(None, "peak LR of the adapter (None: optimizer.params.learning_rate)", gt=0)
    weight_decay: Optional[float] = f(None, "weight decay of the adapter (None: optimizer.params.weight_decay)")
    text_encoders: TextEncoderAdapterConfig = f(TextEncoderAdapterConfig, "LoRA on the text encoder(s)")
    init_from: Optional[str] = f(None, "continue from a diffusers-format LoRA: a folder holding "
                                 "pytorch_lora_weights.safetensors or the file (same targets and rank)")
    lokr_factor: int = f(-1, "lokr: the Kronecker factorisation's factor (LyCORIS' factor, ai-toolkit's lokr_factor): "
                         "each side n splits as (f, n / f) where f divides n, else the most square split with a first part "
                         "<= f; -1: the most square split", ge=-1)
    decompose_both: bool = f(False, "lokr: decompose the left (smaller) Kronecker factor into rank-r matrices too "
                             "(LyCORIS' decompose_both); the right one is decomposed whenever rank < half its side")
    export_merged: bool = f(False, "exports also write the full pipeline with the adapter merged, in <export>/merged")
    export_kohya: bool = f(False, "exports also write a copy for ComfyUI / A1111: SD, SDXL: "
                           "pytorch_lora_weights_kohya.safetensors (kohya key names, via diffusers' "
                           "convert_state_dict_to_kohya); Z-Image, FLUX.2, Qwen-Image: "
                           "pytorch_lora_weights_comfyui.safetensors (the original checkpoint's layer names, "
                           "diffusion_model.<layer>, as ComfyUI loads them); SD3, Flux: refused (ComfyUI loads the "
                           "diffusers file); lokr / loha: LyCORIS' keys under the names ComfyUI maps for the family "
                           "(SD3, Flux: lycoris_<layer>)")

    base_quantization: str = f("none", "the frozen base's block Linear layers stored quantised under the adapter: "
                               "nf4 / int8 (bitsandbytes 4-bit NormalFloat / LLM.int8), int8_weight / fp8_weight "
                               "(torchao weight-only), gguf (the file in model.adapter.base_gguf); none: the "
                               "training precision", choices=QUANTIZATIONS)
    base_gguf: Optional[str] = f(None, "model.adapter.base_quantization=gguf: a GGUF file of the family's net "
                                 "(transformer / UNet) to train on, read with diffusers' from_single_file")

    @property
    def enabled(self) -> bool:
        return self.type is not None


@dataclass
class FamilyModelFields:
    """Fields of the ``model`` section that one family reads (registered below)."""

    text_encoder_2: ComponentConfig = f(ComponentConfig, "sdxl: the second text encoder (OpenCLIP bigG, CLIPTextModelWithProjection)")
    tokenizer_2: ComponentConfig = f(ComponentConfig, "sdxl: the second tokenizer")
    text_encoder_3: ComponentConfig = f(ComponentConfig, "sd3: the T5 encoder (T5EncoderModel); flux's T5 is text_encoder_2")
    tokenizer_3: ComponentConfig = f(ComponentConfig, "sd3: the T5 tokenizer; flux's is tokenizer_2")
    transformer: TransformerConfig = f(TransformerConfig, "sd3/flux: the trained transformer")
    t5: T5Config = f(T5Config, "sd3/flux: the T5 encoder's use and length")
    llm: LLMConfig = f(LLMConfig, "zimage: the LLM text encoder's length")
    guidance_embed: float = f(3.5, "flux: the guidance value fed to a guidance-distilled transformer (guidance_embeds) in training", ge=0)
    adapter: AdapterConfig = f(AdapterConfig, "LoRA / DoRA / LoKr / LoHa adapters trained instead of the full net (every family)")


@dataclass
class FamilySections:
    """Top-level sections that one family (or training stage) reads (registered below)."""

    vae_training: VAEObjectiveConfig = f(VAEObjectiveConfig, "autoencoder-stage losses (model.train_target=vae)")
    flow_matching: FlowMatchingConfig = f(FlowMatchingConfig, "sd3/flux: the flow-matching objective")



register_fields(model=FamilyModelFields, sections=FamilySections)

def check(cfg) -> None:
    """Rules of these sections that need no family code (``cfg``: the whole ``TrainConfig``)."""
    if cfg.model.train_target != "vae" and cfg.vae_training != VAEObjectiveConfig():
        raise ConfigError("the 'vae_training' section applies to model.train_target=vae only")
    if cfg.model.compile_mode != "default" and not cfg.model.compile:
        raise ConfigError(f"'model.compile_mode' is {cfg.model.compile_mode} but model.compile is false: set "
                          "model.compile=true to compile, or remove model.compile_mode")
    check_adapter(cfg)


def check_adapter(cfg) -> None:
    """``model.adapter`` rules that need no model (the layer checks are ``sd_training.adapters``')."""
    a = cfg.model.adapter
    if not a.enabled:
        if a.base_quantization != "none" or a.base_gguf is not None:
            raise ConfigError("'model.adapter.base_quantization' quantises the frozen base under an adapter, but "
                              "model.adapter.type is not set: set model.adapter.type=lora (a full fine-tune trains "
                              "every weight, which cannot be stored quantised)")
        if a != AdapterConfig():
            raise ConfigError("'model.adapter.*' keys are set but model.adapter.type is not: set "
                              "model.adapter.type=lora to train an adapter, or remove the keys")
        return
    if cfg.model.train_target == "vae":
        raise ConfigError("'model.adapter.type' with model.train_target=vae: adapters train the diffusion net "
                          "(unet / transformer); remove model.adapter or set model.train_target=unet")
    check_adapter_type(a)  # first: a key the type does not take is named before what it would combine with
    if a.target_modules and a.target_regex is not None:
        raise ConfigError("'model.adapter.target_modules' and 'model.adapter.target_regex' both set: use one")
    if a.target_regex is not None:
        from ..config.patterns import compile_pattern  # imported when used: the schema's imports stay minimal

        compile_pattern(a.target_regex, "model.adapter.target_regex")  # the engine that matches it, bounded
    if cfg.model.text_encoder.train:
        raise ConfigError("'model.text_encoder.train' trains every text-encoder weight; with model.adapter use "
                          "model.adapter.text_encoders.train=true (a LoRA on the text encoder) instead")
    if a.text_encoders.train and a.export_merged:
        raise ConfigError("'model.adapter.export_merged' is not supported with model.adapter.text_encoders.train yet: "
                          "export the LoRA folder only (load it with pipe.load_lora_weights, then pipe.fuse_lora())")
    if a.text_encoders.train and cfg.dataset.params.text_embeddings:
        raise ConfigError("'model.adapter.text_encoders.train' with dataset.params.text_embeddings=true: the batches "
                          "carry stored text-encoder outputs, so a LoRA on the text encoder would get no gradient. "
                          "Set dataset.params.text_embeddings=false (encode captions online) or text_encoders.train=false")
    if a.text_encoders.train and cfg.model.text_encoder_placement in ("cpu", "offload"):
        raise ConfigError(f"'model.adapter.text_encoders.train' trains a LoRA on the text encoders on the device, but "
                          f"model.text_encoder_placement={cfg.model.text_encoder_placement} keeps them off it: use "
                          "device (or auto)")
    if a.export_kohya and a.use_dora:
        raise ConfigError("'model.adapter.export_kohya' with model.adapter.use_dora: the kohya file's DoRA scale is "
                          "not written in a layout we have checked; export the diffusers LoRA folder only")
    check_base_quantization(cfg)
    if a.text_encoders != TextEncoderAdapterConfig() and not a.text_encoders.train:
        raise ConfigError("'model.adapter.text_encoders.*' keys are set but model.adapter.text_encoders.train is not: "
                          "set it to true or remove the keys")


def check_adapter_type(a) -> None:
    """What each ``model.adapter.type`` takes: LoRA's own keys are refused with lokr / loha and the LoKr keys
    with any other type, each naming the key and the reason."""
    if a.type != "lokr" and (a.lokr_factor != -1 or a.decompose_both):
        key = "lokr_factor" if a.lokr_factor != -1 else "decompose_both"
        raise ConfigError(f"'model.adapter.{key}' applies to model.adapter.type=lokr (the Kronecker factors), "
                          f"not {a.type}: remove it or set model.adapter.type=lokr")
    if a.type == "lokr" and a.lokr_factor == 0:
        raise ConfigError("'model.adapter.lokr_factor' 0: use a factor >= 1 that divides the layers' sides, or -1 "
                          "(the most square split)")
    if a.type == "lora":
        return
    lora_only = [("use_dora", a.use_dora, "DoRA's magnitude is a LoRA method (peft has no LoKr / LoHa DoRA)"),
                 ("dropout", a.dropout != 0, "LoRA's input dropout; peft's LoKr / LoHa drop ranks or whole modules "
                                             "instead, which this trainer does not expose"),
                 ("init", a.init != "default", "LoRA's Gaussian init; LoKr / LoHa start from peft's default (one "
                                                "factor zero, so the update starts at zero)"),
                 ("text_encoders.train", a.text_encoders.train, "no diffusers or kohya loader of these families "
                  "reads a text-encoder LoKr / LoHa; train the text encoders' adapter with type=lora")]
    for key, is_set, why in lora_only:
        if is_set:
            raise ConfigError(f"'model.adapter.{key}' with model.adapter.type={a.type}: {why}; remove it or set "
                              "model.adapter.type=lora")


def check_base_quantization(cfg) -> None:
    """``model.adapter.base_quantization`` / ``base_gguf`` against the rest of the config (an adapter is set)."""
    a, q = cfg.model.adapter, cfg.model.adapter.base_quantization
    if (q == "gguf") != (a.base_gguf is not None):
        raise ConfigError("'model.adapter.base_gguf' names the GGUF file of model.adapter.base_quantization=gguf: "
                          "set both, or neither")
    if q == "none":
        return
    key = f"'model.adapter.base_quantization={q}'"
    if cfg.model.fp8:
        raise ConfigError(f"{key} with model.fp8: model.fp8 trains the blocks' own Linear layers in float8, a "
                          "quantised base stores them frozen; set model.fp8=false")
    if cfg.distributed.strategy in ("fsdp", "hsdp"):
        raise ConfigError(f"{key} with distributed.strategy={cfg.distributed.strategy}: FSDP2 shards parameters as DTensors of one "
                          "dtype, and the quantised weights (bitsandbytes' packed bytes with their statistics, "
                          "torchao's and GGUF's tensor subclasses) do not shard that way. The quantised base is "
                          "a quarter to a half of bf16's size, so it is replicated: use distributed.strategy=ddp")
    if a.type != "lora":
        raise ConfigError(f"{key} with model.adapter.type={a.type}: peft wraps quantised layers (bitsandbytes, "
                          "torchao, GGUF) with LoRA only; its LoKr / LoHa layers take plain Linear and Conv2d "
                          "layers. Train a LoRA on the quantised base, or a LoKr / LoHa on the unquantised one")
    if a.use_dora and q == "gguf":
        raise ConfigError(f"{key} with model.adapter.use_dora: DoRA's magnitude needs the base weight's norm, and "
                          "peft cannot dequantise diffusers' GGUF layers for it (it can bitsandbytes' and torchao's: "
                          "nf4, int8, int8_weight, fp8_weight); train a LoRA (use_dora=false) on the GGUF base")
    if a.export_merged:
        raise ConfigError(f"{key} with model.adapter.export_merged: merging into a quantised base would round "
                          "the update away; export the LoRA folder only and merge it into the full-precision "
                          "base (pipe.load_lora_weights(folder), then pipe.fuse_lora())")
    if q == "gguf" and not os.path.isfile(a.base_gguf):
        raise ConfigError(f"'model.adapter.base_gguf': {a.base_gguf} is not a file (a GGUF file of the family's "
                          "transformer / UNet, e.g. a city96 or QuantStack quantisation)")
