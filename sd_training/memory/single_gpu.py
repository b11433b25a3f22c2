"""The published models on one GPU: what each low-memory lever leaves on the device (docs/memory.md's
"One GPU" table, ``python -m sd_training.memory.single_gpu``, kept equal to the docs by a test).

Each row is one model (``Family.reference_models()``, built on the meta device) trained on latent shards with
the text states stored, so the text encoders and the VAE stay in host memory (``model.text_encoder_placement`` and
``model.vae.placement``: auto); 1024 px, batch 1, bf16 autocast, gradient checkpointing, no EMA on the GPU. The
columns are the levers, counted as the plans at config load and start-up count them (``memory.fit``):

* LoRA rank 16 on the family's ``attention`` preset (the LoRA templates' setting): the adapter's fp32 weights,
  gradients and AdamW state, and the frozen base in bf16 (``model.adapter.base_quantization: none``) or stored
  nf4 (its blocks' Linear weights at 0.516 bytes, ``components.quantized_base``), or in bf16 with every block
  swapped (``model.block_swap``: two blocks in flight on the device, the rest of the net resident);
* the full fine-tune with every block swapped, the optimizer in the backward (no full set of gradients) and
  Adafactor's factored state (its rows and columns: counted as none) or 8-bit AdamW (2 bytes a parameter).

The activations are the plan's rough lower estimate; the GPU figures of ``benchmarks/bench_memory.py`` are
what a run measures.
"""

from __future__ import annotations

from ..adapters import resolve_targets
from ..families.components.quantized_base import quantizable_weights
from ..speed import block_swap
from .load import family_units, lora_params, quantized_base_bytes
from .plan import GIB, OPTIMIZER_BYTES, reference_activations, reference_models, reference_parts

RANK, PRESET = 16, "attention"
# The goals (peak GiB allocated on one GPU, 1024 px, batch 1), by reference model and column
GOALS = {("Flux.1-dev", "lora_nf4"): 10, ("Flux.1-dev", "full_swap_adafactor"): 16, ("Qwen-Image", "lora_nf4"): 16,
         ("FLUX.2-dev", "lora_nf4"): 24, ("Z-Image", "lora_nf4"): 8}
COLUMNS = {  # key -> the header
    "lora": "LoRA, bf16 base", "lora_nf4": "LoRA, nf4 base", "lora_swap": "LoRA, bf16 base, blocks swapped",
    "full_swap_adafactor": "full, swapped, Adafactor in backward",
    "full_swap_adam8bit": "full, swapped, 8-bit AdamW in backward",
}


def model_row(name: str, resolution: int = 1024) -> dict[str, float]:
    """GiB on the device of reference model ``name`` under each column of :data:`COLUMNS`."""
    fam, _model = reference_models()[name]
    parts = reference_parts(name)
    net, params = parts.net, parts.params
    units = family_units(fam, net, "swap_units")
    swap = block_swap.plan(units, len(units))
    resident = params - swap.swapped + swap.in_flight  # every block swapped, two in flight
    targets = resolve_targets(net, fam.adapter_presets, PRESET, [], None, "model.adapter", fam.net_name)
    adapter = lora_params(net, targets, RANK) * (4 + 4 + OPTIMIZER_BYTES["adamw"])
    nf4 = quantized_base_bytes("nf4", params, quantizable_weights(family_units(fam, net)))
    acts = reference_activations(name, resolution, 1, True)
    gib = {
        "lora": adapter + params * 2 + acts,
        "lora_nf4": adapter + params * nf4 + acts,
        "lora_swap": adapter + resident * 2 + acts,
        "full_swap_adafactor": resident * 4 + params * OPTIMIZER_BYTES["adafactor"] + acts,
        "full_swap_adam8bit": resident * 4 + params * OPTIMIZER_BYTES["adamw8bit"] + acts,
    }
    return {k: v / GIB for k, v in gib.items()}


def table(resolution: int = 1024) -> str:
    """The markdown table: planned GiB per model and lever, the goal where the issue set one, measured: none yet."""
    head = "| model | " + " | ".join(COLUMNS.values()) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for name in reference_models():
        row = model_row(name, resolution)
        cells = [f"{row[k]:.1f}" + (f" (goal <= {GOALS[name, k]})" if (name, k) in GOALS else "") for k in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m sd_training.memory.single_gpu
    print(table())
