"""The run's config, loaded and checked: the schema's rules (``config.loading.parse``), then every section
owner's checks, then what the config asks of this machine. This layer sits above ``config/`` (the ground
floor, which imports nothing of ours) and calls the owners.

The owners check what needs their code: the objective its loss, the text-encoder module its encoder,
the models module the UNet's constructor arguments, the model family its components, the data package
what needs its readers (filters parse, ``idx_to_prompt`` loads). The machine: every folder the run will
write can be made, the loader's worker count suits the CPUs, and the memory plan of one micro-batch fits
the device (``memory.fit.check_batch``). ``load`` is what the training entry point, scripts and tests
call. It imports torch (through the owners).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .data.checks import check_dataset_inputs
from .data.synthetic import COLOURS
from .distributed import probe_env, usable_cpus
from .families import options, registry
from .families.components.unet import check_unet_params
from .memory.fit import check_batch, trained_config, vae_factor  # (read, nothing built)
from .data.buckets import make_buckets
from .families.options import FamilyModelFields
from .adapters import check_lora_file, resolve_targets
from .config.patterns import PatternTimeout
from .memory.load import meta_module
from .speed import block_swap
from .outputs.comfy_lora import check_layers
from .families.components.ddpm import validate_objective_config
from .families.components.clip import validate_text_encoder_config
from .config.fields import ConfigError
from .config.loading import parse
from .config.schema import TrainConfig
from .run.train_state import STEP_CAP

# Loader workers per device: more than this many per usable CPU (or than the cap) is refused; the loop
# warns at start-up when the workers and the trainer outnumber the CPUs.
WORKERS_PER_CPU = 4
WORKERS_FLOOR = 32  # always accepted (a small allocation that will be given more CPUs)
WORKERS_CAP = 256


def check(cfg: TrainConfig) -> TrainConfig:
    """Run every owner's checks on a parsed config; raises ``ConfigError`` naming the key."""
    check_output_paths(cfg)
    check_workers(cfg)
    validate_objective_config(cfg.objective)
    validate_text_encoder_config(cfg.model.text_encoder)
    if cfg.model.unet.params:
        check_unet_params(cfg.model.unet.target, cfg.model.unet.params)
    options.check(cfg)
    if cfg.quickstart.tiny_family is not None and cfg.quickstart.tiny_family not in registry.FAMILIES:
        raise ConfigError(f"'quickstart.tiny_family' is '{cfg.quickstart.tiny_family}', expected one of "
                          f"{', '.join(registry.FAMILIES)}")
    check_word(cfg.quickstart)
    registry.validate(cfg)
    check_family_limits(cfg)
    check_init_from(cfg)
    block_swap.check_config(cfg)
    check_comfy_names(cfg)
    check_dataset_inputs(cfg.dataset)
    check_batch(cfg)
    return cfg


def check_word(q) -> None:
    """quickstart.word_*: colours of the shapes dataset, the word's colour on none of its backgrounds."""
    if not q.word_dataset:
        return
    bad = [c for c in [q.word_colour, *q.word_backgrounds] if c not in COLOURS]
    if bad or not q.word_backgrounds or q.word_colour in q.word_backgrounds or not q.word.isalpha():
        raise ConfigError(f"'quickstart.word_*': need a word of letters ({q.word!r}), a word_colour and "
                          f"word_backgrounds of {', '.join(COLOURS)}, the colour not among the backgrounds; got "
                          f"{q.word_colour!r} on {list(q.word_backgrounds)}")


def load(argv: list[str] | None = None, *, yaml_text: str | None = None) -> TrainConfig:
    """The resolved, fully checked ``TrainConfig`` from the command line (and/or YAML text), shortened
    when ``SD_TRAINING_MAX_STEPS`` is set (``apply_step_cap``)."""
    return apply_step_cap(check(parse(argv, yaml_text=yaml_text)))


