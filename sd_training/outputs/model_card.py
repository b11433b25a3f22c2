"""The model card (``README.md``) of every export: a pipeline folder or a LoRA folder.

Made with ``huggingface_hub``'s :class:`ModelCard` / :class:`ModelCardData`: YAML metadata the Hub reads
(``base_model``, ``license``, ``tags``, ``library_name: diffusers``, ``pipeline_tag: text-to-image``), then
what was trained (family, target, adapter, precision, steps, images seen, global batch, learning rate and
schedule, the data sources with their weights and filter pass-rates), the run's last sample grid copied
beside the card (``samples.png``) and a how-to-load snippet. The body is a Jinja2 template
(``templates/model_card.md`` or ``experiment.model_card_template``) rendered in a sandbox with undefined names
as errors (:mod:`.card_template`; ``ModelCard.from_template`` renders a misspelt name as empty text), then
parsed by ``ModelCard``. Text from configs and data is escaped for Markdown (:mod:`.escape`).

The data figures are rank 0's loader counters as ``metrics.jsonl`` logged them (``data/...``, see
:mod:`sd_training.data.stats`) at the last log line up to the export's step. No network is used: a base
pipeline's license comes from its ``README.md`` when it is a local folder, or from huggingface_hub's cache.
Imports no torch (``scripts/push_to_hub.py`` uses :func:`export_kind` and :func:`for_repo`).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import yaml

from ..config import ConfigError
from ..config.schema import TrainConfig
from ..config.secrets import scrub
from . import card_template
from .escape import code_span, escape_tree, markdown, python_string
from .readers import MAX_YAML_BYTES, load_yaml, loads

CARD_FILE = "README.md"
SAMPLE_FILE = "samples.png"
TEMPLATE = Path(__file__).parent / "templates" / "model_card.md"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"  # adapters.LORA_FILE (diffusers' LORA_WEIGHT_NAME_SAFE)
KOHYA_WEIGHTS = "pytorch_lora_weights_kohya.safetensors"  # adapters.KOHYA_FILE
COMFY_WEIGHTS = "pytorch_lora_weights_comfyui.safetensors"  # adapters.COMFY_FILE (the families with ComfyUI names)
PIPELINE_INDEX = "model_index.json"
LICENSE_KEYS = ("license", "license_name", "license_link")  # "other" licenses name and link themselves
METRICS_TAIL = 2**20  # bytes of metrics.jsonl read first when looking for the last log line
CARD_METADATA = re.compile(r"^(\s*---[\r\n]+)([\S\s]*?)([\r\n]+---(\r\n|\n|$))")  # huggingface_hub's
HUB_CACHE_DIR = re.compile(r"models--([^/]+)--([^/]+)$")  # huggingface_hub's cache: models--org--name/snapshots/sha


@dataclass
class RunInfo:
    """What the cards of one run share (built once by ``RunOutputs``)."""

    cfg: TrainConfig
    family: str  # model.family's resolved name
    family_tags: tuple[str, ...]  # Family.card_tags
    net_name: str  # the trained module (unet, transformer, vae)
    net_source: str | None  # where it came from (sources.json's entry; "... (from scratch)")
    samples_tag: str  # what the grid shows (samples, reconstructions)
    global_batch: int
    world_size: int
    peak_lr: float  # the net's (or adapter's) peak learning rate, optimizer.scale_lr applied
    metrics: Path  # the run's metrics.jsonl

    @property
    def template(self) -> Path:
        return Path(self.cfg.experiment.model_card_template or TEMPLATE)


@dataclass
class ExportInfo:
    """One export folder's own facts."""

    folder: Path
    adapter: bool  # a LoRA folder (else a pipeline)
    weights: str  # raw | ema
    step: int
    images_seen: int
    grid: Path | None = None  # the sample grid of this export (None: none was made)
    grid_weights: str = "raw"  # the weights the grid was sampled from


# ------------------------------------------------------------------------------------------ base model

def base_model(cfg: TrainConfig, net_source: str | None) -> dict:
    """{name, load, revision, local, license...} of the pipeline the run starts from; {} when the trained net
    starts from scratch. ``name``: the hub id, or a local folder's name (its hub id when it is a snapshot in
    huggingface_hub's cache); ``load``: what ``from_pretrained`` is given."""
    if net_source is None or "from scratch" in net_source:
        return {}
    src = cfg.model.pretrained or net_source
    local = os.path.isdir(src)
    path = Path(src).resolve() if local else None
    name = src
    if local:
        hub = HUB_CACHE_DIR.search(str(path.parent.parent)) if path.parent.name == "snapshots" else None
        name = f"{hub.group(1)}/{hub.group(2)}" if hub else path.name
    base = {"name": name, "load": str(path) if local else src, "revision": cfg.model.revision, "local": local}
    base.update(_base_license(path / CARD_FILE if local else _cached_card(src, cfg.model.revision)))
    return base


