"""The models benchmarks/bench_memory.py builds (benchmarks/memory_models.yaml), with random weights, and the
batches they read.

A spec names its shapes one of two ways:

* ``net`` and ``components`` written out (SDXL: its UNet config and the full-size CLIPs and VAE), or
* ``reference``: a published model of the family's ``reference_models()`` (sd_training/families/*.py, the
  shapes the memory plan's table uses): the trained transformer is built from that config
  (``model.transformer.params``), the VAE is that full-size VAE, and each text encoder is a *width-true
  stand-in* (:func:`stand_in_encoder`).

Why stand-ins, and latent shards written through them (``data: latents``): the issue's goals are measured
with the frozen text encoders and VAE in host memory (stored text states; ``model.text_encoder_placement``
and ``model.vae.placement`` auto), so the encoders' weights never reach the GPU during the steps. A
full-size random Mistral Small 3.1 (24B, 48 GB in bf16) or Qwen2.5-VL (8B) would have to be saved to the
work folder (the GPU machine's disk is 64 GiB) and read by every mode's process, only to sit in host memory.
What the training does see of an encoder is its output: the stored states' shape, which the trainer checks
against the pipeline's encoder (``check_latents_match``) and which the transformer's text projection takes.
So the pipeline keeps the family's tiny encoder (its tokenizer, layer count and the layers the family reads)
with the reference encoder's hidden width; scripts/precompute_latents.py then writes the shards through the
product's own path (the format, the empty caption, the text layout tag), once per model and resolution.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
GIB = 2**30


def load_spec(models_file: str, name: str | None, device: str) -> tuple[str, dict]:
    """The named model of ``models_file`` (default: its ``defaults`` for the device), resolved (:func:`resolve`)."""
    import yaml

    models = yaml.safe_load(Path(models_file).read_text())
    name = name or models["defaults"]["cuda" if device == "cuda" else "cpu"]
    if name not in models or name == "defaults":
        known = ", ".join(k for k in models if k != "defaults")
        raise SystemExit(f"bench_memory: no model {name!r} in {models_file} (known: {known})")
    return name, resolve(name, models[name], models_file)


def resolve(name: str, spec: dict, where: str = "memory_models.yaml") -> dict:
    """``spec`` with ``net`` and ``components`` filled in from its ``reference`` (a no-op without one)."""
    if not spec.get("reference"):
        return spec
    from sd_training.families.reference_models import ENCODERS
    from sd_training.families.registry import FAMILIES

    family = FAMILIES[spec["family"]]
    refs = family.reference_models()
    if spec["reference"] not in refs:
        raise SystemExit(f"bench_memory: {where}: model {name}: reference {spec['reference']!r} is not one of "
                         f"{family.__name__}.reference_models() ({', '.join(refs)})")
    ref = refs[spec["reference"]]
    vae = dict(ref.vae)
    components = {"vae": {"class": vae.pop("_class_name"), "config": as_lists(vae)}}
    for component, encoder in zip(family.text_components, ref.encoders):
        cls, config = ENCODERS[encoder]
        components[component] = {"stand_in": encoder, "width": encoder_width(config)}
    return {**spec, "net": as_lists(ref.config), "net_class": ref.net_class, "components": components,
            "text_tokens": ref.text_tokens}


def as_lists(value):
    """Tuples as lists (a config that round-trips through JSON and OmegaConf)."""
    if isinstance(value, (list, tuple)):
        return [as_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: as_lists(v) for k, v in value.items()}
    return value


def encoder_width(config: dict) -> int:
    """The width of an encoder's hidden states (the language model's, for a vision-language model)."""
    text = config.get("text_config", config)
    return int(text.get("d_model") or text["hidden_size"])


_COUNTED: dict[str, int] = {}  # net_params by the net's config (a meta build of SDXL's UNet takes seconds)


def net_params(spec: dict) -> int | None:
    """Parameters of the spec's trained net, counted on the meta device (None: the tiny pipeline's)."""
    if not spec.get("net"):
        return None
    from sd_training.families.registry import FAMILIES
    from sd_training.memory.load import meta_module

    cls = spec.get("net_class") or FAMILIES[spec["family"]].net_class
    key = json.dumps([cls, spec["net"]], sort_keys=True)
    if key not in _COUNTED:
        _COUNTED[key] = sum(p.numel() for p in meta_module(spec["net"], cls).parameters())
    return _COUNTED[key]


def host_memory_needed(spec: dict) -> float:
    """GiB of host memory a mode's process needs to build the net: ``model.<net>.params`` builds it in fp32 on
    the host before moving it (components/transformer.py ``build_transformer``), plus 10 %."""
    n = net_params(spec)
    return 1.1 * 4 * n / GIB if n else 0.0


def host_memory_available() -> float | None:
    """MemAvailable of /proc/meminfo, GiB (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return None


# ----------------------------------------------------------------------------------------------
# The pipeline: the family's tiny one with full-size (or width-true stand-in) components
# ----------------------------------------------------------------------------------------------


def build_component(cls_name: str, config: dict):
    """A random-weight diffusers or transformers module of class ``cls_name`` from ``config``."""
    import diffusers
    import transformers

    cls = getattr(diffusers, cls_name, None) or getattr(transformers, cls_name)
    if hasattr(cls, "config_class") and not hasattr(cls, "from_config"):  # transformers: a Config object
        return cls(cls.config_class(**config))
    return cls(**config)


def stand_in_encoder(tiny: Path, cls_name: str, width: int):
    """The tiny encoder saved in ``tiny`` (class ``cls_name``) at hidden width ``width``: the same tokenizer,
    vocabulary, layer count and head size, so the family reads the same layers, at the reference encoder's
    width. Configs without an explicit head size keep the tiny one by scaling the head count (Qwen2.5-VL's
    multimodal RoPE sections are sized for it)."""
    import transformers

    cls = getattr(transformers, cls_name)
    config = cls.config_class.from_pretrained(tiny)
    text = getattr(config, "text_config", None) or config
    key = "d_model" if hasattr(text, "d_model") else "hidden_size"
    if key == "hidden_size" and getattr(text, "head_dim", None) is None:
        head = text.hidden_size // text.num_attention_heads
        if width % head:
            raise SystemExit(f"bench_memory: a {cls_name} stand-in of width {width} cannot keep heads of {head}")
        text.num_attention_heads = width // head
    setattr(text, key, width)
    vision = getattr(config, "vision_config", None)
    if vision is not None and hasattr(vision, "out_hidden_size"):  # its merger writes into the text width
        vision.out_hidden_size = width
    return cls(config)


def make_pipeline(spec: dict, out: Path) -> Path:
    """The family's tiny pipeline with the spec's components replaced by full-size random ones (or width-true
    stand-ins), saved once to ``out``."""
    import torch

    from sd_training.families.registry import make_tiny_pipeline

    if (out / "model_index.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_pipeline(tmp, family=spec["family"])
    index = json.loads((tmp / "model_index.json").read_text())
    for component, entry in (spec.get("components") or {}).items():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            if "stand_in" in entry:
                module = stand_in_encoder(tmp / component, index[component][1], int(entry["width"]))
            else:  # the tiny pipeline's tokenizers stay: their special token ids win over the spec's
                tiny = json.loads((tmp / component / "config.json").read_text())
                config = {**entry["config"], **{k: tiny[k] for k in TOKEN_IDS if k in tiny}}
                module = build_component(entry["class"], config)
        shutil.rmtree(tmp / component)
        module.save_pretrained(tmp / component)
        del module
    tmp.rename(out)
    return out


# ----------------------------------------------------------------------------------------------
# The batches
# ----------------------------------------------------------------------------------------------


def image_shards(work: Path, resolution: int, batch: int) -> str:
    """One shard of synthetic shape images at ``resolution`` (written once per resolution)."""
    from sd_training.data.synthetic import write_shapes_shards

    folder = work / f"shapes_{resolution}"
    if not folder.exists():
        write_shapes_shards(str(folder), n_samples=max(4, batch), n_shards=1, size=resolution)
    return str(sorted(folder.glob("*.tar"))[0])


def latent_shards(pipeline: Path, images: str, out: Path, resolution: int, device: str) -> str:
    """``images`` as latent shards with stored text (scripts/precompute_latents.py through ``pipeline``),
    written once per model and resolution (a complete folder is reused)."""
    info = out / "latents_info.json"
    if not (info.exists() and json.loads(info.read_text()).get("complete")):
        shutil.rmtree(out, ignore_errors=True)
        script = ROOT / "scripts" / "precompute_latents.py"
        loader = importlib.util.spec_from_file_location("precompute_latents", script)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
        summary = module.main(["--input", images, "--pipeline", str(pipeline), "--output", str(out),
                               "--text-embeddings", "--resolution", str(resolution), "--batch-size", "1",
                               "--workers", "0", "--device", device, "--no-progress"])
        if summary["shards_failed"] or not summary["complete"]:
            raise SystemExit(f"bench_memory: precompute_latents did not finish {out}: {summary}")
        release_device_memory()  # this process waits while the modes run: it keeps no VAE activations cached
    return str(sorted(out.glob("*.tar"))[0])


def release_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def batches(spec: dict, model: str, pipeline: Path, work: Path, resolution: int, batch: int, device: str) -> str:
    """The shard a mode's run reads, for the spec's ``data`` (images, or latents with stored text)."""
    images = image_shards(work, resolution, batch)
    data = spec.get("data", "images")
    if data == "images":
        return images
    if data == "latents":
        return latent_shards(pipeline, images, work / f"latents_{model}_{resolution}", resolution, device)
    raise SystemExit(f"bench_memory: model {model}: data {data!r} is not images or latents")
