"""Shards of precomputed VAE latents: the format and its reader (``dataset.type: latents``); the checks against
the run's models are ``latent_checks.py``'s.

``scripts/precompute_latents.py`` writes one tar per input shard, with the input's basename, members
named as WebDataset expects (the key ends at the first dot):

  ``KEY.latents.npy``  float16 or float32, ALREADY in the denoiser's units: ``(latent - shift_factor) *
                       scaling_factor`` with the VAE's factors (no shift for VAEs without one), as the
                       pipelines decode them (``latent / scaling_factor + shift_factor``):
                       ``mean_std``: [2C, h, w], the posterior mean (channels 0..C-1) then its std (C..2C-1);
                       ``sample``: [C, h, w], one posterior sample drawn at precompute time
  ``KEY.txt``          the caption as the image path reads it (stripped), otherwise unmodified
  ``KEY.json``         the sample's original metadata + ``latent_scaling_factor`` and ``latent_store``
  ``KEY.cls``          the class index, when the input had one (``idx_to_prompt`` datasets)
  ``KEY.text.npy``     with ``--text-embeddings``: the family's text conditioning of KEY.txt, [L, D] (one
                       CLIP encoder: its last hidden state; two: both encoders' states concatenated)
  ``KEY.pooled.npy``   with ``--text-embeddings``, for a family conditioned on a pooled embedding too: [P]
  ``KEY.empty.text.npy``  with ``--text-embeddings`` for a family whose text reads the reference images
                       (Qwen-Image-Edit): the empty caption read with this sample's references, for caption
                       dropout (``latents_info.json``: ``empty_text: per_sample``, no ``empty.text.npy``)
  ``KEY.ref.latents.npy``, ``KEY.ref2.latents.npy``...  with ``--references N`` (edit training): each
                       reference image's latents, in the store, dtype and units of ``KEY.latents.npy``

Text arrays (states, pooled, the empty caption's) are float16 or float32 ``.npy``, or bfloat16: numpy has
no bfloat16, so they are stored as the uint16 bit patterns and ``latents_info.json``'s ``text_dtype``
says ``bfloat16`` (T5's states, [512, 4096] a caption, take half the bytes of fp32 without fp16's range
limit); the reader gives back the exact bfloat16 values as float32. ``latents_info.json`` also records
``latent_shift_factor`` and ``bytes_per_sample`` (latents, text); folders written before these fields
existed read as no shift and the arrays' own dtype.

What the text arrays hold is the family's (``Family.text_encoding``; ``latents_info.json``'s
``text_family`` names the layout); this module stores, reads and checks them without knowing it.

``KEY.json`` also holds the crop's size conditioning (``original_size``, ``crop_top_left``,
``target_size``, as lists), which batches carry as the image path's do (size micro-conditioning).

and next to the shards: ``latents_info.json`` (the settings, the scaling factor, counts; see the
script), ``sizes.json`` ({shard: samples}) and, with text embeddings, ``empty.text.npy``: the embedding
of the empty caption (and ``empty.pooled.npy`` with pooled embeddings). Storing scaled values costs nothing (a scale is exact to the dtype's precision)
and means the reader never needs the VAE: s * (mean + std * eps) = s * mean + (s * std) * eps.

Reading: the same sources, stream, shuffle buffer, resume position and counters as the image path;
only the per-sample work differs (:class:`LatentSampleProcessor`). A sample's random numbers come
from its own generator, drawn in the image path's order first (so caption dropout hits the same
samples whether a run reads images or their latents), then the latent noise ``eps``: a resumed run
and an uninterrupted one draw the same posterior samples, and every epoch draws new ones. Reference
latents (``dataset.params.references``) each draw theirs from a generator of their own, seeded after all of
the target's (a run without references draws exactly as before); batches carry them as
``reference_latents`` float32 [B, R, C, h, w]. Shards holding fewer references per sample than the run asks
(``latents_info.json``'s ``references``) are refused at start-up.

Caption dropout with precomputed text embeddings: the embedding of a dropped caption must be that of
'' (what the text encoder would give the tokenized empty caption), so the precompute script stores
``empty.text.npy`` once and the reader substitutes it whenever the caption ends up empty. Caption
changes other than dropout (tag shuffling, tags from metadata, ``idx_to_prompt``) cannot be replayed
on a stored embedding: the config validation refuses them with ``text_embeddings: true``.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any, Dict, List, Optional

import numpy as np

from ..config.dataset import DatasetConfigError
from .references import reference_names
from .samples import SIZE_FIELDS, SampleProcessor
from .sources import REMOTE, ShardError, WebDatasetSource, iter_tar_samples, open_stream
from .stats import Stats, log

FORMAT = "sd-training latent shards"
FORMAT_VERSION = 1
BF16 = "bfloat16"  # text_dtype of text arrays stored as bfloat16 bit patterns (uint16 .npy)
LATENTS_MEMBER = "latents.npy"
REFERENCE_BASE = "ref"  # KEY.ref.latents.npy, KEY.ref2.latents.npy...: the reference latents' members
TEXT_MEMBER = "text.npy"
EMPTY_TEXT_MEMBER = "empty.text.npy"  # an edit family's per-sample empty caption (its text reads the references)
PER_SAMPLE = "per_sample"  # latents_info.json's empty_text when each sample holds its own EMPTY_TEXT_MEMBER
POOLED_MEMBER = "pooled.npy"
INFO_FILE = "latents_info.json"
EMPTY_TEXT_FILE = "empty.text.npy"
EMPTY_POOLED_FILE = "empty.pooled.npy"
STORES = ("mean_std", "sample")
# The batch keys of stored text conditioning (the family reads them: ``Family.condition``).
TEXT_STATES_KEY = "encoder_hidden_states"
POOLED_KEY = "pooled_text_embeds"


def npy_bytes(array: np.ndarray) -> bytes:
    """``.npy`` file bytes of ``array`` (no pickle)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def load_npy(data: bytes) -> np.ndarray:
    """The array of ``.npy`` bytes; raises ValueError on anything else (never unpickles)."""
    try:
        return np.load(io.BytesIO(bytes(data)), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exn:
        raise ValueError(f"not a .npy array ({exn})") from exn


def to_stored(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` as stored with ``text_dtype`` ``dtype`` (a numpy float name, or ``bfloat16``: the uint16 bit
    patterns of its round-to-nearest-even bfloat16 values, what torch's ``.bfloat16()`` gives)."""
    if dtype != BF16:
        return np.asarray(array).astype(dtype)
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_stored(array: np.ndarray, dtype: Optional[str]) -> np.ndarray:
    """float32 values of a stored text array (``dtype``: ``latents_info.json``'s ``text_dtype``; None: the
    array's own float dtype, as folders written before the field). Raises ValueError on a mismatch."""
    if dtype == BF16:
        if array.dtype != np.uint16:
            raise ValueError(f"text_dtype bfloat16 is stored as uint16, got {array.dtype}")
        return (array.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"expected a float array, got {array.dtype}")
    return array.astype(np.float32)


def sibling(unit: str, name: str) -> Optional[str]:
    """Where file ``name`` next to shard ``unit`` is: a local path or an http(s) URL (None for pipe: etc.)."""
    if unit.startswith(("http://", "https://")):
        return unit.split("?", 1)[0].rsplit("/", 1)[0] + "/" + name
    if REMOTE.match(unit):
        return None
    return os.path.join(os.path.dirname(unit.removeprefix("file:")), name)


def _read_sibling(unit: str, name: str, timeout: float) -> Optional[bytes]:
    where = sibling(unit, name)
    if where is None:
        return None
    try:
        stream = open_stream(where, timeout)
    except ShardError:
        return None
    try:
        return stream.read()
    finally:
        stream.close()


class LatentShardSource(WebDatasetSource):
    """Latent shards of one '::'-separated path element, with its ``latents_info.json`` (when readable)."""

    def __init__(self, spec: str, params):
        super().__init__(spec, params)
        self.info: Optional[Dict[str, Any]] = None
        self.empty_text: Optional[np.ndarray] = None
        self.empty_pooled: Optional[np.ndarray] = None
        raw = _read_sibling(self.units[0], INFO_FILE, self.timeout) if self.units else None
        if raw is not None:
            try:
                self.info = json.loads(raw)
            except ValueError as exn:
                raise DatasetConfigError(f"dataset.params.path: {sibling(self.units[0], INFO_FILE)} is not json ({exn})") from exn
            if self.info.get("format") != FORMAT or int(self.info.get("version", -1)) != FORMAT_VERSION:
                raise DatasetConfigError(
                    f"dataset.params.path: {sibling(self.units[0], INFO_FILE)} is not version {FORMAT_VERSION} of the "
                    "latent-shard format (re-run scripts/precompute_latents.py)"
                )
            if self.info.get("text_dtype") not in (None, BF16, "float16", "float32"):
                raise DatasetConfigError(f"dataset.params.path: {sibling(self.units[0], INFO_FILE)} has text_dtype "
                                         f"{self.info['text_dtype']!r} (this reader knows float16, float32, bfloat16)")
            self.info["_path"] = sibling(self.units[0], INFO_FILE)  # where it came from, for the errors

    def read(self, unit: str, stats: Stats):
        for members in iter_tar_samples(unit, self.timeout, stats, self.max_member_bytes):
            yield {
                "key": members["__key__"],
                "url": unit,
                "latents": members.get(LATENTS_MEMBER),
                "text": members.get(TEXT_MEMBER),
                "empty_text": members.get(EMPTY_TEXT_MEMBER),
                "pooled": members.get(POOLED_MEMBER),
                "caption": members.get(self.caption_key),
                "meta_raw": members.get(self.metadata_key),
                "cls": members.get(self.cls_key),
                "references": [(members[m], None) if m in members else None for m in self.reference_members],
            }

    @property
    def reference_members(self) -> List[str]:
        return [f"{name}.{LATENTS_MEMBER}" for name in reference_names(REFERENCE_BASE, self.references)]


def check_latent_sources(sources: List[LatentShardSource], params) -> Optional[float]:
    """Start-up checks of latent shards against the config; loads the empty-caption embeddings.

    Returns the shards' latent scaling factor (None when no ``latents_info.json`` could be read).
    """
    factors = {}
    for src in sources:
        info = src.info
        if info is None:
            log.warning(
                "data: no readable %s next to %s: the store mode comes from each sample's json and the resolution "
                "cannot be checked", INFO_FILE, src.name,
            )
            if params.text_embeddings and float(params.caption_dropout) > 0:
                raise DatasetConfigError(
                    f"dataset.params.caption_dropout with text_embeddings needs {EMPTY_TEXT_FILE} and {INFO_FILE} "
                    f"next to the shards of {src.name} (local or http(s)); they are not readable there"
                )
            continue
        where = sibling(src.units[0], INFO_FILE)
        held = int(info.get("references") or 0)
        if int(params.references) > held:
            raise DatasetConfigError(
                f"dataset.params.references={params.references} but the latent shards of {src.name} hold {held} "
                f"reference latents per sample ({where}): re-run scripts/precompute_latents.py --references "
                f"{params.references} on the paired shards, or set dataset.params.references={held}")
        if int(info["resolution"]) != int(params.resolution):
            raise DatasetConfigError(
                f"dataset.params.resolution={params.resolution} but the latent shards of {src.name} were made at "
                f"{info['resolution']} px ({where}): set dataset.params.resolution={info['resolution']}"
            )
        if params.latent_sampling == "mean" and info["latent_store"] != "mean_std":
            raise DatasetConfigError(
                f"dataset.params.latent_sampling=mean but the shards of {src.name} hold one posterior sample "
                f"(latent_store={info['latent_store']}): re-run scripts/precompute_latents.py with --store mean_std"
            )
        if params.text_embeddings:
            if not info.get("text_embeddings"):
                raise DatasetConfigError(
                    f"dataset.params.text_embeddings=true but the shards of {src.name} hold none: re-run "
                    "scripts/precompute_latents.py with --text-embeddings"
                )
            raw = _read_sibling(src.units[0], EMPTY_TEXT_FILE, src.timeout)
            if raw is None:
                if float(params.caption_dropout) > 0 and info.get("empty_text") != PER_SAMPLE:
                    raise DatasetConfigError(
                        f"dataset.params.caption_dropout with text_embeddings needs {sibling(src.units[0], EMPTY_TEXT_FILE)} "
                        "(the empty caption's embedding, written by scripts/precompute_latents.py --text-embeddings)"
                    )
            else:
                try:
                    src.empty_text = from_stored(load_npy(raw), info.get("text_dtype"))
                except ValueError as exn:
                    raise DatasetConfigError(f"{sibling(src.units[0], EMPTY_TEXT_FILE)}: {exn}") from exn
            if info.get("pooled_shape"):
                raw = _read_sibling(src.units[0], EMPTY_POOLED_FILE, src.timeout)
                if raw is not None:
                    try:
                        src.empty_pooled = from_stored(load_npy(raw), info.get("text_dtype"))
                    except ValueError as exn:
                        raise DatasetConfigError(f"{sibling(src.units[0], EMPTY_POOLED_FILE)}: {exn}") from exn
                elif float(params.caption_dropout) > 0:
                    raise DatasetConfigError(
                        f"dataset.params.caption_dropout with pooled text_embeddings needs "
                        f"{sibling(src.units[0], EMPTY_POOLED_FILE)} (written by scripts/precompute_latents.py)")
        if not info.get("complete", False):
            log.warning("data: %s says the precompute of %s has not finished: training on the shards written so far",
                        where, src.name)
        factors[src.name] = (float(info["latent_scaling_factor"]), shift_of(info))
    if len(set(factors.values())) > 1:
        raise DatasetConfigError(
            "dataset.params.path: the latent sources were made with different scaling (and shift) factors "
            f"({', '.join(f'{k}: {v[0]} (shift {v[1]})' for k, v in factors.items())}); precompute them with the same VAE"
        )
    return next(iter(factors.values()))[0] if factors else None


def shift_of(info: Dict[str, Any]) -> float:
    """The shift factor latents were made with (0 for folders written before the field)."""
    return float(info.get("latent_shift_factor") or 0.0)


class LatentSampleProcessor(SampleProcessor):
    """Latent samples: ``select`` as for images (metadata, filters, captions), then ``process`` decodes the
    stored arrays instead of an image, and ``collate`` stacks ``latents`` (and ``encoder_hidden_states``).

    Given several tokenizers, batches carry ``input_ids_2``, ... as the image path's do; the size fields
    come from each sample's json (written by the precompute script); stored pooled embeddings add
    ``pooled_text_embeds``."""

    missing_payload = "missing_latents"

    def __init__(self, params, kind: str, tokenizer, sources: List[LatentShardSource]) -> None:
        super().__init__(params, kind, tokenizer)
        self.sampling = str(params.latent_sampling)
        self.text_embeddings = bool(params.text_embeddings)
        infos = [s.info or {} for s in sources]
        self.stores = [i.get("latent_store") for i in infos]
        self.channels = [i.get("latent_channels") for i in infos]
        self.down = [int(i.get("downsample_factor", 8)) for i in infos]
        self.text_shapes = [tuple(i["text_shape"]) if i.get("text_shape") else None for i in infos]
        self.text_dtypes = [i.get("text_dtype") for i in infos]
        self.empty_text = [s.empty_text for s in sources]
        self.per_sample_empty = [i.get("empty_text") == PER_SAMPLE for i in infos]
        self.empty_pooled = [s.empty_pooled for s in sources]
        self.pooled = [bool(i.get("pooled_shape")) for i in infos]

    def payload(self, raw: Dict[str, Any], meta: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if raw.get("latents") is None:
            return None
        meta = meta if isinstance(meta, dict) else {}
        sizes = {k: tuple(int(v) for v in meta[k]) for k in SIZE_FIELDS
                 if isinstance(meta.get(k), (list, tuple)) and len(meta[k]) == 2}
        return {"latents": raw["latents"], "text": raw.get("text"), "pooled": raw.get("pooled"),
                "empty_text": raw.get("empty_text"),
                "store": meta.get("latent_store"), "sizes": sizes, "references": raw.get("references") or []}

    def process(self, s: Dict[str, Any], rng: np.random.Generator, stats: Stats) -> Optional[Dict[str, Any]]:
        where = f"{s['url']} sample {s['key']!r}"
        # The image path's draws first, in its order (flip, crop, caption): the same samples get their
        # caption dropped whether a run reads images or latents. Then this path's own: the latent noise.
        rng.random()
        rng.integers(2**63)
        caption_rng = np.random.default_rng(rng.integers(2**63))
        eps_rng = np.random.default_rng(rng.integers(2**63))
        # Edit training: each reference's own noise, drawn after all of the target's (none without references).
        ref_rngs = [np.random.default_rng(rng.integers(2**63)) for _ in range(self.refs.count)]
        src = s["src"]
        store = s.get("store") or self.stores[src]
        latents, reason, problem = self._latents(s["latents"], store, src, eps_rng)
        references = []
        for k, (ref_rng, (data, _)) in enumerate(zip(ref_rngs, s["references"][: self.refs.count])):
            if problem is not None:
                break
            ref, reason, problem = self._latents(data, store, src, ref_rng)
            if problem is None and ref.shape != latents.shape:
                problem = f"shape {ref.shape}, the target's {latents.shape}"
            if problem is not None:
                reason, problem = "bad_reference_latents", f"reference {k + 1} ({self.refs.names[k]}): {problem}"
            references.append(ref)
        if problem is not None:
            stats.skip(reason, f"{where}: {problem}")
            return None

        caption = s["caption"]
        if isinstance(caption, int):  # a class index
            prompts = self.idx_to_prompt[caption]
            caption = prompts[int(caption_rng.integers(len(prompts)))] if len(prompts) > 1 else prompts[0]
        caption, dropped = self.captions.augment(caption, s["tags"], caption_rng)
        text = pooled = None
        if self.text_embeddings:
            text = self._text(s, caption, src, where, stats)
            if text is None:
                return None
            if self.pooled[src]:
                pooled = self._pooled(s, caption, src, where, stats)
                if pooled is None:
                    return None
        h, w = latents.shape[1:]
        down = self.down[src]
        return {
            "latents": np.ascontiguousarray(latents),
            "references": [np.ascontiguousarray(r) for r in references],  # [C, h, w] each
            "text": text,
            "pooled": pooled,
            "sizes": s.get("sizes") or {},
            "caption": caption,
            "caption_dropped": dropped,
            "key": s["key"],
            "bucket": (w * down, h * down),  # pixels, (width, height) as image buckets
        }

    def _latents(self, data: bytes, store: Optional[str], src: int, eps_rng: np.random.Generator):
        """(float32 [C, h, w] latents, None, None) of one stored array, the mean or a posterior sample drawn
        with ``eps_rng``; or (None, skip reason, what is wrong)."""
        try:
            arr = load_npy(data)
        except ValueError as exn:
            return None, "bad_latents", str(exn)
        if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.floating):
            return None, "bad_latents", f"expected a float [C, h, w] array, got {arr.dtype} {arr.shape}"
        if store not in STORES:
            return None, "bad_latents", f"unknown latent_store {store!r} (json and {INFO_FILE} say nothing usable)"
        if store == "mean_std" and arr.shape[0] % 2:
            return None, "bad_latents", f"mean_std latents need an even channel count, got {arr.shape}"
        arr = arr.astype(np.float32)
        channels = arr.shape[0] // 2 if store == "mean_std" else arr.shape[0]
        if self.channels[src] is not None and channels != int(self.channels[src]):
            return None, "bad_latents", f"{channels} latent channels, the shards' info says {self.channels[src]}"
        if not np.isfinite(arr).all():
            return None, "bad_latents", "non-finite values"
        if store == "mean_std":
            mean, std = arr[:channels], arr[channels:]
            return (mean if self.sampling == "mean" else
                    mean + std * eps_rng.standard_normal(mean.shape, dtype=np.float32)), None, None
        if self.sampling == "mean":
            return None, "latent_store_mismatch", "latent_sampling=mean but the sample stores no mean (sample)"
        return arr, None, None

    def _text(self, s, caption: str, src: int, where: str, stats: Stats) -> Optional[np.ndarray]:
        member = TEXT_MEMBER
        if caption == "" and self.per_sample_empty[src]:
            member = EMPTY_TEXT_MEMBER  # an edit family's: the empty caption read with this sample's references
        elif caption == "" and self.empty_text[src] is not None:
            return self.empty_text[src]  # a dropped caption (or a stored empty one: the same embedding)
        data = s.get("empty_text" if member == EMPTY_TEXT_MEMBER else "text")
        if data is None:
            stats.skip("missing_text_embedding", f"{where}: no {member} member")
            return None
        try:
            text = from_stored(load_npy(data), self.text_dtypes[src])
        except ValueError as exn:
            stats.skip("bad_text_embedding", f"{where}: {exn}")
            return None
        expected = self.text_shapes[src]
        if text.ndim != 2 or (expected is not None and tuple(text.shape) != expected) or not np.isfinite(text).all():
            stats.skip("bad_text_embedding", f"{where}: shape {text.shape} (expected {expected}) or non-finite values")
            return None
        return text

    def _pooled(self, s, caption: str, src: int, where: str, stats: Stats) -> Optional[np.ndarray]:
        if caption == "" and self.empty_pooled[src] is not None:
            return self.empty_pooled[src]
        try:
            pooled = from_stored(load_npy(s["pooled"]), self.text_dtypes[src]) if s.get("pooled") is not None else None
        except ValueError as exn:
            stats.skip("bad_text_embedding", f"{where}: {exn}")
            return None
        if pooled is None or pooled.ndim != 1 or not np.isfinite(pooled).all():
            stats.skip("bad_text_embedding", f"{where}: no usable {POOLED_MEMBER} member")
            return None
        return pooled

    def collate(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        import torch

        captions = [s["caption"] for s in samples]
        batch = {
            "latents": torch.from_numpy(np.stack([s["latents"] for s in samples])),
            "input_ids": self.tokenize(captions),
            "captions": captions,
            "keys": [s["key"] for s in samples],
            "epochs": [s["epoch"] for s in samples],
        }
        if self.preview:
            batch["caption_dropped"] = [bool(s["caption_dropped"]) for s in samples]
        if self.refs.count:  # edit training: [B, R, C, h, w]
            batch["reference_latents"] = torch.from_numpy(np.stack([np.stack(s["references"]) for s in samples]))
        for k in range(1, len(self.tokenizers)):
            batch[f"input_ids_{k + 1}"] = self.tokenize(captions, k)
        for name in SIZE_FIELDS:  # only when every sample's json has them (shards of older precomputes do not)
            if all(name in s["sizes"] for s in samples):
                batch[name] = torch.tensor([s["sizes"][name] for s in samples], dtype=torch.int64)
        if self.text_embeddings:
            batch[TEXT_STATES_KEY] = torch.from_numpy(np.stack([s["text"] for s in samples]))
            if all(s["pooled"] is not None for s in samples):
                batch[POOLED_KEY] = torch.from_numpy(np.stack([s["pooled"] for s in samples]))
        return batch