# ----------------------------------------------------------------------------------------------
# SD_TRAINING_MAX_STEPS: the one way the docs test (tests/test_docs_run.py) shortens a documented command.
# ----------------------------------------------------------------------------------------------

MAX_STEPS_ENV = "SD_TRAINING_MAX_STEPS"


def apply_step_cap(cfg: TrainConfig, env: dict[str, str] | None = None) -> TrainConfig:
    """With ``SD_TRAINING_MAX_STEPS=N`` in the environment the run stops after N optimizer steps, as if
    ``experiment.num_examples_to_see`` were N x the global batch (per-device batch x accumulation x ranks
    of this launch): everything that reads the run length (the loader, the schedule, the model card, the
    end-of-run exports and samples) sees the shorter run, and the config the run writes says it. A run
    already shorter is left alone. The loop logs that the cap applied (``Plan.note``)."""
    env = os.environ if env is None else env
    raw = env.get(MAX_STEPS_ENV, "").strip()
    if not raw:
        return cfg
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{MAX_STEPS_ENV}={raw!r}: expected a whole number of optimizer steps >= 1 (or unset it)")
    steps = int(raw)
    s = cfg.system
    ranks = probe_env(env)["world_size"]
    global_batch = s.global_batch_size or s.batch_size * s.gradient_accumulation * ranks
    before = cfg.experiment.num_examples_to_see
    after = min(before, steps * global_batch)
    if after < before:
        cfg.experiment.num_examples_to_see = cfg.dataset.params.num_examples_to_see = after
        cfg.__dict__[STEP_CAP] = (f"{MAX_STEPS_ENV}={steps}: the run stops after {steps} optimizer step(s), as if "
                                  f"experiment.num_examples_to_see were {after:,} (configured: {before:,})")
    return cfg


def check_workers(cfg: TrainConfig) -> None:
    """Loader worker processes per device against the CPUs this process may use: an absurd count (each
    worker is a process with its own copy of the reader) is refused before one is started."""
    cpus = usable_cpus()
    limit = min(WORKERS_CAP, max(WORKERS_PER_CPU * cpus, WORKERS_FLOOR))
    for key, n in (("system.workers", cfg.system.workers), ("dataset.params.workers", cfg.dataset.params.workers)):
        if n > limit:
            raise ConfigError(
                f"'{key}'={n:,} loader worker processes per device, but this process may use {cpus} CPU(s): at most "
                f"{limit} are accepted ({WORKERS_PER_CPU} per CPU, at least {WORKERS_FLOOR}, never more than "
                f"{WORKERS_CAP}). About one per CPU left to each rank is plenty: set {key}={max(cpus - 1, 1)} "
                "(SLURM: --cpus-per-task gives each task its CPUs)")


def output_paths(cfg: TrainConfig) -> list[tuple[str, str]]:
    """(key, folder) of everything the run writes: the run folder, and the quickstart's and FID's
    generated inputs when they are to be made."""
    out = [("experiment.log_dir", os.path.join(cfg.experiment.log_dir, cfg.experiment.name))]
    q, ev = cfg.quickstart, cfg.evaluation
    for key, path in (("quickstart.tiny_pipeline", q.tiny_pipeline), ("quickstart.shapes_dataset", q.shapes_dataset),
                      ("quickstart.word_dataset", q.word_dataset), ("quickstart.edit_dataset", q.edit_dataset)):
        if path and not os.path.exists(path):
            out.append((key, path))
    if ev.ref_stats and ev.ref_images and not os.path.exists(ev.ref_stats):
        out.append(("evaluation.ref_stats", os.path.dirname(os.path.abspath(ev.ref_stats))))
    return out


def check_output_paths(cfg: TrainConfig) -> None:
    """Every folder the run writes can be made (or written, if it exists), found at start-up rather than
    at the first save: a ``ConfigError`` naming the key and the path."""
    for key, path in output_paths(cfg):
        check_creatable(key, path)


