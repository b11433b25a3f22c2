"""Refusing latent shards made for other models than the run's: the VAE's factors and channels, the reference
count, and the stored text's shape, clip skip, layout and (edit families) the references it was read with
(:func:`check_latents_match`, called by ``PipelineFamily`` at start-up with the family's :class:`StoredText`).
The format itself is ``latents.py``'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..config.dataset import DatasetConfigError
from .latents import INFO_FILE, shift_of


@dataclass(frozen=True)
class StoredText:
    """The text conditioning a run expects in latent shards, as its family says (``PipelineFamily.stored_text``):
    ``length`` tokens x ``width`` channels of states, made with ``clip_skip`` (1: the last layer), in the
    layout ``tag`` (``latents_info.json``'s ``text_family``: which family's conditioning; None for shards
    of one encoder's states and no pooled embedding, the layout written before the field existed); an edit
    family's text read with ``references`` images by the rule ``vl_images``."""

    length: int
    width: int
    clip_skip: int = 1
    tag: Optional[str] = None
    # An edit family whose text reads the reference images (Qwen-Image-Edit): how many, and how its VL encoder
    # sees them (latents_info.json's text_references, text_vl_images); 0 / None: text read alone.
    references: int = 0
    vl_images: Optional[str] = None


def check_latents_match(loader, vae, text: Optional[StoredText] = None) -> None:
    """Refuse latent shards made for other models than the run's: the VAE's scaling factor and latent
    channels, and (when the batches carry stored text embeddings and ``text`` is given) their shape, clip
    skip and layout. Raises :class:`DatasetConfigError`; a no-op for image data."""
    info = getattr(loader, "latents_info", None)
    if loader.kind != "latents" or info is None:
        return
    problems = []
    # A VAE without a scaling factor (FLUX.2's: it normalises by batch-norm statistics) stores latents at scale 1
    scale = float(vae.config.get("scaling_factor", None) or 1.0)
    if abs(float(info["latent_scaling_factor"]) - scale) > 1e-6 * scale:
        problems.append(f"scaling factor {info['latent_scaling_factor']} (the run's VAE: {scale})")
    shift = float(getattr(vae.config, "shift_factor", None) or 0.0)
    if abs(shift_of(info) - shift) > 1e-6 * max(abs(shift), 1.0):
        problems.append(f"shift factor {shift_of(info)} (the run's VAE: {shift}; stored latents are "
                        "(latent - shift_factor) * scaling_factor)")
    if loader.proc.refs.count > int(info.get("references") or 0):
        problems.append(f"{int(info.get('references') or 0)} reference latents per sample (the run's "
                        f"dataset.params.references: {loader.proc.refs.count})")
    if int(info["latent_channels"]) != int(vae.config.latent_channels):
        problems.append(f"{info['latent_channels']} latent channels (the run's VAE: {vae.config.latent_channels})")
    if loader.proc.text_embeddings and text is not None:
        want = [int(text.length), int(text.width)]
        if list(info["text_shape"]) != want:
            problems.append(f"text embeddings of shape {info['text_shape']} (the run's text encoder: {want})")
        have = max(int(info.get("clip_skip") or 0), 1)
        if have != text.clip_skip:
            problems.append(f"text embeddings with clip_skip {have} (the run's text encoder: {text.clip_skip})")
        made_for = info.get("text_family")
        if made_for != text.tag:
            problems.append(f"text embeddings in the {made_for or 'single-encoder'} layout (this run's family reads "
                            f"the {text.tag or 'single-encoder'} layout)")
        problems += image_text_problems(info, text)
    if problems:
        raise DatasetConfigError(
            f"dataset.params.path: these latent shards ({info.get('_path') or INFO_FILE}) were made for other "
            f"models: {'; '.join(problems)}. "
            "Re-run scripts/precompute_latents.py with the run's pipeline (and --clip-skip / --max-length)"
        )


def image_text_problems(info: Dict[str, Any], text: StoredText) -> List[str]:
    """An edit family's text is read with the references: the shards' must have been read with as many, each
    brought to the VL encoder by the same rule (text_references / text_vl_images), and hold each sample's empty
    caption (read with its references too)."""
    held, rule = int(info.get("text_references") or 0), info.get("text_vl_images")
    if held == text.references and rule == text.vl_images:
        return []
    if not text.references:
        return [f"text embeddings read with {held} reference image(s) (this run's family reads the caption alone)"]
    if not held:
        return [f"text embeddings of the caption alone (this run's family reads it with {text.references} reference "
                "image(s): re-run scripts/precompute_latents.py with --references "
                f"{text.references} --text-embeddings on the paired shards)"]
    return [f"text embeddings read with {held} reference image(s), {rule!r} (this run's family reads "
            f"{text.references}, {text.vl_images!r})"]