def _cached_card(repo_id: str, revision: str | None) -> Path | None:
    """A hub model's README.md if huggingface_hub's cache holds it (never downloaded here)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, CARD_FILE, revision=revision)
    except Exception:  # an id the cache cannot hold (a malformed name): no license known
        return None
    return Path(found) if isinstance(found, str) else None


def _base_license(card_path: Path | None) -> dict:
    """The license keys of a base pipeline's card ({} when it has none or cannot be read). Its metadata is
    read with the bounded YAML reader (no aliases, no deep nesting): the base may be any folder."""
    if card_path is None or not card_path.is_file():
        return {}
    try:
        with open(card_path, encoding="utf-8", errors="replace") as fh:
            block = CARD_METADATA.match(fh.read(MAX_YAML_BYTES))
        data = load_yaml(block.group(2), str(card_path)) if block else None
    except (OSError, ValueError, yaml.YAMLError):  # a card that does not parse says nothing about the license
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: data[k] for k in LICENSE_KEYS if isinstance(data.get(k), str)}


# ------------------------------------------------------------------------------------------ the facts

def last_metrics(path: Path, step: int) -> dict:
    """The last log line (a row with ``loss``) of ``metrics.jsonl`` at or before ``step`` ({} if none). Read
    from the end, a growing tail at a time: a long run's file holds hundreds of MB and the row is near its end."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            tail = METRICS_TAIL
            while True:
                fh.seek(max(0, size - tail))
                lines = fh.read().splitlines()
                if size > tail:
                    lines = lines[1:]  # the first line of the tail may be cut
                for line in reversed(lines):
                    try:
                        r = loads(line)
                    except ValueError:  # a line cut by a kill, or nested too deep (readers.UnsafeFile)
                        continue
                    if isinstance(r, dict) and "loss" in r and isinstance(r.get("step"), int) and r["step"] <= step:
                        return r
                if tail >= size:
                    return {}
                tail *= 4
    except OSError:
        return {}


def _pct(x) -> str | None:
    return f"{100 * x:.1f}%" if isinstance(x, (int, float)) else None


def _ratio(num, den) -> str | None:
    return _pct(num / den) if isinstance(num, (int, float)) and isinstance(den, (int, float)) and den > 0 else None


def data_facts(cfg: TrainConfig, row: dict) -> dict:
    """The sources (name, path, weight, share of the samples seen, fraction passing their filters and
    checks), the filters with their pass-rates and the skip reasons, from the config and a metrics row."""
    p = cfg.dataset.params
    d = {k[len("data/"):]: v for k, v in row.items() if k.startswith("data/")}
    sources = []
    if p.sources:
        for entry in p.sources:
            name = str(entry.get("name", entry["path"]))
            pre = f"source/{name}/"
            sources.append({"name": name, "path": str(entry["path"]), "weight": f"{float(entry.get('weight', 1.0)):g}",
                            "share": _pct(d.get(pre + "share")),
                            "passed": _ratio(d.get(pre + "accepted"), d.get(pre + "samples_read"))})
    else:
        specs = [s.strip() for s in str(p.path).split("::") if s.strip()]
        read = d.get("samples_read")
        passed = _ratio(read - d.get("skipped_total", 0), read) if isinstance(read, (int, float)) else None
        for spec in specs:  # several '::' sources are read as one stream: one figure for all
            sources.append({"name": spec if len(specs) > 1 else "dataset", "path": spec,
                            "weight": "1" if len(specs) == 1 else "-", "share": None, "passed": passed})
    rules = dict(p.filters or {})
    for entry in p.sources or []:
        rules.update(entry.get("filters") or {})
    filters = [{"key": k[len("filter/"):-len("/pass_rate")], "rule": "", "pass_rate": _pct(v)}
               for k, v in sorted(d.items()) if k.startswith("filter/") and k.endswith("/pass_rate")]
    for flt in filters:
        flt["rule"] = str(rules.get(flt["key"], ""))
    skipped = sorted(((k[len("skipped/"):], int(v)) for k, v in d.items() if k.startswith("skipped/") and v),
                     key=lambda kv: -kv[1])
    return {"sources": sources, "filters": filters, "skipped": skipped,
            "type": cfg.dataset.type, "samples_read": d.get("samples_read")}