def check_creatable(key: str, path: str) -> None:
    """``path`` is a folder that exists and takes a new entry, or one that can be made: its nearest
    existing ancestor is a folder where a folder can be made (tried: a probe folder made and removed, so
    read-only mounts and permissions are found whoever runs it)."""
    target = Path(path).absolute()
    existing = target
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if os.path.islink(existing) and not existing.exists():
        raise ConfigError(f"'{key}': {path} cannot be made: {existing} is a broken symbolic link. Remove it or "
                          f"set {key} to another folder")
    if not existing.is_dir():
        raise ConfigError(f"'{key}': {path} cannot be made: {existing} is a file, not a folder. Set {key} to a "
                          "folder (or move the file)")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".sd-training-write-check-", dir=existing))
    except OSError as e:
        made = "" if existing == target else f" ({existing} is the nearest folder that exists)"
        raise ConfigError(f"'{key}': cannot write {path}{made}: {e.strerror or e}. Set {key} to a folder this "
                          "user can write, or fix its permissions or mount") from None


# ----------------------------------------------------------------------------------------------
# What the run's family and its trained module take, read from the config files (nothing built).
# ----------------------------------------------------------------------------------------------

def check_family_limits(cfg: TrainConfig) -> None:
    """Text lengths, image sides and ``model.guidance_embed`` against what the family declares
    (``Family.text_limits``, ``pixel_grid``, ``takes_guidance_embed``) and its trained module's config."""
    fam = registry.trained_family(cfg)
    if fam is None or cfg.model.train_target == "vae":
        return  # the family is told at start-up (a hub id not cached), or the autoencoder stage (its own checks)
    what = getattr(fam, "display_name", "") or fam.name
    for key, (limit, why) in fam.text_limits(cfg).items():
        value = _value(cfg, key)
        if value is not None and value > limit:
            raise ConfigError(f"'{key}'={value:,} is more than the {what} family takes: at most {limit} tokens "
                              f"({why}); set {key}={limit} or less (each token costs memory in every attention layer)")
    check_references(cfg, fam, what)
    _folder, conf = trained_config(cfg)
    takes = fam.takes_guidance_embed(conf)
    default = FamilyModelFields().guidance_embed
    if takes is False and cfg.model.guidance_embed != default:
        net = f"{what}'s {fam.net_name}" + (" config (no guidance_embeds)" if conf is not None else "")
        raise ConfigError(f"'model.guidance_embed'={cfg.model.guidance_embed:g} would be unused: the {net} has no "
                          "guidance embedding to feed it (a guidance-distilled model has one). Remove the key")
    if conf is not None:
        grid = fam.pixel_grid(conf, vae_factor(cfg))
        if grid is not None:
            check_resolutions(cfg, grid, what)


def check_references(cfg: TrainConfig, fam, what: str) -> None:
    """``dataset.params.references`` within the family's ``reference_images`` (an edit family needs its
    references, a text-to-image family takes none)."""
    fewest, most = fam.reference_images
    n = int(cfg.dataset.params.references)
    if fewest <= n <= most:
        return
    if most == 0:
        raise ConfigError(f"'dataset.params.references'={n}: the {what} family trains text-to-image and takes no "
                          "reference images. Remove the key, or choose an edit family (model.family: flux_kontext, "
                          "qwen_image_edit, or flux2 with references)")
    takes = f"exactly {fewest}" if fewest == most else f"{fewest} to {most}"
    raise ConfigError(f"'dataset.params.references'={n}: the {what} family takes {takes} reference image(s) per "
                      f"sample; set dataset.params.references={max(fewest, min(n, most))} and give each sample that "
                      "many (WebDataset members KEY.ref.<ext>, parquet/CSV column 'reference', folder sidecars "
                      "NAME.ref.<ext>)")


