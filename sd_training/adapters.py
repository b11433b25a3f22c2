"""``model.adapter``: peft LoRA / DoRA / LoKr / LoHa adapters trained instead of the full net (every family).

The family says which layers its presets adapt (``Family.adapter_presets``: full-match regular expressions
over the net's layer names; ``Family.text_adapter_presets`` for its text encoders) and which text encoders
may carry one (``Family.adapter_text_encoders``). This module resolves the targets (refusing targets that
match nothing and ranks larger than a layer), injects the adapters with diffusers' / transformers'
``add_adapter`` (peft's ``LoraConfig``, as diffusers' LoRA training examples do), freezes everything else
(the base weights in the training precision), loads ``model.adapter.init_from``, makes the optimizer's
groups and writes exports in diffusers' LoRA format (the pipeline class's ``save_lora_weights``:
``pytorch_lora_weights.safetensors``, loadable with ``pipe.load_lora_weights(folder)``), optionally with the
merged pipeline beside it; with ``model.adapter.export_kohya`` also a copy with kohya's names (UNet families)
or ComfyUI's (the families with ``Family.comfy_lora_names``: ``outputs.comfy_lora``). Names no family: the
pipeline class, the net's and the encoders' names come from the family."""

from __future__ import annotations

import copy
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ConfigError
from .config.patterns import full_matches
from .config.schema import TrainConfig
from .optim import param_groups
from .outputs import comfy_lora, lycoris_file
from .run.run_dir import replace_dir

log = logging.getLogger(__name__)

LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
KOHYA_FILE = "pytorch_lora_weights_kohya.safetensors"  # model.adapter.export_kohya (diffusers' examples' name)
COMFY_FILE = "pytorch_lora_weights_comfyui.safetensors"  # model.adapter.export_kohya where the family has ComfyUI names
MERGED = "merged"  # the merged pipeline's folder inside an export (model.adapter.export_merged)
ADAPTABLE = (torch.nn.Linear, torch.nn.Conv2d)


@dataclass
class Adapters:
    """The adapters of one run: the net's and the text encoders' (by the family's names)."""

    net: torch.nn.Module
    net_name: str
    encoders: dict[str, torch.nn.Module]  # text encoders carrying a LoRA, trained with the net
    pipeline_class: str  # the diffusers pipeline whose save_lora_weights writes exports
    kohya_prefixes: dict[str, str]  # component -> its kohya key prefix (Family.kohya_lora_prefixes)
    comfy_names: comfy_lora.ComfyLoraNames | None = None  # the net's ComfyUI names (Family.comfy_lora_names)

    def param_groups(self, cfg: TrainConfig, peak_lr: float, lr_scale: float) -> list[dict]:
        """The adapter's groups (``model.adapter.learning_rate`` / ``weight_decay``, else the optimizer's) and
        each text encoder's (``model.adapter.text_encoders.learning_rate``, else the adapter's)."""
        a, o = cfg.model.adapter, cfg.optimizer
        lr = a.learning_rate * lr_scale if a.learning_rate is not None else peak_lr
        wd = a.weight_decay if a.weight_decay is not None else o.params.weight_decay
        groups = [dict(g, name=self.net_name) for g in param_groups(self.net, wd, o.no_decay_norm_and_bias, lr)]
        text_lr = a.text_encoders.learning_rate * lr_scale if a.text_encoders.learning_rate is not None else lr
        for name, encoder in self.encoders.items():
            groups += [dict(g, name=name) for g in param_groups(encoder, wd, o.no_decay_norm_and_bias, text_lr)]
        return groups


def enabled(cfg: TrainConfig) -> bool:
    return cfg.model.adapter.enabled


# ---------------------------------------------------------------------------------------------- targets

def _layer_size(module: torch.nn.Module) -> tuple[int, int]:
    """(inputs, outputs) of a layer: the largest useful rank is the smaller."""
    if isinstance(module, torch.nn.Conv2d):
        kh, kw = module.kernel_size
        return module.in_channels * kh * kw // module.groups, module.out_channels
    return module.in_features, module.out_features


