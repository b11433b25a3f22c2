"""Every family in ``sd_training.families.registry.FAMILIES`` passes the same end-to-end checks, with no test
code of its own: from its tiny pipeline (``registry.make_tiny_pipeline``)

- a bf16 run with loader workers (EMA, validation, sample grid, eval images, caption dropout, gradient
  checkpointing) trains, and its raw and EMA exports load in plain diffusers (``DiffusionPipeline``, offline)
  and generate; the frozen components are exported in fp32 as loaded, the trained net moved;
- that run killed (SIGKILL) after its first checkpoint and restarted ends bit-identical to it;
- 2 ranks (DDP, gloo) equal 1 rank with the batch doubled, and 2 micro-batches of accumulation;
- a LoRA run's export loads with ``pipe.load_lora_weights`` and generates what the run's model generates;
- a step from latent shards (precomputed with text embeddings) equals the step from online encoding;
- keys of the other kind of family (the UNet families' or the transformer families') are refused with a
  ``ConfigError`` naming the key.

An edit family (``reference_images[0] > 0``: Flux Kontext ...) runs all of them on paired shards
(``conftest.edit_shards``, ``dataset.params.references``), its sample grids and eval images from reference
files the tests write, its exports generating from a reference.

Each family's runs are forked from one process (tests/forked.py) or run in this one, at 32 px for a few steps;
the checks of one family share its runs (module fixtures per family). The settings a family takes among
``VARIATIONS`` (a short T5, its own loss weightings) are found by asking ``configure.load``, so a new family
runs here as it is registered. What is specific to a family (its conditioning equals the pipeline's
``encode_prompt``, one step equals diffusers' example script) stays in its own test file."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
from pathlib import Path

import forked
import numpy as np
import pytest
import torch
from conftest import assert_shard_step_equals_online, run_precompute
from helpers import args_with, max_diff, run_trainer
from PIL import Image
from test_resume import assert_same, finish, kill_after_checkpoint, launch, losses

from sd_training.checkpoint import Checkpointer, complete_steps
from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.families import registry

pytestmark = pytest.mark.usefixtures("one_thread")
HERE = Path(__file__).resolve().parent
RES = 32
ROOT = Path(__file__).resolve().parents[1]
STEPS, BATCH, CKPT = 4, 2, 2  # the bf16 run: checkpoints at 2 and 4; the killed run restarts from 2
T5_LEN = 16
# Settings each family takes if it takes them (probed with configure.load): a short T5 (the transformer
# families' default is 256-512 tokens), and a loss of the family's own kind that is not the default, so the
# run covers more than the default path.
VARIATIONS = {"model.t5.max_length": T5_LEN, "model.t5.dropout": 0.3, "flow_matching.weighting": "cosmap",
              "objective.prediction_type": "v_prediction", "objective.loss_weighting": "min_snr"}
# The keys one kind of family takes and the other refuses: (key, value, the name the error must contain).
UNET_KEYS = [("model.unet.params", "{in_channels: 4}", "model.unet"),
             ("objective.prediction_type", "v_prediction", "objective"),
             ("model.text_encoder.clip_skip", 2, "clip_skip")]
TRANSFORMER_KEYS = [("flow_matching.shift", 2.0, "flow_matching"), ("model.t5.max_length", T5_LEN, "model.t5"),
                    ("model.transformer.params", "{num_layers: 2}", "model.transformer")]
LORA = {"model.adapter.type": "lora", "model.adapter.rank": 4, "model.adapter.alpha": 8}
ATOL = 1e-5  # images in [0, 1]: plain diffusers + exported LoRA against the run's own pipeline (measured: 0)
# A family that is another's subclass differing only in how it reads the text and the references leaves the
# trainer's checks to the other family's runs (the CI minutes: 3 of its 5 runs): kill-and-resume and 2 ranks =
# 1 rank go through the same data path, seeds and step, which its conditioning does not touch. Its own runs
# here: the bf16 run and its exports (its pipeline class loads and generates), the LoRA export (loads on its
# pipeline). Qwen-Image-Edit-Plus: the per-sample template and the VL images at ~384^2; each sample's states
# equal encode_prompt of that sample alone (test_qwen_image_edit.py), so no batch split can change them.
TRAINER_CHECKS_BY = {"qwen_image_edit_plus": "qwen_image_edit"}

plain_args = args_with({"dataset.params.resolution": RES})


def family_of(pipeline):
    """The family class of a tiny pipeline folder (read from its model_index.json)."""
    return registry.FAMILIES[registry.detect_source("auto", str(pipeline))]


def reference_image(size: int = RES) -> Image.Image:
    """A fixed reference image (seeded noise on a grey ramp) for an edit family's samples and generations."""
    rng = np.random.default_rng(7)
    ramp = np.linspace(40, 220, size)[None, :, None] + rng.normal(0, 20, (size, size, 3))
    return Image.fromarray(np.clip(ramp, 0, 255).astype(np.uint8))


