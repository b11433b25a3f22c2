"""The training modes benchmarks/bench_memory.py measures, as config overrides: each mode is a list of levers,
each lever one set of overrides in :data:`LEVERS`. A config key the levers set is written once here, so a key
renamed when its lever lands is a one-line change (``KEYS``).

A lever whose key this build's config does not have (:func:`missing_keys`) is not run: the mode is reported
as skipped, naming the key, rather than failing in the trainer's config check.
"""

from __future__ import annotations

from typing import Callable

# The keys of the levers of issue 36, landing beside this benchmark (their names may change at the merge).
KEYS = {
    "adapter": "model.adapter.type",  # lora | lokr | loha
    "rank": "model.adapter.rank",
    "targets": "model.adapter.targets",
    "quantization": "model.adapter.base_quantization",  # nf4 | int8 | int8_weight | fp8_weight
    "block_swap": "model.block_swap",  # N of the net's blocks in host memory
}

Overrides = Callable[[dict, str], dict]  # (model spec, mode name) -> {config key: value}


def adapter(kind: str) -> Overrides:
    """An adapter of ``kind`` with the spec's rank and targets (its ``lora`` entry)."""
    def overrides(spec: dict, mode: str) -> dict:
        lora = spec.get("lora") or {}
        return {KEYS["adapter"]: kind, KEYS["rank"]: lora.get("rank", 16),
                KEYS["targets"]: lora.get("targets", "attention")}
    return overrides


def fixed(values: dict) -> Overrides:
    return lambda spec, mode: dict(values)


def quantized(kind: str) -> Overrides:
    return fixed({KEYS["quantization"]: kind})


def block_swap(spec: dict, mode: str) -> dict:
    """The spec's ``block_swap`` count for this mode (a number, or a table by mode name)."""
    n = spec.get("block_swap")
    n = n.get(mode) if isinstance(n, dict) else n
    if not n:
        raise SystemExit(f"bench_memory: mode {mode} swaps blocks but the model's spec has no block_swap for it "
                         f"(benchmarks/memory_models.yaml: block_swap: {{{mode}: N}})")
    return {KEYS["block_swap"]: int(n)}


OFFLOAD = {"distributed.strategy": "fsdp", "distributed.fsdp_cpu_offload": True}
IN_BACKWARD = {"optimizer.in_backward": True, "optimizer.params.max_grad_norm": "null"}  # (no clipping: refused)
ADAM8BIT = {"optimizer.name": "adamw8bit"}
ADAFACTOR = {"optimizer.name": "adafactor"}  # factored second moments: a row and a column per matrix

# lever -> (what it does, its overrides)
LEVERS: dict[str, tuple[str, Overrides]] = {
    "lora": ("a LoRA of the spec's rank on its targets (the adapter trains in fp32)", adapter("lora")),
    "lokr": ("a LoKr (peft LoKrConfig: a Kronecker-product update) of the spec's rank", adapter("lokr")),
    "loha": ("a LoHa (peft LoHaConfig: a Hadamard product of two low-rank updates)", adapter("loha")),
    "nf4": ("the frozen base's block Linear layers in 4-bit NormalFloat (bitsandbytes)", quantized("nf4")),
    "int8": ("the frozen base's block Linear layers in LLM.int8 (bitsandbytes)", quantized("int8")),
    "int8_weight": ("the frozen base's block Linear layers int8 weight-only (torchao)", quantized("int8_weight")),
    "fp8": ("the frozen base's block Linear layers float8 weight-only (torchao)", quantized("fp8_weight")),
    "swap": ("block swap: the spec's block_swap blocks of the net in host memory, streamed through the GPU",
             block_swap),
    "offload": ("FSDP2 on one rank with CPU offload: fp32 weights, gradients and AdamW state in pinned CPU memory, "
                "each unit copied in for its compute, the optimizer stepping on the CPU", fixed(OFFLOAD)),
    "opt_in_backward": ("optimizer.in_backward: each parameter updated as its gradient completes, then the "
                        "gradient freed (no clipping)", fixed(IN_BACKWARD)),
    "adam8bit": ("8-bit AdamW (bitsandbytes): 2 bytes of optimizer state per parameter", fixed(ADAM8BIT)),
    "adafactor": ("Adafactor: factored second moments, no first moment (almost no optimizer state)",
                  fixed(ADAFACTOR)),
}