def resolve_targets(module: torch.nn.Module, presets: dict[str, str], preset: str, names: list[str],
                    regex: str | None, key: str, what: str) -> list[str]:
    """The full names of the Linear / Conv2d layers of ``module`` to adapt: ``names`` (each a layer name or
    its dotted suffix), else ``regex`` (full match), else the family's ``preset``. A ConfigError names
    ``key`` when nothing (or an explicit name) matches no adaptable layer."""
    layers = {n: m for n, m in module.named_modules() if isinstance(m, ADAPTABLE)}
    if names:
        found = []
        for target in names:
            hits = [n for n in layers if n == target or n.endswith("." + target)]
            if not hits:
                raise ConfigError(f"'{key}.target_modules' entry {target!r} matches no Linear or Conv2d layer of "
                                  f"the {what} (e.g. {', '.join(list(layers)[:4])})")
            found += [n for n in hits if n not in found]
        return found
    if regex is None:
        if preset not in presets:
            raise ConfigError(f"'{key}.targets={preset}': the {what} has no such preset (it has "
                              f"{', '.join(presets) or 'none'}): name the layers in {key}.target_modules")
        regex = presets[preset]
    found = full_matches(regex, list(layers), f"{key}.target_regex" if regex is not presets.get(preset) else
                         f"{key}.targets={preset}")
    if not found:
        source = f"'{key}.target_regex' {regex!r}" if regex is not presets.get(preset) else f"'{key}.targets={preset}'"
        raise ConfigError(f"{source} matches no Linear or Conv2d layer of the {what} (e.g. "
                          f"{', '.join(list(layers)[:4])})")
    return found


def check_rank(module: torch.nn.Module, targets: list[str], rank: int, key: str, what: str) -> None:
    """A rank larger than a target layer's smaller side is refused (the update could not use it)."""
    layers = dict(module.named_modules())
    for name in targets:
        n_in, n_out = _layer_size(layers[name])
        if rank > min(n_in, n_out):
            raise ConfigError(f"'{key}' {rank} is larger than the {what}'s layer {name} ({n_in} inputs, {n_out} "
                              f"outputs): use a rank <= {min(n_in, n_out)} or leave that layer out of the targets")


def lora_config(targets: list[str], rank: int, alpha: float | None, a):
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=alpha if alpha is not None else rank, lora_dropout=a.dropout, use_dora=a.use_dora,
        init_lora_weights=True if a.init == "default" else a.init,
        # One full-match pattern of the exact names (a list would also match longer names ending in one).
        target_modules="^(" + "|".join(re.escape(t) for t in targets) + ")$",
    )


def net_config(targets: list[str], a):
    """peft's config of ``model.adapter.type`` for the net: LoRA (``lora_config``), LoKr or LoHa (peft's
    LyCORIS ports, whose weights and arithmetic are LyCORIS'); alpha / rank scales the update of each."""
    if a.type == "lora":
        return lora_config(targets, a.rank, a.alpha, a)
    from peft import LoHaConfig, LoKrConfig

    common = dict(r=a.rank, alpha=a.alpha if a.alpha is not None else a.rank,
                  target_modules="^(" + "|".join(re.escape(t) for t in targets) + ")$")
    if a.type == "lokr":
        return LoKrConfig(decompose_factor=a.lokr_factor, decompose_both=a.decompose_both, **common)
    return LoHaConfig(**common)