def _value(cfg, path: str):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def image_sides(cfg: TrainConfig) -> list[tuple[str, list[int]]]:
    """(key, pixel sides) of every image size the run's data and samples can have: the resolution, each
    aspect bucket's sides, the sample grid's resolution."""
    p, sides = cfg.dataset.params, []
    sides.append(("dataset.params.resolution", [int(p.resolution)]))
    if p.aspect_buckets:
        buckets = make_buckets(int(p.resolution), int(p.bucket_step), float(p.max_aspect_ratio))
        sides.append(("dataset.params.bucket_step", sorted({s for b in buckets for s in b})))
    if cfg.experiment.sample_resolution is not None:
        sides.append(("experiment.sample_resolution", [int(cfg.experiment.sample_resolution)]))
    return sides


def _nearest(side: int, multiple: int, largest: int | None) -> str:
    low = max(side // multiple * multiple, multiple)
    options = [v for v in (low, low + multiple) if largest is None or v <= largest]
    if largest is not None and side > largest:
        options = [largest // multiple * multiple]
    return " or ".join(str(v) for v in dict.fromkeys(options))


def check_resolutions(cfg: TrainConfig, grid, what: str) -> None:
    """Every side of :func:`image_sides` a multiple of ``grid.multiple`` and at most ``grid.largest``; else one
    ``ConfigError`` naming the key, the side and the nearest valid values (a wrong side failed at step 1,
    a too large one after every model had loaded)."""
    p = cfg.dataset.params
    for key, sides in image_sides(cfg):
        for side in sides:
            uneven, large = side % grid.multiple != 0, grid.largest is not None and side > grid.largest
            if not (uneven or large):
                continue
            rule = f"a multiple of {grid.multiple} px" + (f", at most {grid.largest} px" if grid.largest else "")
            if key != "dataset.params.bucket_step":
                raise ConfigError(f"'{key}'={side} px, but every image side {what} trains on must be {rule} "
                                  f"({grid.why}): nearest valid: {_nearest(side, grid.multiple, grid.largest)}")
            step = -(-int(p.bucket_step) // grid.multiple) * grid.multiple
            fix = (f"set dataset.params.bucket_step={step}" if uneven else
                   "lower dataset.params.max_aspect_ratio or dataset.params.resolution (the longest bucket side is "
                   "about resolution x sqrt(max_aspect_ratio))")
            raise ConfigError(f"an aspect bucket of dataset.params.resolution={p.resolution}, bucket_step="
                              f"{p.bucket_step} and max_aspect_ratio={p.max_aspect_ratio:g} has a side of {side} px, "
                              f"but every image side {what} trains on must be {rule} ({grid.why}): {fix}")


def check_comfy_names(cfg: TrainConfig) -> None:
    """``model.adapter.export_kohya`` where the family's copy has ComfyUI's names (``Family.comfy_lora_names``):
    every adapter target has one, checked on the net the config names built on the meta device (as the memory
    plan builds it) before any weight loads. Skipped when the net cannot be read yet or the targets match
    nothing: the start-up build reports that, and checks the names again (``adapters.apply``)."""
    a, fam = cfg.model.adapter, registry.trained_family(cfg)
    if not (a.enabled and a.export_kohya) or fam is None or fam.comfy_lora_names is None:
        return
    _folder, conf = trained_config(cfg)
    net = meta_module(conf) if conf is not None else None
    if net is None:
        return
    try:
        targets = resolve_targets(net, fam.adapter_presets, a.targets, list(a.target_modules), a.target_regex,
                                  "model.adapter", fam.net_name)
    except PatternTimeout:
        raise  # the user's target_regex: refused at load
    except ConfigError:
        return
    check_layers(fam.comfy_lora_names, net, targets, "model.adapter.export_kohya", fam.net_name, a.type)


def check_init_from(cfg: TrainConfig) -> None:
    """``model.adapter.init_from``: a readable, whole safetensors file, found before any model loads (its
    keys are matched against the adapters at start-up)."""
    a = cfg.model.adapter
    if a.enabled and a.init_from:
        check_lora_file(a.init_from)