def args(tmp_path, pipeline, shards, **over):
    """``conftest.train_args`` at 32 px; for an edit family also its references per sample and each sample
    prompt's reference files (written into ``tmp_path``)."""
    fam = family_of(pipeline)
    n = fam.reference_images[0]
    if n:
        ref = tmp_path / "reference.png"
        if not ref.is_file():
            reference_image().save(ref)
        over = {"dataset.params.references": n, "experiment.sample_references": f"[[{', '.join([str(ref)] * n)}]]",
                **over}
    return plain_args(tmp_path, pipeline, shards, **over)


def reference_kwargs(name) -> dict:
    """An edit family's pipeline arguments for the fixed reference (its ``reference_call``); {} otherwise."""
    fam = registry.FAMILIES[name]
    return fam.reference_call([reference_image()] * fam.reference_images[0]) if fam.reference_images[0] else {}


@pytest.fixture(scope="module", params=list(registry.FAMILIES))
def name(request):
    return request.param


@pytest.fixture(scope="module")
def pipeline(name, family_pipeline):
    return family_pipeline(name)


@pytest.fixture(scope="module")
def shards(name, request):
    """The family's training data: the shapes shards, or for an edit family the paired shards."""
    return request.getfixturevalue("edit_shards" if registry.FAMILIES[name].reference_images[0] else "shapes_shards")


def takes(pipeline, shards, tmp_path, key, value) -> bool:
    """Whether the family's config takes ``key=value``."""
    try:
        load(args(tmp_path, pipeline, shards, **{key: value}))
    except ConfigError:
        return False
    return True


@pytest.fixture(scope="module")
def keys(pipeline, shards, tmp_path_factory) -> dict:
    """The VARIATIONS this family takes (each alone, then all together)."""
    tmp = tmp_path_factory.mktemp("probe")
    chosen = {k: v for k, v in VARIATIONS.items() if takes(pipeline, shards, tmp, k, v)}
    load(args(tmp, pipeline, shards, **chosen))
    return chosen


def short_text(keys: dict) -> dict:
    """The short-T5 key alone (the runs that compare steps leave the loss variations out)."""
    return {k: v for k, v in keys.items() if k == "model.t5.max_length"}


def generate(pipe, keys, name, prompt="a red circle on a blue background", **kw):
    """An image from a diffusers pipeline of family ``name`` at the run's size: 2 steps, seed 3, in [0, 1] (an
    edit family's from the fixed reference)."""
    kw.update(reference_kwargs(name))
    if "max_sequence_length" in inspect.signature(type(pipe).__call__).parameters and keys.get("model.t5.max_length"):
        kw["max_sequence_length"] = keys["model.t5.max_length"]
    pipe.set_progress_bar_config(disable=True)
    # Qwen-Image-Edit's samples bring the reference to the sample's size (its pipeline: ~1 Mpx): plain pipelines too
    sizing = getattr(registry.FAMILIES[name], "reference_sizing", None)
    with torch.no_grad(), (sizing(RES, RES) if sizing else contextlib.nullcontext()):
        return pipe(prompt=prompt, height=RES, width=RES, num_inference_steps=2, generator=torch.Generator().manual_seed(3),
                    output_type="np", **kw).images[0]