def layer_params(n_in: int, n_out: int, rank: int, kind: str, factor: int = -1, decompose_both: bool = False,
                 kernel: int = 1) -> int:
    """The parameters of one adapter layer on a Linear ``n_in`` -> ``n_out`` (a Conv2d: ``n_in`` input channels,
    ``kernel`` = k x k), as peft makes them (for the memory plan). LoRA: rank x (n_in x kernel + n_out) (DoRA adds
    n_out). LoHa: 2 x rank x (n_in x kernel + n_out). LoKr: n_out = a x b and n_in = c x d (peft's
    ``factorization`` with ``factor``); the left factor a x c whole (rank x (a + c) with ``decompose_both`` when
    rank < max(a, c) / 2), the right one b x d x kernel whole when rank >= max(b, d) / 2, else rank x (b + d x kernel)."""
    if kind == "lora":
        return rank * (n_in * kernel + n_out)
    if kind == "loha":
        return 2 * rank * (n_in * kernel + n_out)
    from peft.tuners.lokr.layer import factorization

    c, d = factorization(n_in, factor)
    a, b = factorization(n_out, factor)
    left = rank * (a + c) if decompose_both and rank < max(a, c) / 2 else a * c
    right = b * d * kernel if rank >= max(b, d) / 2 else rank * (b + d * kernel)
    return left + right


# ---------------------------------------------------------------------------------------------- apply

# The names of an adapter's own parameters hold its tuner's prefix (peft's LoraModel / LoKrModel / LoHaModel.prefix)
PREFIXES = {"LORA": "lora_", "LOKR": "lokr_", "LOHA": "hada_"}


def adapter_prefix(module: torch.nn.Module) -> str:
    """The prefix of the parameter names of ``module``'s peft adapter ("lora_", "lokr_" or "hada_")."""
    return PREFIXES[module.peft_config["default"].peft_type.value]


def inject(module: torch.nn.Module, config) -> int:
    """``add_adapter`` (diffusers' and transformers' models), the base frozen, the adapter trained in fp32.
    Returns the adapter's parameter count."""
    module.requires_grad_(False)
    module.add_adapter(config)
    trained = [p for n, p in module.named_parameters() if PREFIXES[config.peft_type.value] in n]
    for p in trained:
        p.data = p.data.float()
        p.requires_grad_(True)
    return sum(p.numel() for p in trained)


def apply(cfg: TrainConfig, family, base_dtype: torch.dtype | None) -> Adapters:
    """:func:`_apply` with the adapter's initial weights drawn from the run's seed (the caller's RNG state is
    left as it was): every rank starts from the same adapter, which FSDP2, unlike DDP, does not broadcast."""
    cuda = [family.device.index or 0] if family.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(family.seed)
        return _apply(cfg, family, base_dtype)


def _apply(cfg: TrainConfig, family, base_dtype: torch.dtype | None) -> Adapters:
    """Adapters on the family's net (and text encoders), from ``model.adapter``; the net's base weights cast
    to ``base_dtype`` (the training precision; None: kept as they are) before the adapter is added."""
    a, net = cfg.model.adapter, family.net
    targets = resolve_targets(net, family.adapter_presets, a.targets, list(a.target_modules), a.target_regex,
                              "model.adapter", family.net_name)
    if a.type != "lokr":  # a LoKr rank may exceed a side: its factors are then kept whole
        check_rank(net, targets, a.rank, "model.adapter.rank", family.net_name)
    if a.export_kohya and family.comfy_lora_names is not None:  # its file names every target: refused before any work
        comfy_lora.check_layers(family.comfy_lora_names, net, targets, "model.adapter.export_kohya", family.net_name,
                                a.type)
    total = sum(p.numel() for p in net.parameters())
    if base_dtype is not None and a.base_quantization == "none":  # a quantised base is already in it
        net.to(base_dtype)
    trained = inject(net, net_config(targets, a))
    lines = [f"{family.net_name}: {len(targets)} layers, {trained:,} parameters"]
    encoders = {}
    if a.text_encoders.train:
        t = a.text_encoders
        candidates = family.adapter_text_encoders()
        if not candidates:
            raise ConfigError(f"'model.adapter.text_encoders.train': the {family.name} family has no text encoder "
                              "that takes a LoRA: set it to false")
        rank = t.rank or a.rank
        for name, encoder in candidates.items():
            names = resolve_targets(encoder, family.text_adapter_presets, t.targets, [], None,
                                    "model.adapter.text_encoders", name)
            check_rank(encoder, names, rank, "model.adapter.text_encoders.rank", name)
            total += sum(p.numel() for p in encoder.parameters())
            n = inject(encoder, lora_config(names, rank, t.alpha, a))
            trained += n
            lines.append(f"{name}: {len(names)} layers, {n:,} parameters")
            encoders[name] = encoder
    log.info("model.adapter: %s rank %d%s on %s; %s trainable parameters, %.3f%% of %s", a.type, a.rank,
             " (DoRA)" if a.use_dora else "", "; ".join(lines), f"{trained:,}", 100.0 * trained / max(total, 1),
             f"{total:,}")
    adapters = Adapters(net, family.net_name, encoders, family.pipeline_classes[0], dict(family.kohya_lora_prefixes),
                        family.comfy_lora_names)
    if a.export_kohya:
        check_export_kohya(cfg, type(family), list(encoders))
    if a.init_from:
        load_lora(adapters, a.init_from)
    return adapters


