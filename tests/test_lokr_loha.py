"""``model.adapter.type: lokr | loha``: peft's LoKr and LoHa on every family's net, their exports and refusals.

Exports (no training: the adapter made by our code, its weights random and non-zero, exported):
- the ComfyUI / kohya file (``model.adapter.export_kohya``) holds LyCORIS' keys under the names ComfyUI maps
  for the family, and ComfyUI's arithmetic on it (comfy/weight_adapter/lokr.py, loha.py, written out here)
  gives every adapted layer our merged net's update (to 1e-5);
- where diffusers has a LoKr loader (the Z-Image and FLUX.2 pipelines' ``load_lora_weights``, and every model's
  ``load_lora_adapter`` for the diffusers file), the file loaded and fused gives our merged net's weights.
Runs (tiny pipelines, 32 px): one per type trains only the adapter, its export reloads as trained (init_from),
its model card's snippet loads it, 2 ranks equal 1 rank (LoKr under DDP, LoHa under FSDP2), and a killed LoKr run
resumes bit for bit. The memory plan's parameter count per layer is checked against peft's."""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from pathlib import Path

import forked
import pytest
import torch
from helpers import args_with, max_diff, run_trainer

from sd_training import adapters
from sd_training.config import ConfigError
from sd_training.configure import load
from sd_training.families import registry

pytestmark = pytest.mark.usefixtures("one_thread")
HERE = Path(__file__).parent
args = args_with({"dataset.params.resolution": 32, "model.adapter.rank": 4, "model.adapter.alpha": 8,
                  "model.adapter.export_kohya": "true"})
# Per family: the file's name of a diffusers layer, as ComfyUI's comfy/lora.py maps them (written out here, not
# taken from the code under test), and targets (FLUX.2: the layers its original does not fuse).
NAMES = {
    "sd": lambda layer, fam: "lora_unet_" + layer.replace(".", "_"),
    "sdxl": lambda layer, fam: "lora_unet_" + layer.replace(".", "_"),
    "sd3": lambda layer, fam: "lycoris_" + layer.replace(".", "_"),
    "flux": lambda layer, fam: "lycoris_" + layer.replace(".", "_"),
    "zimage": lambda layer, fam: "diffusion_model." + layer,
    "qwen_image": lambda layer, fam: "diffusion_model." + layer,
    "flux2_klein": lambda layer, fam: "diffusion_model." + fam.comfy_lora_names.original(layer)[0],
}
FLUX2_UNFUSED = r"transformer_blocks\.\d+\.(attn\.(to_out\.0|to_add_out)|ff(_context)?\..+)|single_transformer_blocks\..+"
TARGETS = {"flux2_klein": FLUX2_UNFUSED, "sd": r".*(attn[12]\.to_(q|k|v|out\.0)|proj_in|conv1)"}


def make(pipeline, shards, tmp_path, kind, **over):
    """The family of ``pipeline`` with a ``kind`` adapter made by our code, its weights random."""
    cfg = load(args(tmp_path, pipeline, shards, **{"model.adapter.type": kind, **over}))
    fam = registry.create(cfg, torch.device("cpu"), 0, True)
    ad = adapters.apply(cfg, fam, None)
    gen = torch.Generator().manual_seed(1)
    for p in fam.net.parameters():
        if p.requires_grad:
            p.data = torch.randn(p.shape, generator=gen) * 0.2
    return fam, ad


def comfy_update(state: dict, base: str, shape: torch.Size) -> torch.Tensor:
    """What ComfyUI adds to a weight for the LoKr / LoHa keys ``base.*`` (``calculate_weight``, strength 1)."""
    get = state.get
    alpha = get(base + ".alpha")
    if get(base + ".hada_w1_a") is not None:
        w1a, w1b, w2a, w2b = (state[f"{base}.hada_{k}"] for k in ("w1_a", "w1_b", "w2_a", "w2_b"))
        scale = float(alpha) / w1b.shape[0] if alpha is not None else 1.0
        return ((w1a @ w1b) * (w2a @ w2b) * scale).reshape(shape)
    dim = None
    w1 = get(base + ".lokr_w1")
    if w1 is None:
        dim = state[base + ".lokr_w1_b"].shape[0]
        w1 = state[base + ".lokr_w1_a"] @ state[base + ".lokr_w1_b"]
    w2 = get(base + ".lokr_w2")
    if w2 is None:
        dim = state[base + ".lokr_w2_b"].shape[0]
        w2 = state[base + ".lokr_w2_a"] @ state[base + ".lokr_w2_b"]
    if w2.dim() == 4:
        w1 = w1[:, :, None, None]
    scale = float(alpha) / dim if alpha is not None and dim is not None else 1.0
    return scale * torch.kron(w1, w2).reshape(shape)