# ------------------------------------------------------------------------------ bf16 run, export, resume
def bf16_args(tmp, pipeline, shards, keys, run_name, outputs=True):
    """The bf16 run; ``outputs``: with validation, sample grids, eval images and an export at each checkpoint,
    its text encoders kept in host memory (``cpu``: every step, validation, grid and eval image goes through
    the placement's hooks); the killed run leaves them out and keeps its encoders on the device: what it
    trains must depend on neither."""
    prompts = tmp / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    extra = {"experiment.save_every": CKPT, "validation.path": shards, "validation.num_batches": 1,
             "experiment.num_eval_images": 2, "experiment.eval_caption_file": str(prompts),
             "model.text_encoder_placement": "cpu"}
    n = family_of(pipeline).reference_images[0]
    if n:  # an edit family's eval images: each prompt's references, paths relative to the file's folder
        reference_image().save(tmp / "eval_reference.png")
        (tmp / "eval_references.txt").write_text("\t".join(["eval_reference.png"] * n) + "\n" +
                                                 "\t".join(["eval_reference.png"] * n) + "\n")
        extra["experiment.eval_reference_file"] = str(tmp / "eval_references.txt")
    if not outputs:
        extra = {"experiment.save_every": 1000, "experiment.sample_per_prompt": 0}
    return args(tmp, pipeline, shards, name=run_name, **keys, **extra, **{
        "model.mixed_precision": "bf16", "system.workers": 2, "system.batch_size": BATCH,
        "experiment.num_examples_to_see": STEPS * BATCH, "experiment.checkpoint_every": CKPT,
        "experiment.keep_last_checkpoints": 10, "experiment.checkpoint_async": "false",
        "model.use_ema": "true", "model.ema.decay": 0.9, "dataset.params.caption_dropout": 0.5,
        "dataset.params.resampled": "false", "model.gradient_checkpointing": "true"})


@pytest.fixture(scope="module")
def bf16_runs(name, pipeline, shards, keys, tmp_path_factory):
    """The bf16 run straight through, and the same run (without validation and samples) killed after checkpoint
    2 and restarted: (runs folder, the killed run's complete checkpoints before the restart, the restart's output)."""
    tmp = tmp_path_factory.mktemp("bf16")
    finish(launch(tmp, bf16_args(tmp, pipeline, shards, keys, "straight")))
    if name in TRAINER_CHECKS_BY:  # the killed run's checks are another family's
        return tmp / "runs", None, None
    resumed = bf16_args(tmp, pipeline, shards, keys, "resumed", outputs=False)
    run = tmp / "runs" / "resumed"
    kill_after_checkpoint(launch(tmp, resumed), run / "checkpoints", CKPT)
    first = complete_steps(run / "checkpoints")
    return tmp / "runs", first, finish(launch(tmp, resumed))


@pytest.mark.slow
def test_a_bf16_run_with_a_loader_worker_trains_validates_and_samples(bf16_runs, name):
    run = bf16_runs[0] / "straight"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "loss" in r) == list(range(1, STEPS + 1))
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    assert [r["step"] for r in rows if "val/loss" in r] == list(range(0, STEPS + 1, CKPT))
    assert any(r.get("model_tflops_per_image", 0) > 0 for r in rows), f"{name}: no MFU"
    for step in range(CKPT, STEPS + 1, CKPT):
        assert (run / "samples" / f"step_{step:08d}.png").is_file()
        assert len(list((run / "eval" / f"step_{step:08d}").glob("*.png"))) == 2
    # Its text encoders stay in host memory (model.text_encoder_placement=cpu): the memory plan counts only the
    # VAE among the frozen parts, less than the run that keeps them on the device (the killed run's: a family
    # in TRAINER_CHECKS_BY has none, its base's encoders and placement are the same).
    if name not in TRAINER_CHECKS_BY:
        frozen = {r: json.loads((bf16_runs[0] / r / "memory_plan.json").read_text())["rows"][0]["frozen"]
                  for r in ("straight", "resumed")}
        assert 0 < frozen["straight"] < frozen["resumed"], frozen


@pytest.mark.slow
def test_the_exports_load_in_plain_diffusers_and_generate(bf16_runs, name, pipeline, keys):
    from diffusers import DiffusionPipeline

    run = bf16_runs[0] / "straight"
    source = DiffusionPipeline.from_pretrained(pipeline)
    net = registry.FAMILIES[name].net_name
    for folder in ("current_pipeline", "current_pipeline_ema"):
        index = json.loads((run / folder / "model_index.json").read_text())
        assert index["_class_name"] in registry.FAMILIES[name].pipeline_classes
        pipe = DiffusionPipeline.from_pretrained(run / folder)  # plain diffusers, offline
        image = generate(pipe, keys, name)
        assert image.shape == (RES, RES, 3) and np.isfinite(image).all()
        # The objective's parameterisation reaches the exported scheduler: it samples as it trained.
        if "objective.prediction_type" in keys:
            assert pipe.scheduler.config.prediction_type == keys["objective.prediction_type"]
        # The frozen components are exported in fp32 as loaded (the run kept them in bf16); the net trained.
        for part, module in pipe.components.items():
            if not isinstance(module, torch.nn.Module):
                continue
            want = getattr(source, part).state_dict()
            got = module.state_dict()
            if part == net:
                assert any(not torch.equal(v, want[k]) for k, v in got.items()), f"{name}: the {net} did not train"
            else:
                assert module.dtype == torch.float32, part
                assert all(torch.equal(v, want[k]) for k, v in got.items()), f"{name}: {part} changed"