def check_export_kohya(cfg: TrainConfig, family_class, encoders: list[str] | None = None) -> None:
    """``model.adapter.export_kohya`` against the family (at config load, ``encoders`` None: the text encoders
    ``model.adapter.text_encoders.train`` asks for): refused where its file cannot hold every adapted module,
    naming the key. The ComfyUI names of its layers are checked on the meta device at load
    (``configure.check_comfy_names``) and again when the adapters are made (``comfy_lora.check_layers``)."""
    a = cfg.model.adapter
    if not (a.enabled and a.export_kohya):
        return
    name, net = family_class.name, family_class.net_name
    if family_class.comfy_lora_names is not None:
        if a.text_encoders.train:
            raise ConfigError(f"'model.adapter.export_kohya': the {name} family's ComfyUI file holds the {net}'s LoRA "
                              "only (its names are the original checkpoint's), not a text encoder's: set "
                              "model.adapter.text_encoders.train=false or model.adapter.export_kohya=false")
        return
    prefixes = family_class.kohya_lora_prefixes
    if a.type != "lora" and net not in prefixes:  # a LyCORIS file by ComfyUI's lycoris_ names (outputs.lycoris_file)
        return
    outside = [net] if net not in prefixes else [e for e in encoders or [] if e not in prefixes]
    if outside:
        raise ConfigError(f"'model.adapter.export_kohya': the {name} family's {outside[0]} has no kohya key "
                          "names in diffusers' converter (UNets and their CLIPs only) and no ComfyUI names here; set "
                          f"it to false: the diffusers file {LORA_FILE} is what ComfyUI (which maps these diffusers "
                          "names itself) and diffusers load for this family")


# ---------------------------------------------------------------------------------------------- init_from