def planned_params(net, kind: str, factor: int = -1, decompose_both: bool = False) -> int:
    """``adapters.layer_params`` (the memory plan's formula) summed over the adapted layers."""
    total = 0
    for module in net.modules():
        if isinstance(getattr(module, "scaling", None), dict) and "default" in module.scaling:
            layer, rank = module.get_base_layer(), module.r["default"]
            conv = isinstance(layer, torch.nn.Conv2d)
            n_in, n_out = (layer.in_channels, layer.out_channels) if conv else (layer.in_features, layer.out_features)
            kernel = layer.kernel_size[0] * layer.kernel_size[1] if conv else 1
            total += adapters.layer_params(n_in, n_out, rank, kind, factor, decompose_both, kernel)
    return total


def merged_and_base(net) -> tuple[dict, dict]:
    ours = adapters.merged_copy(net).state_dict()
    base = {k.replace("base_layer.", ""): v for k, v in net.state_dict().items() if "base_layer." in k}
    return ours, base


@pytest.mark.parametrize("name", list(NAMES))
def test_the_comfyui_file_gives_our_merged_update(name, family_pipeline, shapes_shards, tmp_path):
    from safetensors.torch import load_file

    pipeline = family_pipeline(name)
    for kind in ("lokr", "loha"):
        over = {"model.adapter.target_regex": TARGETS[name]} if name in TARGETS else {}
        fam, ad = make(pipeline, shapes_shards, tmp_path, kind, **over)
        out = tmp_path / f"export_{kind}"
        adapters.export(ad, fam, fam.net, out, merged=False, kohya=True)
        file = out / (adapters.KOHYA_FILE if name in ("sd", "sdxl") else adapters.COMFY_FILE)
        state = load_file(str(file))
        ours, base = merged_and_base(fam.net)
        layers = [k[:-len(".weight")] for k in base if k.endswith(".weight")]
        assert layers and all(".lokr_" in k or ".hada_" in k or k.endswith(".alpha") for k in state)
        expected = {NAMES[name](layer, fam): layer for layer in layers}
        assert planned_params(fam.net, kind) == sum(p.numel() for p in fam.net.parameters() if p.requires_grad)
        assert {k.rsplit(".", 1)[0] for k in state} == set(expected), (sorted(state)[:6], sorted(expected)[:3])
        for key, layer in expected.items():
            want = ours[layer + ".weight"] - base[layer + ".weight"]
            assert want.abs().max() > 0, layer
            got = comfy_update(state, key, want.shape)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"{name} {kind} {layer}")
        if kind == "lokr" and name in ("sd", "flux"):  # the diffusers file: every model's load_lora_adapter reads it
            net = type(adapters.merged_copy(fam.net)).from_pretrained(pipeline, subfolder=fam.net_name)
            net.load_lora_adapter(str(out), weight_name=adapters.LORA_FILE, prefix=fam.net_name)
            net.fuse_lora()
            fused = {k.replace("base_layer.", ""): v for k, v in net.state_dict().items() if ".lokr_" not in k}
            for layer in layers:
                torch.testing.assert_close(fused[layer + ".weight"], ours[layer + ".weight"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["zimage", "flux2_klein"])
def test_diffusers_loads_the_lokr_files_to_our_merged_net(name, family_pipeline, shapes_shards, tmp_path):
    """The pipelines whose ``lora_state_dict`` converts LoKr files (ai-toolkit's diffusion_model. layout)."""
    from diffusers import DiffusionPipeline

    pipeline = family_pipeline(name)
    over = {"model.adapter.target_regex": TARGETS[name]} if name in TARGETS else {}
    fam, ad = make(pipeline, shapes_shards, tmp_path, "lokr", **over, **{"model.adapter.lokr_factor": 4,
                                                                          "model.adapter.decompose_both": "true"})
    assert planned_params(fam.net, "lokr", 4, True) == sum(p.numel() for p in fam.net.parameters() if p.requires_grad)
    out = tmp_path / "export"
    adapters.export(ad, fam, fam.net, out, merged=False, kohya=True)
    ours, base = merged_and_base(fam.net)
    pipe = DiffusionPipeline.from_pretrained(pipeline)
    for weight_name in (adapters.LORA_FILE, adapters.COMFY_FILE):
        loaded = copy.deepcopy(pipe)
        loaded.load_lora_weights(str(out), weight_name=weight_name)
        loaded.fuse_lora()
        fused = {k.replace("base_layer.", ""): v for k, v in loaded.transformer.state_dict().items()
                 if ".lokr_" not in k}
        moved = [k for k in base if not torch.equal(ours[k], base[k])]
        assert moved
        for k in base:
            torch.testing.assert_close(fused[k], ours[k], atol=1e-5, rtol=0, msg=f"{weight_name}: {k}")


@pytest.mark.parametrize("over, message", [
    ({"model.adapter.type": "lokr", "model.adapter.use_dora": "true"}, r"'model.adapter.use_dora' with model.adapter.type=lokr"),
    ({"model.adapter.type": "loha", "model.adapter.init": "gaussian"}, r"'model.adapter.init' with model.adapter.type=loha"),
    ({"model.adapter.type": "loha", "model.adapter.dropout": 0.1}, r"'model.adapter.dropout' with model.adapter.type=loha"),
    ({"model.adapter.type": "lokr", "model.adapter.text_encoders.train": "true"},
     r"'model.adapter.text_encoders.train' with model.adapter.type=lokr"),
    ({"model.adapter.type": "loha", "model.adapter.lokr_factor": 4}, r"'model.adapter.lokr_factor' applies to model.adapter.type=lokr"),
    ({"model.adapter.type": "lora", "model.adapter.decompose_both": "true"}, r"'model.adapter.decompose_both' applies"),
    ({"model.adapter.type": "lokr", "model.adapter.lokr_factor": 0}, r"'model.adapter.lokr_factor' 0"),
])
def test_what_lokr_and_loha_do_not_take_is_refused_at_load(over, message, tiny_pipeline, shapes_shards, tmp_path):
    with pytest.raises(ConfigError, match=message):
        load(args(tmp_path, tiny_pipeline, shapes_shards, **over))


def test_flux2_fused_layers_are_refused_for_the_comfyui_file(family_pipeline, shapes_shards, tmp_path):
    """BFL's checkpoint fuses q, k and v: a Kronecker / Hadamard update of each is not one of the fused layer."""
    argv = args(tmp_path, family_pipeline("flux2_klein"), shapes_shards, **{"model.adapter.type": "loha"})
    with pytest.raises(ConfigError, match=r"'model.adapter.export_kohya': the transformer's layer "
                                          r"transformer_blocks\.0\.attn\.to_q is one of the 3 layers the original "
                                          r"fuses in double_blocks\.0\.img_attn\.qkv"):
        load(argv)


@pytest.mark.parametrize("name, kind", [("sd", "lokr"), ("flux", "loha")])
def test_a_short_run_trains_only_the_adapter_and_its_exports_hold_it(name, kind, family_pipeline, shapes_shards,
                                                                      tmp_path, monkeypatch):
    """Two fp32 steps with the EMA and validation: only the adapter moves (the base stays the pipeline's, bit for
    bit), the validation loss moves with it, the EMA holds the adapter only, and the export reloads as trained
    (``init_from``'s reader), its ComfyUI file gives the trained net's update, its card's snippet loads it and
    its merged pipeline holds the merged net."""
    from safetensors.torch import load_file

    pipeline = family_pipeline(name)
    cfg = load(args(tmp_path, pipeline, shapes_shards, **{
        "model.adapter.type": kind, "experiment.num_examples_to_see": 8, "experiment.sample_per_prompt": 0,
        "validation.path": shapes_shards, "validation.num_batches": 1, "model.use_ema": "true",
        "optimizer.params.learning_rate": 1e-2, "model.adapter.export_merged": "true"}))
    fam = registry.create(cfg, torch.device("cpu"), cfg.system.seed, True)
    adapters.apply(cfg, fam, None)
    prefix = adapters.adapter_prefix(fam.net)
    start = {n: p.detach().clone() for n, p in fam.net.named_parameters() if p.requires_grad}
    assert start and all(prefix in n for n in start)
    t = run_trainer(cfg)

    trained = {n: p.detach() for n, p in t.net.named_parameters() if p.requires_grad}
    assert trained.keys() == start.keys() == dict(t.ema.shadow.named_parameters()).keys()
    assert all(not torch.equal(trained[n], start[n]) for n in start), [n for n in start if torch.equal(trained[n], start[n])]
    base = {k.replace("base_layer.", ""): v for k, v in t.net.state_dict().items() if prefix not in k}
    original = type(adapters.merged_copy(t.net)).from_pretrained(pipeline, subfolder=fam.net_name).state_dict()
    assert base.keys() == original.keys() and all(torch.equal(base[k], original[k]) for k in base)
    rows = [json.loads(line) for line in (t.run_dir.root / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val/loss"] for r in rows if "val/loss" in r}
    assert sorted(val) == [0, 2] and val[2] != val[0], val

    export = t.run_dir.pipeline(None)
    fresh = registry.create(cfg, torch.device("cpu"), cfg.system.seed, True)
    adapters.load_lora(adapters.apply(cfg, fresh, None), str(export))
    reloaded = {n: p for n, p in fresh.net.named_parameters() if p.requires_grad}
    assert all(torch.equal(reloaded[n], trained[n]) for n in trained)
    state = load_file(str(export / (adapters.KOHYA_FILE if name == "sd" else adapters.COMFY_FILE)))
    ours, base = merged_and_base(t.net)
    # The card's how-to-load snippet (LoKr: the net's load_lora_adapter; LoHa: peft) puts the trained adapter on
    # the base pipeline and makes an image.
    namespace = {}
    monkeypatch.chdir(tmp_path)
    exec(re.search(r"```python\n(.*?)```", (export / "README.md").read_text(), flags=re.S).group(1), namespace)
    loaded = adapters.merged_copy(getattr(namespace["pipe"], fam.net_name)).state_dict()
    assert all(torch.equal(loaded[k], ours[k]) for k in ours) and (tmp_path / "sample.png").is_file()
    merged = type(adapters.merged_copy(t.net)).from_pretrained(export / adapters.MERGED, subfolder=fam.net_name)
    assert all(torch.equal(v, ours[k]) for k, v in merged.state_dict().items())  # export_merged: peft merges both
    for layer in [k[:-len(".weight")] for k in base if k.endswith(".weight")]:
        want = ours[layer + ".weight"] - base[layer + ".weight"]
        got = comfy_update(state, NAMES[name](layer, fam), want.shape)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=layer)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_equal_one_rank_with_the_batch_doubled(tiny_pipeline, shapes_shards, tmp_path):
    """tests/dist_worker.py: 3 AdamW steps on a fixed global batch of 8, 1 rank x 8 against 2 ranks x 4 (fp32,
    gloo), for a LoKr under DDP (decomposed factors too: rank 2 is under half of most sides, decompose_both) and a
    LoHa under FSDP2 (the frozen base sharded); the adapter alone moves."""
    common = {"model.adapter.rank": 2, "model.adapter.export_kohya": "false", "optimizer.params.learning_rate": 1e-3,
              "lr_scheduler.params.warmup_length": 0, "optimizer.params.epsilon": 1e-4}
    kinds = {"lokr": {"model.adapter.type": "lokr", "model.adapter.decompose_both": "true"},
             "loha": {"model.adapter.type": "loha"}}

    def workers(nproc, strategies, **over):
        argv = []
        for kind, strategy in zip(kinds, strategies):
            argv += ["--"] * bool(argv) + [str(tmp_path / f"{kind}{nproc}.pt"), *args(
                tmp_path, tiny_pipeline, shapes_shards, name=f"{kind}{nproc}", **common, **kinds[kind],
                **{"distributed.strategy": strategy}, **over)]
        res = forked.run([sys.executable, str(HERE / "dist_worker.py"), *argv], nproc=nproc, capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]

    workers(1, ("ddp", "ddp"), **{"system.batch_size": 8})
    workers(2, ("ddp", "fsdp"), **{"system.batch_size": 4})
    for kind in kinds:
        one, two = (torch.load(tmp_path / f"{kind}{n}.pt") for n in (1, 2))
        init = torch.load(tmp_path / f"{kind}1.init.pt")
        moved = {k for k in one if not torch.equal(one[k], init[k])}
        assert moved and all(f".{adapters.PREFIXES[kind.upper()]}" in k for k in moved), kind
        assert kind != "lokr" or any(".lokr_w2_b." in k for k in moved)
        assert max_diff(one, init) > 1e-4 and max_diff(one, two) < 1e-5, (kind, max_diff(one, two))


@pytest.mark.slow
def test_a_killed_lokr_run_resumes_bit_identical(tiny_pipeline, shapes_shards, tmp_path):
    """As test_adapters_resume's LoRA run (one process, bf16, a loader worker, the EMA): killed after the step-3
    checkpoint and restarted, it ends with the net (base and LoKr), EMA, optimizer and losses of a straight run."""
    from test_resume import N, args_for, assert_same, final_state, finish, kill_after_checkpoint, launch, losses

    from sd_training.checkpoint import complete_steps

    kw = {"model.adapter.type": "lokr", "model.adapter.rank": 4, "model.adapter.alpha": 8, "model.use_ema": "true",
          "experiment.checkpoint_async": "false", "system.workers": 1, "model.mixed_precision": "bf16"}
    finish(launch(tmp_path, args_for(tmp_path, tiny_pipeline, shapes_shards, "straight", **kw)))
    resumed = args_for(tmp_path, tiny_pipeline, shapes_shards, "resumed", **kw)
    run = tmp_path / "runs" / "resumed"
    kill_after_checkpoint(launch(tmp_path, resumed), run / "checkpoints", 3)
    first = complete_steps(run / "checkpoints")
    assert max(first) < N, first
    assert "resumed from" in finish(launch(tmp_path, resumed))
    a, ta = final_state(tmp_path / "runs" / "straight")
    b, tb = final_state(run)
    assert ta["step"] == tb["step"] == N
    assert any(".lokr_w1" in k for k in a["unet"]) and a["ema"]
    for part in ("unet", "ema", "optimizer", "lr_scheduler"):
        assert_same(a[part], b[part], part)
    la, lb = losses(tmp_path / "runs" / "straight"), losses(run)
    assert all(la[s] == lb[s] for s in range(max(first) + 1, N + 1)), (la, lb)


def test_a_lora_file_is_refused_as_init_from_of_a_lokr(tiny_pipeline, shapes_shards, tmp_path):
    fam, ad = make(tiny_pipeline, shapes_shards, tmp_path, "lora", **{"model.adapter.export_kohya": "false"})
    adapters.export(ad, fam, fam.net, tmp_path / "lora", merged=False)
    cfg = load(args(tmp_path, tiny_pipeline, shapes_shards, **{
        "model.adapter.type": "lokr", "model.adapter.init_from": str(tmp_path / "lora")}))
    with pytest.raises(ConfigError, match=r"'model.adapter.init_from': .* has no unet weights for .*lokr_w1.* "
                                          r"another model.adapter.type"):
        adapters.apply(cfg, registry.create(cfg, torch.device("cpu"), 0, True), None)


@pytest.mark.parametrize("kind, extra", [("lokr", {}), ("lokr", {"model.adapter.lokr_factor": 4,
                                                                    "model.adapter.decompose_both": "true"}),
                                         ("loha", {})])
def test_the_plan_at_config_load_counts_the_adapter_peft_makes(tiny_pipeline, shapes_shards, tmp_path, kind, extra):
    """memory.fit's load-time plan (the net on the meta device) counts the LoKr / LoHa parameters the run makes."""
    from sd_training.memory.fit import load_plan

    over = {"model.adapter.type": kind, "model.adapter.rank": 4, **extra}
    cfg = load(args(tmp_path, tiny_pipeline, shapes_shards, **over))
    family = registry.create(cfg, torch.device("cpu"), 0, True)
    family.adapters = adapters.apply(cfg, family, None)
    made = sum(p.numel() for p in family.net.parameters() if p.requires_grad)
    assert load_plan(cfg).params == made > 0