# mode -> (what it is, its levers). No adapter lever: a full fine-tune (fp32 master weights, gradients, AdamW).
MODE_LEVERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "full": ("full fine-tune: every weight of the net trains (fp32 master weights, gradients, AdamW state)", ()),
    "lora": ("LoRA (model.adapter): the adapter trains in fp32, the base is frozen in the training precision",
             ("lora",)),
    "offload": ("full fine-tune, FSDP2 on one rank with CPU offload", ("offload",)),
    "opt_in_backward": ("full fine-tune, the optimizer in the backward", ("opt_in_backward",)),
    "adam8bit": ("full fine-tune with 8-bit AdamW (bitsandbytes)", ("adam8bit",)),
    "adam8bit+opt_in_backward": ("full fine-tune, 8-bit AdamW updated in the backward: fp32 weights, 8-bit state, "
                                 "no full set of gradients", ("adam8bit", "opt_in_backward")),
    # issue 36: one consumer GPU
    "lora_nf4": ("LoRA on a base quantised to nf4 (bitsandbytes)", ("lora", "nf4")),
    "lora_int8": ("LoRA on a base quantised to LLM.int8 (bitsandbytes)", ("lora", "int8")),
    "lora_int8_weight": ("LoRA on an int8 weight-only base (torchao)", ("lora", "int8_weight")),
    "lora_fp8": ("LoRA on a float8 weight-only base (torchao)", ("lora", "fp8")),
    "lora_swap": ("LoRA, the bf16 base's blocks swapped (block_swap)", ("lora", "swap")),
    # a full fine-tune with swapped blocks updates each block while it is on the device (optimizer.in_backward)
    "full_swap": ("full fine-tune with block swap, the optimizer in the backward", ("swap", "opt_in_backward")),
    "full_swap_8bit": ("full fine-tune with block swap and 8-bit AdamW in the backward",
                       ("swap", "adam8bit", "opt_in_backward")),
    # the swapped blocks' optimizer state stays on the device: Adafactor's is rows and columns, not weights
    "full_swap_adafactor": ("full fine-tune with block swap and Adafactor in the backward",
                            ("swap", "adafactor", "opt_in_backward")),
    "lokr": ("LoKr (peft): the Kronecker-product adapter trains, the base is frozen", ("lokr",)),
    "loha": ("LoHa (peft): the Hadamard-product adapter trains, the base is frozen", ("loha",)),
}


def _compose(levers: tuple[str, ...]) -> Overrides:
    def overrides(spec: dict, mode: str) -> dict:
        out: dict = {}
        for lever in levers:
            out.update(LEVERS[lever][1](spec, mode))
        return out
    return overrides


# name -> (what it is, overrides(spec, mode)): what bench_memory runs.
MODES: dict[str, tuple[str, Overrides]] = {name: (what, _compose(levers))
                                           for name, (what, levers) in MODE_LEVERS.items()}

# How the batches are read (the spec's ``data``): ``images`` (a folder of shard images: the VAE encodes and the
# text encoders encode every step, on the device) or ``latents`` (latent shards with stored text, written once
# per model by scripts/precompute_latents.py: model.text_encoder_placement and model.vae.placement ``auto`` then
# keep the frozen encoders and the VAE in host memory, as the goals assume).
DATA = {
    "images": {},
    "latents": {"dataset.type": "latents", "dataset.params.text_embeddings": True},
}


def overrides(mode: str, spec: dict) -> dict:
    """The config overrides of ``mode`` on the model ``spec`` (its data path's included)."""
    return {**DATA[spec.get("data", "images")], **MODES[mode][1](spec, mode)}


def lacks(key: str, value=None) -> str | None:
    """What this build's config lacks of ``key=value``: the key (a dotted path), or the value among its
    choices (``model.adapter.type=lokr`` before LoKr lands); None when it has both (anything under a free-form
    dict, e.g. ``model.transformer.params``, counts as present)."""
    from sd_training.config.schema import train_config_class
    from sd_training.families import options

    assert options.FamilyModelFields  # imported: the families' and adapters' fields are registered

    node, meta = train_config_class()(), {}
    for part in key.split("."):
        if isinstance(node, dict):
            return None
        fields = getattr(node, "__dataclass_fields__", None)
        if fields is None or part not in fields:
            return key
        node, meta = getattr(node, part), fields[part].metadata
    choices = meta.get("choices")
    if choices is not None and value is not None and str(value) not in choices:
        return f"{key}={value}"
    return None


def missing_keys(values: dict) -> list[str]:
    """The keys (or ``key=value`` for a value not among the key's choices) of ``values`` that this build's config
    does not take: a lever that has not landed."""
    return [what for k, v in values.items() if (what := lacks(k, v)) is not None]