def _lora_file(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / LORA_FILE
    if not p.is_file():
        raise ConfigError(f"'model.adapter.init_from': {p} does not exist (a folder holding {LORA_FILE}, as exports "
                          "and diffusers' save_lora_weights write, or that file)")
    return p


def check_lora_file(path: str) -> Path:
    """The LoRA file of ``model.adapter.init_from`` when it is a whole safetensors file: its 8-byte header
    length, a JSON header of tensors, and every tensor's bytes within the file; else a ``ConfigError`` naming
    the key, the file and what is wrong (a copy cut short, another format), not safetensors' bare error."""
    import json
    import struct

    file = _lora_file(path)
    size = file.stat().st_size
    problem = None
    with open(file, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or n < 2 or n > 100 * 2**20:
            problem = "not a safetensors file (its first 8 bytes are not a header length)"
        elif 8 + n > size:
            problem = f"cut short: {size:,} of at least {8 + n:,} bytes (its header alone is {n:,})"
        else:
            try:
                header = json.loads(fh.read(n))
                ends = [int(e["data_offsets"][1]) for k, e in header.items() if k != "__metadata__"]
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                problem, ends = "not a safetensors file (its header is not safetensors' JSON)", []
            if not problem and 8 + n + max(ends, default=0) > size:
                problem = f"cut short: {size:,} of {8 + n + max(ends):,} bytes"
    if problem:
        raise ConfigError(f"'model.adapter.init_from': {file} is {problem}: copy it again, or point init_from at a "
                          f"folder holding {LORA_FILE} (an export of a LoRA run)")
    return file


def load_lora(adapters: Adapters, path: str) -> None:
    """A diffusers-format LoRA file into the adapters: every key must find its layer with the same shape, and
    every adapter layer must be in the file (made for another family, base, rank or targets: refused)."""
    from diffusers.utils import (
        convert_state_dict_to_diffusers,
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )
    from peft import set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    file = check_lora_file(path)
    state = load_file(str(file))
    modules = {adapters.net_name: adapters.net, **adapters.encoders}
    unknown = [k for k in state if k.split(".", 1)[0] not in modules]
    if unknown:
        raise ConfigError(f"'model.adapter.init_from': {file} holds {unknown[0]!r}, for a component this run has no "
                          f"adapter on (it adapts {', '.join(modules)}): a LoRA of another family or settings")
    for name, module in modules.items():
        part = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
        if adapter_prefix(module) == "lora_":  # LoKr / LoHa files hold peft's own names: read as they are
            part = (convert_unet_state_dict_to_peft(part) if name == adapters.net_name
                    else convert_state_dict_to_peft(convert_state_dict_to_diffusers(part)))
        want = get_peft_model_state_dict(module)
        missing = sorted(set(want) - set(part))
        if missing:
            raise ConfigError(f"'model.adapter.init_from': {file} has no {name} weights for {missing[0]!r} ("
                              f"{len(missing)} of {len(want)} missing): made with other targets, another model.adapter.type "
                              "or for another base")
        for k, v in part.items():
            if k not in want or want[k].shape != v.shape:
                got = "no such layer" if k not in want else f"shape {tuple(want[k].shape)}"
                raise ConfigError(f"'model.adapter.init_from': {file}'s {name}.{k} {tuple(v.shape)} does not fit this "
                                  f"run ({got}): another family, base, rank or target set")
        result = set_peft_model_state_dict(module, part, adapter_name="default")
        if getattr(result, "unexpected_keys", None):
            raise ConfigError(f"'model.adapter.init_from': {file}'s {name} keys {result.unexpected_keys[:2]} were not "
                              "loaded: another family or base")
    log.info("model.adapter.init_from: the adapters continue from %s", file)


# ---------------------------------------------------------------------------------------------- exports

def lora_layers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights in peft's naming (``lora_A`` / ``lora_B``), which every diffusers LoRA loader reads
    (diffusers' SD3 / Flux examples save it so; its older ``lora.down`` naming is lost on the SD3 loader)."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(module)


def save_lora(adapters: Adapters, net: torch.nn.Module, out: Path) -> Path:
    """``out/pytorch_lora_weights.safetensors`` via the pipeline class's ``save_lora_weights`` (the adapter
    configs as its metadata, so rank, alpha and DoRA load as trained)."""
    import diffusers

    modules = {adapters.net_name: net, **adapters.encoders}
    kwargs = {}
    for name, module in modules.items():
        kwargs[f"{name}_lora_layers"] = lora_layers(module)
        kwargs[f"{name}_lora_adapter_metadata"] = module.peft_config["default"].to_dict()
    getattr(diffusers, adapters.pipeline_class).save_lora_weights(str(out), **kwargs)
    return out / LORA_FILE


def save_kohya(adapters: Adapters, lora_file: Path) -> Path:
    """The diffusers LoRA file rewritten with kohya's key names (``lora_unet_down_blocks_0_..lora_down.weight``,
    ``.alpha``), as diffusers' DreamBooth LoRA examples write it for AUTOMATIC1111 / ComfyUI. diffusers'
    converter writes every ``alpha`` as the rank; here each layer gets its adapter's own alpha."""
    from diffusers.utils import convert_all_state_dict_to_peft, convert_state_dict_to_kohya
    from safetensors.torch import load_file, save_file

    kohya = convert_state_dict_to_kohya(convert_all_state_dict_to_peft(load_file(str(lora_file))))
    modules = {adapters.net_name: adapters.net, **adapters.encoders}
    prefixes = adapters.kohya_prefixes
    alphas = {prefixes[name]: float(module.peft_config["default"].lora_alpha) for name, module in modules.items()}
    name_of = {prefix: name for name, prefix in prefixes.items()}
    named = {}
    for key, value in kohya.items():
        prefix = next(p for p in alphas if key.startswith(p))
        if key.endswith(".alpha"):
            value = torch.tensor(alphas[prefix])
        if name_of[prefix] != adapters.net_name and not key.startswith(prefix + "text_model_"):
            # transformers 5's CLIPTextModel has no ``text_model`` level; kohya's names (and A1111's, ComfyUI's) do
            key = prefix + "text_model_" + key[len(prefix):]
        named[key] = value.contiguous()
    out = lora_file.with_name(KOHYA_FILE)
    save_file(named, str(out))
    return out


def save_comfy(adapters: Adapters, net: torch.nn.Module, lora_file: Path) -> Path:
    """The diffusers LoRA file's net part rewritten with the original checkpoint's layer names, as ComfyUI
    loads it and diffusers' converter reads it back (``outputs.comfy_lora``); each layer's scale from its
    peft layer (alpha / rank)."""
    from safetensors.torch import load_file, save_file

    head, down, up = adapters.net_name + ".", ".lora_A.weight", ".lora_B.weight"
    state = load_file(str(lora_file))
    scales = {n: float(m.scaling["default"]) for n, m in net.named_modules()
              if isinstance(getattr(m, "scaling", None), dict) and "default" in m.scaling}
    lora = {k[len(head):-len(down)]: (v, state[k[:-len(down)] + up], scales[k[len(head):-len(down)]])
            for k, v in state.items() if k.startswith(head) and k.endswith(down)}
    out = lora_file.with_name(COMFY_FILE)
    save_file(comfy_lora.comfy_state(adapters.comfy_names, lora), str(out))
    return out


def save_lycoris(adapters: Adapters, net: torch.nn.Module, lora_file: Path) -> Path:
    """A LoKr / LoHa export's copy for ComfyUI and kohya loaders (``outputs.lycoris_file``): LyCORIS' tensors under
    kohya's names (UNet families, ``pytorch_lora_weights_kohya.safetensors``) or those ComfyUI maps for the
    family (``pytorch_lora_weights_comfyui.safetensors``)."""
    how = lycoris_file.style(adapters.net_name, adapters.kohya_prefixes, adapters.comfy_names)
    out = lora_file.with_name(KOHYA_FILE if how == "kohya" else COMFY_FILE)
    return lycoris_file.save(net, out, how, adapters.kohya_prefixes.get(adapters.net_name, ""), adapters.comfy_names)


def merged_copy(net: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``net`` with the adapter merged into fp32 weights and the peft layers gone."""
    merged = copy.deepcopy(net).float()
    merged.fuse_lora()
    merged.unload_lora()
    return merged


def export(adapters: Adapters, family, net: torch.nn.Module, out: Path, merged: bool, kohya: bool = False) -> dict:
    """An export folder ``out`` (written atomically): the LoRA file, with ``kohya`` its kohya- or ComfyUI-named
    copy, and with ``merged`` the full pipeline with the adapter merged in ``out/merged`` (the family's own export)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    lora_file = save_lora(adapters, net, tmp)
    if kohya and adapter_prefix(net) != "lora_":
        save_lycoris(adapters, net, lora_file)
    elif kohya and adapters.comfy_names is not None:
        save_comfy(adapters, net, lora_file)
    elif kohya:
        save_kohya(adapters, lora_file)
    metrics = {}
    if merged:
        metrics = family.export(merged_copy(net), tmp / MERGED) or {}
    replace_dir(tmp, out)
    return metrics
