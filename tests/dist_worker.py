"""Run under torchrun (or alone): N optimizer steps on a fixed global batch split across ranks.

    python tests/dist_worker.py OUT.pt key=value ... [-- OUT2.pt key=value ...]   (the tiny-run overrides the tests use)

Every rank builds the same global batch (latents, token ids, noise, timesteps; an edit family's reference
latents and pixels) from a fixed seed and
takes its slice, so 1 rank x batch 2b and 2 ranks x batch b see exactly the same samples. Rank 0 saves
the final UNet parameters to OUT.pt and the parameters before the first step to OUT.init.pt. Runs
separated by ``--`` train one after the other in the same processes (one start-up of torch and the
process group for several configurations; each run builds its own Trainer from its own config).
"""

import sys

import torch

from sd_training import distributed
from sd_training.configure import load
from sd_training.loop import Trainer

STEPS = 3
GLOBAL_BATCH = 8


def train(out: str, argv: list[str], info) -> None:
    cfg = load(argv)
    t = Trainer(cfg, info)
    t.setup()
    save(t, info, out.removesuffix(".pt") + ".init.pt")
    accum, b = cfg.system.gradient_accumulation, cfg.system.batch_size
    assert b * accum * info.world_size == GLOBAL_BATCH, "the config must split the global batch exactly"
    g = torch.Generator().manual_seed(1234)
    captions = [f"a {c} shape number {i}" for i, c in enumerate(["red", "green", "blue", "black"] * 2)]
    # One ids tensor per tokenizer of the family: input_ids, input_ids_2 (SDXL's CLIP-G, Flux's T5), input_ids_3.
    toks = t.family.tokenizers if isinstance(t.family.tokenizers, tuple) else (t.family.tokenizers,)
    extra = {("input_ids" if k == 0 else f"input_ids_{k + 1}"): tok(
        captions, padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt").input_ids
        for k, tok in enumerate(toks)}
    channels = int(t.models.vae.config.latent_channels)
    for _ in range(STEPS):
        full = {
            **extra,
            "latents": torch.randn(GLOBAL_BATCH, channels, 8, 8, generator=g),
            "noise": torch.randn(GLOBAL_BATCH, channels, 8, 8, generator=g),
            "timesteps": torch.randint(0, 1000, (GLOBAL_BATCH,), generator=g),
        }
        refs = t.family.reference_images[0]  # an edit family's reference latents, as latent shards give them
        if refs:
            full["reference_latents"] = torch.randn(GLOBAL_BATCH, refs, channels, 8, 8, generator=g)
            # and their pixels, which Qwen-Image-Edit's text encoder reads with the instruction
            full["reference_values"] = torch.randint(0, 256, (GLOBAL_BATCH, refs, 3, 64, 64), generator=g,
                                                     dtype=torch.uint8)
        # Global index layout: micro-batch m of rank r holds rows [(m * W + r) * b, ... + b).
        for m in range(accum):
            lo = (m * info.world_size + info.rank) * b
            t.micro_step({k: v[lo : lo + b] for k, v in full.items()}, sync=(m == accum - 1))
        t.optimizer_step()
    save(t, info, out)


def save(t: Trainer, info, out: str) -> None:
    """Rank 0 writes the trained module's full parameters (a collective under FSDP)."""
    plain = t.strategy.plain_copy(t.net, torch.device("cpu"))
    if info.is_main:
        torch.save({k: v.detach().cpu() for k, v in plain.state_dict().items()}, out)
    distributed.barrier()


def main(argv: list[str]) -> None:
    runs, cur = [], []
    for a in argv:
        if a == "--":
            runs.append(cur)
            cur = []
        else:
            cur.append(a)
    runs.append(cur)
    first = load(runs[0][1:])
    info = distributed.setup(first.system.device, first.distributed.dist_backend, first.distributed.dist_url)
    try:
        for out, *args in runs:
            train(out, args, info)
    finally:
        distributed.teardown()


if __name__ == "__main__":
    main(sys.argv[1:])