def leave_trainer_checks(name):
    """Skip a trainer check for a family whose runs leave it to another's (``TRAINER_CHECKS_BY``)."""
    if name in TRAINER_CHECKS_BY:
        pytest.skip(f"{name}: the trainer's checks run on {TRAINER_CHECKS_BY[name]}, its base (TRAINER_CHECKS_BY)")


def final_state(run: Path):
    shared, _, ts = Checkpointer.load(run / "checkpoints" / f"step_{STEPS:08d}", 0)
    return shared, ts


@pytest.mark.slow
def test_kill_and_resume_is_bit_identical(bf16_runs, name):
    from diffusers import DiffusionPipeline

    leave_trainer_checks(name)
    runs, first, out = bf16_runs
    assert CKPT in first and max(first) < STEPS, first  # the killed run left steps for the restart to train
    assert "resumed from" in out
    a, ta = final_state(runs / "straight")
    b, tb = final_state(runs / "resumed")
    assert ta["step"] == tb["step"] == STEPS and ta["images_seen"] == tb["images_seen"] == STEPS * BATCH
    net = next(k for k in ("transformer", "unet") if k in a)
    for part in (net, "ema", "optimizer", "lr_scheduler"):
        assert_same(a[part], b[part], part)
    # The restarted run's export (plain diffusers) holds the final weights.
    exported = getattr(DiffusionPipeline.from_pretrained(runs / "resumed" / "current_pipeline"),
                       registry.FAMILIES[name].net_name).state_dict()
    assert exported.keys() == a[net].keys()
    for k, v in exported.items():
        assert torch.equal(v, a[net][k].to(v.dtype)), k
    la, lb = losses(runs / "straight"), losses(runs / "resumed")
    for s in range(max(first) + 1, STEPS + 1):
        assert la[s] == lb[s], (s, la[s], lb[s])



