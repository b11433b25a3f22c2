"""CLIP score of (image, prompt) pairs with an open_clip model loaded from a local file.

CLIP score (Hessel et al. 2021, as torchmetrics reports it) = 100 * max(cos(image, text), 0), averaged
over the pairs: 0..100, ~30-35 for a good text-to-image model scored with ViT-L/14.

The weights come from a local path only (``pretrained=/path/open_clip_model.safetensors|.bin|.pt``);
the model config is one of open_clip's bundled names (``ViT-L-14``, ``ViT-H-14`` ...), a
``local-dir:/path`` with its own ``open_clip_config.json``, or a name defined by an extra JSON config
file (``model_config``). open_clip's tokenizer for these models is its bundled BPE: nothing is fetched.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
from PIL import Image

from .fid import gather_rows, rank_world

log = logging.getLogger(__name__)


class ClipScorer:
    def __init__(
        self, model_name: str, pretrained: str | os.PathLike, device: str | torch.device = "cpu",
        model_config: str | os.PathLike | None = None, batch_size: int = 32,
    ):
        import open_clip

        if model_config is not None:
            open_clip.add_model_config(model_config)  # a .json file (or folder of them) naming new models
        if not model_name.startswith("local-dir:") and not Path(pretrained).is_file():
            # open_clip would take a non-file as a hub tag and try to download it.
            raise FileNotFoundError(f"CLIP weights '{pretrained}' are not a local file (no downloads at run time)")
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.model, _, self.preprocess = open_clip.create_model_and_transforms(
            model_name, pretrained=str(pretrained), device=self.device
        )
        self.model.eval()
        self.tokenizer = open_clip.get_tokenizer(model_name)

    @torch.inference_mode()
    def similarities(self, images: Sequence, prompts: Sequence[str]) -> np.ndarray:
        """Cosine similarity of each image (PIL or path) with its prompt; shape (N,)."""
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
        out = []
        for i in range(0, len(images), self.batch_size):
            ims = [_open(x) for x in images[i : i + self.batch_size]]
            pixels = torch.stack([self.preprocess(im) for im in ims]).to(self.device)
            tokens = self.tokenizer(list(prompts[i : i + self.batch_size])).to(self.device)
            img = torch.nn.functional.normalize(self.model.encode_image(pixels).float(), dim=-1)
            txt = torch.nn.functional.normalize(self.model.encode_text(tokens).float(), dim=-1)
            out.append((img * txt).sum(-1).cpu().numpy())
        return np.concatenate(out) if out else np.empty((0,), np.float32)

    def score(self, images: Sequence, prompts: Sequence[str]) -> float:
        """Mean CLIP score of the pairs. Every rank passes all pairs and scores pairs r, r+W, ..."""
        rank, world = rank_world()
        sims = gather_rows(self.similarities(images[rank::world], prompts[rank::world]))
        if len(sims) == 0:
            raise ValueError("CLIP score of an empty set")
        return float(np.mean(100.0 * np.clip(sims, 0.0, None)))


def _open(item) -> Image.Image:
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    with Image.open(item) as im:
        return im.convert("RGB")


def prompts_for(files: Iterable[Path], prompts: Sequence[str] | None) -> list[str]:
    """The prompt of each generated image: its ``.txt`` sidecar when present, else image ``i`` (named
    ``{i:06d}.png`` by the generators here and by the training run's eval images (``families.sd``)) has prompt i % len."""
    out = []
    for f in files:
        f = Path(f)
        side = f.with_suffix(".txt")
        if side.is_file():
            out.append(side.read_text().strip())
        elif prompts and f.stem.isdigit():
            out.append(prompts[int(f.stem) % len(prompts)])
        else:
            raise ValueError(f"no prompt for {f}: no {side.name} beside it and no prompt list (or a non-numeric name)")
    return out