def adapter_text(cfg: TrainConfig) -> str:
    """``LoRA rank 16, alpha 16 on attention (+ text encoder: rank 8, alpha 8, attention)``."""
    a = cfg.model.adapter
    kind = "DoRA" if a.use_dora else {"lokr": "LoKr", "loha": "LoHa"}.get(a.type, "LoRA")
    # The module names and the regex are the user's text: escaped for the card's Markdown table.
    targets = (markdown(", ".join(a.target_modules)) if a.target_modules else
               f"layers matching {markdown(a.target_regex)}" if a.target_regex else f"the {a.targets} preset")
    text = f"{kind} rank {a.rank}, alpha {a.alpha if a.alpha is not None else a.rank:g} on {targets}"
    if a.dropout:
        text += f", dropout {a.dropout:g}"
    te = a.text_encoders
    if te.train:
        rank = te.rank or a.rank
        text += f"; text encoder(s): rank {rank}, alpha {te.alpha if te.alpha is not None else rank:g}, {te.targets}"
    return text


def training_rows(run: RunInfo, export: ExportInfo, row: dict) -> list[tuple[str, str]]:
    """(label, value) rows of the card's Training table."""
    cfg = run.cfg
    m, o, s = cfg.model, cfg.optimizer, cfg.lr_scheduler
    total = -(-int(cfg.dataset.params.num_examples_to_see) // run.global_batch)
    accum = run.global_batch // max(cfg.system.batch_size * run.world_size, 1)
    trained = f"{run.net_name}: " + (adapter_text(cfg) if export.adapter else "all weights")
    precision = "fp32" if m.mixed_precision == "no" else (
        f"{m.mixed_precision} mixed precision (autocast; trained weights in fp32)")
    if m.fp8:
        precision += "; float8 block Linear layers (torchao)"
    schedule = f"{s.scheduler}, {s.params.warmup_length} warmup steps"
    if s.params.min_lr_ratio:
        schedule += f", down to {s.params.min_lr_ratio:g} x peak"
    lr = f"{run.peak_lr:.3g} peak ({o.name}), {schedule}"
    if isinstance(row.get("lr"), (int, float)):
        lr += f"; {row['lr']:.3g} at step {row['step']}"
    weights = "EMA of the weights" if export.weights == "ema" else "the trained weights (no EMA)"
    if export.weights == "ema":
        weights += f" (decay {m.ema.decay:g})"
    extra = []
    if export.adapter and (m.adapter.export_merged or m.adapter.export_kohya):
        extra = [("also here", "; ".join(
            ["merged/: the full pipeline with the adapter merged in (DiffusionPipeline.from_pretrained)"] *
            m.adapter.export_merged + [kohya_line(export.folder)] * m.adapter.export_kohya))]
    return [
        ("family", run.family), ("trained", trained), ("weights", weights), ("precision", precision),
        ("optimizer steps", f"{export.step} of {total}"), ("images seen", f"{export.images_seen}"),
        ("global batch", f"{run.global_batch} ({cfg.system.batch_size} per device x {run.world_size} device(s) x "
                         f"{accum} accumulation)"),
        ("learning rate", lr), ("resolution", f"{cfg.dataset.params.resolution} px"),
    ] + extra


def kohya_line(folder: Path) -> str:
    """The export's ``model.adapter.export_kohya`` file: the ComfyUI-named copy where the export holds one."""
    if (Path(folder) / COMFY_WEIGHTS).is_file():
        return f"{COMFY_WEIGHTS}: the layer names ComfyUI's LoRA loader maps for this model"
    return f"{KOHYA_WEIGHTS}: kohya key names (ComfyUI, A1111)"


def snippet(run: RunInfo, export: ExportInfo, base: dict) -> str:
    """Python that loads the export (a LoRA: onto its base pipeline) and makes one image."""
    e = run.cfg.experiment
    here = _quoted(Path(export.folder).resolve())
    lines = ["import torch", "from diffusers import DiffusionPipeline", ""]
    if export.adapter:
        where = "the base pipeline" + (" (a local folder when trained: its Hub id once published)" if base.get("local")
                                       else "")
        rev = f", revision={_quoted(base['revision'])}" if base.get("revision") else ""
        lines += [f"pipe = DiffusionPipeline.from_pretrained({_quoted(base.get('load', ''))}{rev})  # {where}",
                  *adapter_lines(run, Path(export.folder).resolve())]
    else:
        lines += [f"pipe = DiffusionPipeline.from_pretrained({here})  # this folder, or its Hub repo id once pushed"]
    prompt = (list(e.sample_prompts or []) or ["a photo of a cat"])[0]
    res = e.sample_resolution or run.cfg.dataset.params.resolution
    lines += ['pipe.to("cuda" if torch.cuda.is_available() else "cpu")',
              f"image = pipe({_quoted(prompt)}, height={res}, width={res}, num_inference_steps={e.sample_steps}, "
              f"guidance_scale={e.sample_guidance_scale:g}).images[0]",
              'image.save("sample.png")']
    return "\n".join(lines)


def adapter_lines(run: RunInfo, folder: Path) -> list[str]:
    """The snippet's lines that put the export's adapter on ``pipe``: a LoRA with the pipeline's
    ``load_lora_weights``; a LoKr with the net's ``load_lora_adapter`` (diffusers reads LoKr files on every model;
    of the pipelines only Z-Image's and FLUX.2's ``load_lora_weights`` take them); a LoHa, which no diffusers
    loader reads, with peft from the file's adapter config."""
    kind, net, here = run.cfg.model.adapter.type, run.net_name, _quoted(folder)
    if kind == "lora":
        return [f"pipe.load_lora_weights({here})  # this folder, or its Hub repo id once pushed"]
    if kind == "lokr":
        return [f"pipe.{net}.load_lora_adapter({here}, weight_name={_quoted(LORA_WEIGHTS)}, prefix={_quoted(net)})"
                "  # this folder, or its Hub repo id once pushed"]
    file = _quoted(folder / LORA_WEIGHTS)
    return ["import json",
            "from peft import LoHaConfig, set_peft_model_state_dict",
            "from safetensors import safe_open",
            "from safetensors.torch import load_file",
            f"file = {file}  # in this folder: a LoHa has no diffusers loader",
            "with safe_open(file, 'pt') as f:",
            "    config = json.loads(f.metadata()['lora_adapter_metadata'])",
            f"head = {_quoted(net + '.')}",
            f"pipe.{net}.add_adapter(LoHaConfig(**{{k[len(head):]: v for k, v in config.items() if k.startswith(head)}}))",
            f"set_peft_model_state_dict(pipe.{net}, {{k[len(head):]: v for k, v in load_file(file).items()}})"]


def _quoted(text) -> str:
    """A Python string literal in double quotes that cannot close the card's code fence."""
    return python_string(text)


def card_data(run: RunInfo, export: ExportInfo, base: dict):
    """The card's YAML metadata as a :class:`ModelCardData`."""
    from huggingface_hub import ModelCardData

    license_keys = {k: base[k] for k in LICENSE_KEYS if base.get(k)}
    if run.cfg.experiment.model_card_license:
        license_keys = {"license": run.cfg.experiment.model_card_license}
    tags = ["text-to-image", "diffusers", *(["lora"] if export.adapter else []),
            *(run.family_tags or (run.family,)), "sd-training"]
    return ModelCardData(base_model=base.get("name"), library_name="diffusers", pipeline_tag="text-to-image",
                         tags=list(dict.fromkeys(tags)), **license_keys)


def template_vars(run: RunInfo, export: ExportInfo) -> dict:
    """Everything the template sees (see templates/model_card.md). Text from the config and the data
    (run name, prompts, source names, paths, filter rules, the base's name) is escaped for where it lands:
    Markdown text, a code span (paths, rules), a Python string (the snippet); the metadata is YAML dumped
    by huggingface_hub. A template of one's own gets the same escaped values."""
    base = base_model(run.cfg, run.net_source)
    row = last_metrics(run.metrics, export.step)
    data = data_facts(run.cfg, row)
    what = f"A {'LoRA adapter' if export.adapter else 'diffusers pipeline'} ({run.family})"
    summary = (f"{what} trained with sd-training for {export.step} optimizer steps ({export.images_seen} images)"
               + (f" from [{markdown(base['name'])}](https://huggingface.co/{quote(base['name'], safe='/')})"
                  if base and not base["local"] else f" from {markdown(base['name'])}" if base else " from scratch")
               + ".")
    sample = None
    if export.grid is not None:
        sample = {"file": SAMPLE_FILE,
                  "caption": f"{run.samples_tag.capitalize()} at step {export.step} ({export.grid_weights} weights): "
                             + "; ".join(markdown(p) for p in run.cfg.experiment.sample_prompts or [])}
    note = (f"Data figures: rank 0's loader counters at step {row['step']} (metrics.jsonl)." if row else
            "No data figures: the run had logged no metrics by this export.")
    facts = {"step": export.step, "images_seen": export.images_seen, "global_batch": run.global_batch,
             "peak_lr": run.peak_lr, "lr_scheduler": run.cfg.lr_scheduler.scheduler, "family": run.family,
             "weights": export.weights, "adapter": export.adapter, "metrics_step": row.get("step"),
             "data": escape_tree(data), "base": escape_tree(base)}
    sources = [{**src, "name": markdown(src["name"]), "path": code_span(src["path"])} for src in data["sources"]]
    filters = [{**flt, "key": markdown(flt["key"]), "rule": code_span(flt["rule"])} for flt in data["filters"]]
    return {"card_data": card_data(run, export, base),
            "title": f"{markdown(run.cfg.experiment.name)} ({export.weights} weights)",
            "summary": summary, "adapter": export.adapter, "snippet": snippet(run, export, base), "sample": sample,
            "training": training_rows(run, export, row),  # generated text (adapter_text escapes the user's part)
            "sources": sources, "filters": filters, "skipped": [(markdown(r), n) for r, n in data["skipped"]],
            "data_note": note, "facts": facts}


# ------------------------------------------------------------------------------------------ rendering

def render(template: Path, variables: dict):
    """The :class:`ModelCard` of ``variables`` through ``template``, rendered in Jinja2's immutable sandbox
    (:mod:`.card_template`); a ConfigError names the template file (and line) when it does not read,
    render, stays inside the sandbox or gives a card with the metadata the Hub needs."""
    from huggingface_hub import ModelCard

    key = "experiment.model_card_template"
    template = Path(template).resolve()
    data = variables["card_data"]
    text = card_template.render(template, {**variables, "card_data": data.to_yaml()}, key)
    # Every value was escaped for Markdown already (template_vars); what a custom template may still
    # carry (a literal) is scrubbed as the logs are: ${oc.env:NAME} for a variable's value, <redacted>.
    text = scrub(text)
    try:
        card = ModelCard(text)
    except ValueError as e:
        raise ConfigError(f"'{key}': the model card template {template} renders a card whose metadata does not "
                          f"parse ({e}); keep its first lines '---', '{{{{ card_data }}}}', '---'") from None
    missing = [k for k in ("library_name", "pipeline_tag", "tags") if not getattr(card.data, k, None)]
    if missing:
        raise ConfigError(f"'{key}': the model card template {template} renders a card without {', '.join(missing)} "
                          f"in its metadata; keep its first lines '---', '{{{{ card_data }}}}', '---'")
    return card


def check_template(run: RunInfo, folder: Path) -> None:
    """Render the run's template once for a step-0 export of its kind into ``folder`` (at start-up: a broken
    template stops the run before it trains, not at its first export)."""
    export = ExportInfo(folder=folder, adapter=run.cfg.model.adapter.enabled, weights="raw", step=0, images_seen=0)
    render(run.template, template_vars(run, export))


def write(run: RunInfo, export: ExportInfo) -> Path:
    """``README.md`` (and ``samples.png``) into the export folder, each written whole then renamed."""
    folder = Path(export.folder)
    variables = template_vars(run, export)
    card = render(run.template, variables)
    if export.grid is not None:
        _replace(folder / SAMPLE_FILE, lambda tmp: shutil.copyfile(export.grid, tmp))
    _replace(folder / CARD_FILE, lambda tmp: tmp.write_text(str(card), encoding="utf-8"))
    return folder / CARD_FILE


def _replace(path: Path, write_to) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write_to(tmp)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ publishing

def export_kind(folder: Path) -> str | None:
    """'pipeline' (a model_index.json), 'lora' (diffusers' LoRA weights file) or None."""
    folder = Path(folder)
    if (folder / PIPELINE_INDEX).is_file():
        return "pipeline"
    if (folder / LORA_WEIGHTS).is_file():
        return "lora"
    return None


def for_repo(card_text: str, folder: Path, repo_id: str) -> tuple[str, int]:
    """The card with the loading snippet's local path of ``folder`` replaced by ``repo_id`` (quoted as the
    snippet quotes it); returns (text, replacements)."""
    here = _quoted(Path(folder).resolve())
    return card_text.replace(here, _quoted(repo_id)), card_text.count(here)