@pytest.mark.slow
def test_an_edit_checkpoint_generates_with_its_references(name, tmp_path, request):
    """``scripts/generate_examples.py --checkpoint RUN --reference-file``, the bf16 run's eval reference file: each
    image edits its reference (saved beside it), as the exported pipeline does it (the same final weights, fp32)."""
    import importlib.util

    if not registry.FAMILIES[name].reference_images[0]:
        pytest.skip("a text-to-image family: test_scripts_generate_plot.py generates from its checkpoint")
    bf16_runs, keys = request.getfixturevalue("bf16_runs"), request.getfixturevalue("keys")  # the edit families' only
    spec = importlib.util.spec_from_file_location("generate_examples", ROOT / "scripts" / "generate_examples.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    runs = bf16_runs[0]
    out = tmp_path / "images"
    written = gen.main(["--prompts", str(runs.parent / "prompts.txt"), "--out", str(out), "--steps", "2",
                        "--seed", "3", "--guidance", "1", "--device", "cpu", "--no-progress", "--checkpoint",
                        str(runs / "straight"), "--reference-file", str(runs.parent / "eval_references.txt")])
    assert [p.name for p in written] == ["000000.png", "000001.png"]
    refs = sorted(p.name for p in out.glob("*.ref*.png"))
    n = registry.FAMILIES[name].reference_images[0]
    assert refs == sorted(f"{i:06d}.ref{k + 1 if k else ''}.png" for i in range(2) for k in range(n))
    np.testing.assert_array_equal(np.asarray(Image.open(out / "000000.ref.png")), np.asarray(reference_image()))
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(runs / "straight" / "current_pipeline")
    want = np.round(generate(pipe, keys, name, prompt="a red circle", guidance_scale=1.0) * 255)
    got = np.asarray(Image.open(written[0]).convert("RGB"), dtype=np.float64)
    assert np.abs(got - want).max() <= 1, f"{name}: the checkpoint's edit differs from the exported pipeline's"


# ------------------------------------------------------------------------------------------- 2 ranks
@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_equal_one_rank_with_the_batch_doubled(name, pipeline, shards, keys, tmp_path):
    """tests/dist_worker.py: 3 AdamW steps on a fixed global batch of 8 (latents, token ids, noise, timesteps),
    1 rank x 8 against 2 ranks x 4 and 2 ranks x 2 micro-batches x 2 (DDP, fp32, gloo)."""
    leave_trainer_checks(name)
    common = {**short_text(keys), "optimizer.params.learning_rate": 1e-3, "lr_scheduler.params.warmup_length": 0,
              "optimizer.params.epsilon": 1e-4, "distributed.strategy": "ddp"}

    def workers(nproc, out, *more, **over):
        argv = []
        for o, kw in ((out, over), *more):
            argv += ["--"] * bool(argv) + [str(o), *args(tmp_path, pipeline, shards, name=f"w{nproc}_{o.stem}",
                                                         **common, **kw)]
        res = forked.run([sys.executable, str(HERE / "dist_worker.py"), *argv], nproc=nproc, capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        return torch.load(out)

    one = workers(1, tmp_path / "one.pt", **{"system.batch_size": 8})
    init = torch.load(tmp_path / "one.init.pt")
    two = workers(2, tmp_path / "two.pt", (tmp_path / "acc.pt", {"system.batch_size": 2,
                                                                 "system.gradient_accumulation": 2}),
                  **{"system.batch_size": 4})
    acc = torch.load(tmp_path / "acc.pt")
    assert max_diff(one, init) > 1e-4  # the steps moved the weights, so the equality below means something
    # The same math summed in another order (fp32), three AdamW steps at lr 1e-3.
    assert max_diff(one, two) < 1e-5 and max_diff(one, acc) < 1e-5, (max_diff(one, two), max_diff(one, acc))


# ---------------------------------------------------------------------------------------------- LoRA
@pytest.mark.slow
def test_a_lora_export_loads_with_load_lora_weights(name, pipeline, shards, keys, tmp_path):
    """A LoRA trains (the base bit-identical, the optimizer holding adapter parameters only) and exports a
    diffusers LoRA folder; plain diffusers loads it with ``load_lora_weights`` and makes the image the run's
    own pipeline makes (same seed), unlike the base pipeline's."""
    from diffusers import DiffusionPipeline

    from sd_training import adapters

    over = {**short_text(keys), **LORA, "experiment.num_examples_to_see": 8, "optimizer.params.learning_rate": 1e-2}
    # A LoRA on the text encoders too where the family takes one (asked of the config and the family's
    # adapters, which know its encoders); the kohya-named copy where the family names its modules.
    text = {**over, "model.adapter.text_encoders.train": "true"}
    try:
        with_text = load(args(tmp_path, pipeline, shards, **text))
        adapters.apply(with_text, registry.create(with_text, torch.device("cpu"), 0, True), None)
        over = text
    except ConfigError:
        pass
    kohya = dict(registry.FAMILIES[name].kohya_lora_prefixes)
    comfy = registry.FAMILIES[name].comfy_lora_names is not None  # its copy with ComfyUI's names instead
    if kohya or comfy:
        over["model.adapter.export_kohya"] = "true"
    cfg = load(args(tmp_path, pipeline, shards, **over))
    t = run_trainer(cfg)
    base = DiffusionPipeline.from_pretrained(pipeline)
    names = {id(p): n for m in [t.net, *t.family.adapters.encoders.values()] for n, p in m.named_parameters()}
    trained = [names[id(p)] for g in t.optimizer.param_groups for p in g["params"]]
    assert trained and all("lora_" in n for n in trained)
    assert all(id(p) in {id(q) for g in t.optimizer.param_groups for q in g["params"]} for p in t.optimizer.state)
    want = getattr(base, t.net_name).state_dict()
    for key, p in t.net.state_dict().items():
        if "lora_" not in key:
            assert torch.equal(p, want[key.replace("base_layer.", "")]), key
    assert any(float(p.abs().sum()) > 0 for n, p in t.net.named_parameters() if "lora_B" in n)  # it moved

    out = t.run_dir.pipeline(None)
    assert (out / adapters.LORA_FILE).is_file() and not (out / "model_index.json").exists()
    ours_pipe = t.family.inference_pipeline(t.net)
    # Both sampled with the same guidance: the run's for a net with a distilled guidance embedding, else none.
    distilled = getattr(getattr(ours_pipe, t.net_name).config, "guidance_embeds", False)
    kw = {"guidance_scale": float(cfg.model.guidance_embed) if distilled else 1.0}
    ours = generate(ours_pipe, keys, name, **kw)
    before = generate(base, keys, name, **kw)
    base.load_lora_weights(str(out))
    loaded = generate(base, keys, name, **kw)
    np.testing.assert_allclose(loaded, ours, atol=ATOL, rtol=0)
    assert np.abs(loaded - before).max() > 1e-3, "the LoRA changed nothing"
    if kohya:  # the kohya-named copy (alpha 8 != rank 4; a text encoder's alpha is its rank) loads to the same image
        from safetensors.torch import load_file

        file = out / adapters.KOHYA_FILE
        saved = load_file(str(file))
        assert any(k.startswith(kohya[t.net_name]) and k.endswith(".lora_down.weight") for k in saved)
        prefixes = {p: part for part, p in kohya.items()}
        alphas = {next(p for p in prefixes if k.startswith(p)): float(v) for k, v in saved.items() if k.endswith(".alpha")}
        trained_parts = {t.net_name: 8.0, **{part: 4.0 for part in t.family.adapters.encoders}}
        assert alphas == {kohya[part]: alpha for part, alpha in trained_parts.items()}, alphas
        assert all(k.startswith(tuple(f"{p}text_model_encoder_layers_" for p in prefixes if "te" in p))
                   for k in saved if k.startswith("lora_te"))
        fresh = DiffusionPipeline.from_pretrained(pipeline)
        fresh.load_lora_weights(str(file))
        np.testing.assert_allclose(generate(fresh, keys, name, **kw), ours, atol=ATOL, rtol=0)
    if comfy:  # the ComfyUI-named copy (tests/test_comfy_lora.py checks its names) converts back to the same image
        fresh = DiffusionPipeline.from_pretrained(pipeline)
        fresh.load_lora_weights(str(out / adapters.COMFY_FILE))
        np.testing.assert_allclose(generate(fresh, keys, name, **kw), ours, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------ latent shards
@pytest.fixture(scope="module")
def latents(name, pipeline, shards, keys, tmp_path_factory):
    """The family's shards precomputed for it at 32 px: latents (mean, std) and its stored text (an edit
    family's reference latents too; Qwen-Image-Edit's text read with the references)."""
    tmp = tmp_path_factory.mktemp("latents")
    reads_refs = getattr(registry.FAMILIES[name], "text_reads_references", False)  # takes latents with stored text only
    if not (reads_refs or takes(pipeline, shards, tmp, "dataset.type", "latents")):
        pytest.skip(f"the {name} family trains from images only (its config refuses dataset.type=latents)")
    out = tmp / "out"
    short = ["--max-length", str(keys["model.t5.max_length"])] if "model.t5.max_length" in keys else []
    refs = registry.FAMILIES[name].reference_images[0]
    # Qwen-Image-Edit's text in fp32: its step from the shards is the image shards' exactly (Plus keeps bf16)
    exact = ["--text-dtype", "fp32"] if name == "qwen_image_edit" else []
    run_precompute(["--input", shards, "--pipeline", str(pipeline), "--output", str(out), "--resolution",
                    str(RES), "--dtype", "fp32", "--text-embeddings", *short, *exact, "--batch-size", "16",
                    "--workers", "0", "--no-progress", *(["--references", str(refs)] if refs else [])])
    return out


def test_a_step_from_latent_shards_equals_the_step_from_online_encoding(name, latents, pipeline, shards, keys,
                                                                        tmp_path):
    """One step from shard latents equals the step from the same images encoded online (posterior mean): with
    the text encoded online exactly (1e-5), with the stored text embeddings within their storage's rounding;
    an edit family's step from the stored reference latents equals its step from the references encoded online
    (Qwen-Image-Edit's stored text, read with the references at precompute time, in fp32 here: exactly).
    The shards say which family's text layout they hold, and a run of another layout refuses them."""
    from dataclasses import replace

    from data_fixtures import make_cfg

    from sd_training.data import DatasetConfigError, build_train_loader
    from sd_training.data.latent_checks import check_latents_match
    from sd_training.data.latents import EMPTY_POOLED_FILE, EMPTY_TEXT_FILE, from_stored
    from sd_training.data.transforms import unit_range

    def family(shards, **over):
        cfg = load(args(tmp_path, pipeline, shards, **short_text(keys), **over))
        return registry.create(cfg, torch.device("cpu"), 0, True)

    online = family(shards, **{"model.vae.latent_sampling": "mean"})
    from_shards = family(str(latents), **{"dataset.type": "latents", "dataset.params.text_embeddings": "true"})
    n_refs = type(online).reference_images[0]
    sample_refs = ()  # an edit family's grid: the fixed reference for its one prompt
    if n_refs:
        reference_image().save(tmp_path / "sample_reference.png")
        sample_refs = ([str(tmp_path / "sample_reference.png")] * n_refs,)
    assert_text_encoders_offloaded_sample_alike(online, from_shards, sample_refs)
    info = json.loads((latents / "latents_info.json").read_text())
    vae = online.models.vae.config
    assert info["text_family"] == type(online).text_tag and info["latent_channels"] == vae.latent_channels
    assert abs(info["latent_shift_factor"] - (vae.get("shift_factor") or 0.0)) < 1e-9  # FLUX.2's VAE has none
    def first(path, **params):
        cfg = make_cfg(str(path), resolution=RES, **params)
        return next(iter(build_train_loader(cfg, tokenizer=from_shards.tokenizers, rank=0, world_size=1, seed=3)))

    # The stored text is the family's own encoding, in the layout and dtype it asks for; the empty caption's
    # arrays (caption dropout) are its encoding of "" (zeros where the pipeline zeroes it, as SDXL's). An edit
    # family whose text reads the references (Qwen-Image-Edit) stores each sample's, read with its references.
    image = first(shards, references=n_refs)
    edit = {"references": n_refs, "sizes": [(RES, RES)]} if type(online).text_reads_references else {}
    encoding = type(online).text_encoding(str(pipeline), torch.device("cpu"), 0, keys.get("model.t5.max_length"),
                                          **edit)
    if edit:
        states, pooled = encoding.encode([""] * len(image["keys"]), image["reference_values"])
        dropped = first(latents, type="latents", latent_sampling="mean", text_embeddings=True, references=n_refs,
                        caption_dropout=1.0)
        assert dropped["keys"] == image["keys"] and info["text_references"] == n_refs and not info["empty_text_file"]
        stored_empty = dropped["encoder_hidden_states"].numpy()
    else:
        states, pooled = encoding.encode([""])
        stored_empty = from_stored(np.load(latents / EMPTY_TEXT_FILE), info.get("text_dtype"))[None]
    assert info["text_shape"] == list(states.shape[1:])
    assert info.get("pooled_shape") == (None if pooled is None else list(pooled.shape[1:]))
    if encoding.storage_dtype == "bf16":
        assert info["text_dtype"] == ("float32" if name == "qwen_image_edit" else "bfloat16")
    rounding = {"rtol": 1e-2, "atol": 1e-5} if info.get("text_dtype") == "bfloat16" else {"rtol": 1e-5, "atol": 1e-6}
    np.testing.assert_allclose(stored_empty, states[: len(stored_empty)], **rounding)
    if pooled is not None:
        np.testing.assert_allclose(from_stored(np.load(latents / EMPTY_POOLED_FILE), info.get("text_dtype")),
                                   pooled[0], **rounding)

    loader = build_train_loader(make_cfg(str(latents), type="latents", text_embeddings=True),
                                tokenizer=from_shards.tokenizers, rank=0, world_size=1, seed=3)
    from_shards.check_data(loader)
    stored = from_shards.stored_text()
    if stored is not None and stored.tag is not None:
        with pytest.raises(DatasetConfigError, match=f"{stored.tag} layout"):
            check_latents_match(loader, from_shards.models.vae, replace(stored, tag=f"not-{stored.tag}"))
    if stored is not None and stored.references:  # text read with other references, or by another rule: refused
        for other in (dict(references=stored.references + 1), dict(vl_images="another rule"), dict(references=0)):
            with pytest.raises(DatasetConfigError, match="reference image"):
                check_latents_match(loader, from_shards.models.vae, replace(stored, **other))
    shard = first(latents, type="latents", latent_sampling="mean", text_embeddings=True, references=n_refs)
    assert shard["keys"] == image["keys"]
    # The token ids and the size conditioning (SDXL's) come with the shard's samples as with the images.
    ids = {k: v for k, v in image.items() if isinstance(v, torch.Tensor)
           and k not in ("pixel_values", "sample_seeds", "reference_values")}
    for k, v in ids.items():
        assert torch.equal(shard[k], v), k
    if "original_size" in image:  # size conditioning (SDXL's): the shapes' images are 64 px (the pairs' 32), trained at 32
        side = 32 if n_refs else 64
        assert image["original_size"].tolist()[0] == [side, side] and image["target_size"].tolist()[0] == [RES, RES]
    with torch.no_grad():
        want = online.latents({"pixel_values": unit_range(image["pixel_values"])})
    torch.testing.assert_close(shard["latents"], want, rtol=1e-5, atol=1e-5)
    refs = ({}, {})  # an edit family: the references encoded online, and the shard's stored reference latents
    if n_refs:
        # (the shard step's online text encode reads the reference pixels too, where the family's text does)
        refs = ({"reference_values": image["reference_values"]}, {"reference_latents": shard["reference_latents"],
                **({"reference_values": image["reference_values"]} if edit else {})})
        with torch.no_grad():
            want_refs = torch.stack(online.reference_latents(refs[0]), dim=1)
        torch.testing.assert_close(shard["reference_latents"], want_refs, rtol=1e-5, atol=1e-5)
    g = torch.Generator().manual_seed(0)
    fixed = {"noise": torch.randn(want.shape, generator=g), "timesteps": torch.tensor([100, 400, 700, 999])}
    tol = 1e-5 if info.get("text_dtype") in (None, "float32") else 2e-2
    # A UNet's gradients: its convolutions sum the shard's and the online latents (equal within 1e-5) in another
    # order, 1e-4 relative (the UNet families' bound); a transformer's within 1e-5.
    grad_tol = (1e-4, 1e-6) if type(online).net_name == "unet" else (1e-5, 1e-7)
    assert_shard_step_equals_online(online, from_shards, want, shard, ids, fixed, stored_tol=tol, grad_tol=grad_tol,
                                    refs=refs)


def assert_text_encoders_offloaded_sample_alike(online, from_shards, references=()):
    """With stored text the run keeps its text encoders in host memory, moved onto the device for each use
    (model.text_encoder_placement=auto: offload), and its VAE too (model.vae.placement=auto: offload, brought in
    for the grid): the memory plan leaves them all out, and a sample grid through the placement's hooks is the
    grid of the run that keeps them on the device (``references``: an edit family's, SampleSettings')."""
    from sd_training.families.base import SampleSettings
    from sd_training.families.components.placement import placement_of

    encoders = from_shards.frozen_text_encoders()
    assert encoders and {placement_of(m) for m in encoders.values()} == {"offload"}
    assert {placement_of(m) for m in online.frozen_text_encoders().values()} == {"device"}
    assert from_shards.frozen_on_device() == [] and placement_of(from_shards.models.vae) == "offload"
    assert len(online.frozen_on_device()) == len(online.frozen_modules()) > 0
    settings = SampleSettings(["a red circle"], 1, 3, 2, 1.0, RES, None, references)
    grids = [np.asarray(f.sample_image(f.net, settings)) for f in (online, from_shards)]
    np.testing.assert_array_equal(*grids)


# ---------------------------------------------------------------------------------------------- refusals
def test_the_other_kind_of_familys_keys_are_refused_naming_the_key(name, pipeline, shards, tmp_path):
    """A UNet family refuses the transformer families' keys and a transformer family the UNet families' (each
    would be ignored silently): a ConfigError that names the key, at load or when the family is built."""
    cls = registry.FAMILIES[name]
    foreign = TRANSFORMER_KEYS if cls.net_name == "unet" else UNET_KEYS
    for key, value, named in foreign:
        with pytest.raises(ConfigError) as e:
            registry.create(load(args(tmp_path, pipeline, shards, **{key: value})), torch.device("cpu"), 0, True)
        assert named in str(e.value), (key, str(e.value))
    assert registry.detect_source("auto", str(pipeline)) == name  # the tiny pipeline is read as the family
