"""benchmarks/bench_memory.py on the CPU: the tiny SDXL-shaped pipeline trains two steps through the Trainer
in a LoRA and a full fine-tune (one process each), and its JSON holds the measured peaks, images/s and the
start-up memory plan's rows, which equal the tensors the trainer held. The single-GPU full fine-tunes run
too: FSDP2 with CPU offload on one rank, the optimizer in the backward, and (where bitsandbytes is
installed) 8-bit AdamW in the backward."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import forked
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_memory  # noqa: E402


def test_the_full_size_model_has_sdxl_shapes():
    """What the GPU run builds (on the meta device here): SDXL's UNet (2.57B), its two CLIPs and VAE, whose
    widths meet the UNet's cross-attention and added conditioning."""
    import yaml
    from diffusers import UNet2DConditionModel

    from sd_training.memory.load import meta_module

    spec = yaml.safe_load(bench_memory.MODELS.read_text())["sdxl"]
    net = meta_module(spec["net"], "UNet2DConditionModel")
    assert isinstance(net, UNet2DConditionModel) and sum(p.numel() for p in net.parameters()) == spec["net_params"]
    assert spec["net_params"] == 2_567_463_684
    parts = {k: meta_module(c["config"], c["class"]) for k, c in spec["components"].items()}
    counts = {k: sum(p.numel() for p in m.parameters()) for k, m in parts.items()}
    assert counts["text_encoder"] == pytest.approx(123.1e6, rel=0.01)
    assert counts["text_encoder_2"] == pytest.approx(694.7e6, rel=0.01)
    assert counts["vae"] == pytest.approx(83.65e6, rel=0.01)
    te, te2, n = spec["components"]["text_encoder"]["config"], spec["components"]["text_encoder_2"]["config"], spec["net"]
    assert te["hidden_size"] + te2["hidden_size"] == n["cross_attention_dim"] == 2048
    assert te2["projection_dim"] + 6 * n["addition_time_embed_dim"] == n["projection_class_embeddings_input_dim"]
    assert bench_memory.modes_of(bench_memory.parse(["--mode", "lora", "--mode", "full,lora"])) == ["lora", "full"]
    assert bench_memory.modes_of(bench_memory.parse(["--mode", "all"])) == list(bench_memory.MODES)
    assert {"offload", "opt_in_backward", "adam8bit", "adam8bit+opt_in_backward"} <= set(bench_memory.MODES)
    with pytest.raises(SystemExit, match="unknown mode"):
        bench_memory.modes_of(bench_memory.parse(["--mode", "offload_everything"]))


@pytest.mark.slow
def test_bench_memory_runs_its_modes_on_the_cpu_and_the_plan_matches_the_trainer(tmp_path, sdxl_pipeline):
    out, work = tmp_path / "bench_memory.json", tmp_path / "work"
    work.mkdir()
    (work / "pipeline_sdxl-tiny").symlink_to(sdxl_pipeline)  # the session's tiny SDXL pipeline, not a second one
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    modes = ["lora", "full", "offload", "opt_in_backward"]
    if importlib.util.find_spec("bitsandbytes") is not None:
        modes.append("adam8bit+opt_in_backward")
    proc = forked.run([sys.executable, "benchmarks/bench_memory.py", "--device", "cpu", "--mode", ",".join(modes),
                       "--steps", "2", "--resolution", "32", "--work", str(work), "--out", str(out), "--checkpoint"],
                      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model"] == "sdxl-tiny" and result["device"] == "cpu" and set(result["results"]) == set(modes)
    lora, full = result["results"]["lora"], result["results"]["full"]
    for r in (lora, full):
        assert "error" not in r, r.get("log_tail")
        m = r["measured"]
        assert m["peak_rss_gib"] > 0 and r["images_per_sec"] > 0 and len(r["losses"]) == 2
        assert r["plan"]["strategy"] == "ddp" and r["plan"]["row"]["total"] > 0
        # The plan's rows are the tensors the trainer held (AdamW's state adds its step counters).
        for key, (planned, held) in r["plan_vs_measured_gib"].items():
            assert held == pytest.approx(planned, rel=1e-3, abs=1e-6), key
        assert r["plan"]["row"]["trained_params"] == m["trained_params"] and m["trained_dtypes"] == ["float32"]
    # LoRA: the adapter alone trains; the net's base is frozen in bf16 with no gradients or optimizer state.
    assert 0 < lora["measured"]["trained_params"] < full["measured"]["trained_params"] / 50
    assert lora["measured"]["base_params_by_dtype"] == {"bfloat16": full["measured"]["trained_params"]}
    assert full["measured"]["base_params"] == 0 and lora["net_params"] == full["net_params"]
    assert lora["measured"]["optimizer_state_bytes"] < full["measured"]["optimizer_state_bytes"] / 50
    assert lora["losses"][0] == full["losses"][0]  # the same first batch, noise and weights
    summary = result["summary"]
    assert summary["lora"]["plan_total_gib"] < summary["full"]["plan_total_gib"]
    assert "lora" in proc.stdout and "plan/peak" in proc.stdout
    assert result["levers"] == {"compile": "none", "compile_mode": "default", "channels_last": "auto"}
    # --checkpoint: two asynchronous resume checkpoints after the steps, each timed (stall and write)
    for r in (lora, full):
        ck = r["checkpoint"]
        assert ck["asynchronous"] and len(ck["saves"]) == 2 and ck["stall_s"] == max(s["stall_s"] for s in ck["saves"])
        assert all(0 <= s["stall_s"] <= s["save_s"] for s in ck["saves"])
        assert summary[r["mode"]]["checkpoint_stall_s"] == ck["stall_s"] and "training waited" in proc.stdout
    # the full fine-tune's checkpoint holds at least its fp32 weights and AdamW's two moments
    assert min(s["bytes"] for s in full["checkpoint"]["saves"]) >= 3 * full["measured"]["trained_bytes"]
    # The single-GPU full fine-tunes: every weight trains in each.
    res = result["results"]
    for mode in modes[2:]:
        r = res[mode]
        assert "error" not in r, r.get("log_tail")
        assert r["measured"]["trained_params"] == full["measured"]["trained_params"] and len(r["losses"]) == 2
        assert r["losses"][0] == pytest.approx(full["losses"][0], rel=2e-2)  # the same first batch and weights
    # FSDP2 with CPU offload on one rank: the plan's fsdp_offload row (nothing trained on the GPU).
    offload = res["offload"]
    assert offload["plan"]["strategy"] == "fsdp_offload" and offload["plan"]["row"]["weights"] == 0
    assert offload["measured"]["trained_on"] == ["cpu"] and offload["measured"]["optimizer_state_on"] == ["cpu"]
    # The optimizer in the backward: the step's gradients are gone when the backward returns.
    for mode in modes[3:]:
        assert res[mode]["measured"]["gradient_bytes"] == 0, mode
    assert full["measured"]["gradient_bytes"] == full["measured"]["trained_bytes"]
    assert res["opt_in_backward"]["losses"][0] == full["losses"][0]
    if "adam8bit+opt_in_backward" in res:  # 8-bit moments: about a quarter of AdamW's 8 bytes per parameter
        m8 = res["adam8bit+opt_in_backward"]["measured"]
        assert "uint8" in m8["optimizer_state_dtypes"]
        assert m8["optimizer_state_bytes"] < full["measured"]["optimizer_state_bytes"] / 2.5


# ----------------------------------------------------------------------------------------------
# Issue 36: the single-GPU modes (levers) and the big families' latent-shard data path
# ----------------------------------------------------------------------------------------------

import bench_memory_models  # noqa: E402
import bench_memory_modes  # noqa: E402

TINY_LLM = "zimage-tiny"  # the tiny Z-Image pipeline reading latent shards with stored text (memory_models.yaml)


@pytest.fixture(scope="module")
def zimage_work(tmp_path_factory, family_pipeline):
    """bench_memory's work folder for the tiny Z-Image: its pipeline (the session's) and the latent shards with
    stored text of 32 px shape images, written by scripts/precompute_latents.py as the benchmark writes them."""
    work = tmp_path_factory.mktemp("bench_zimage")
    (work / f"pipeline_{TINY_LLM}").symlink_to(family_pipeline("zimage"))
    _name, spec = bench_memory_models.load_spec(str(bench_memory.MODELS), TINY_LLM, "cpu")
    shards = bench_memory_models.batches(spec, TINY_LLM, work / f"pipeline_{TINY_LLM}", work, 32, 1, "cpu")
    return work, spec, shards


def value_at(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("mode", list(bench_memory.MODES))
def test_each_mode_loads_as_the_config_its_run_trains_with(mode, zimage_work):
    """Each mode's overrides (one table of levers) on the latent-shard config pass the trainer's own config load
    and checks, and each key holds the lever's value; a mode whose key (or value) this build lacks is skipped
    naming it, and turns on when the lever lands."""
    work, spec, shards = zimage_work
    overrides = bench_memory_modes.overrides(mode, spec)
    missing = bench_memory_modes.missing_keys(overrides)
    if missing:
        pytest.skip(f"mode {mode}: this build's config has no {', '.join(missing)} (its lever has not landed)")
    args = bench_memory.parse(["--device", "cpu", "--model", TINY_LLM, "--resolution", "32", "--work", str(work)])
    cfg = bench_memory.trainer_config(args, spec, mode, str(work / f"pipeline_{TINY_LLM}"), shards)
    assert overrides["dataset.type"] == "latents" and overrides["dataset.params.text_embeddings"] is True
    for key, want in overrides.items():
        assert value_at(cfg, key) == (None if want == "null" else want), key


def test_a_mode_without_its_key_is_reported_not_run():
    """The skip names the key (or the value a key does not take yet); a lever's config key is written once."""
    spec = {"lora": {"rank": 4}, "block_swap": {"full_swap": 3}}
    assert bench_memory_modes.missing_keys({"model.nope_lever": 1}) == ["model.nope_lever"]
    assert bench_memory_modes.missing_keys({"model.adapter.type": "no_such_adapter"}) == [
        "model.adapter.type=no_such_adapter"]
    assert bench_memory_modes.missing_keys({"model.transformer.params": {"num_layers": 2}}) == []
    assert bench_memory_modes.overrides("full_swap", spec)[bench_memory_modes.KEYS["block_swap"]] == 3
    reason = bench_memory.skip_reason("full_swap", {**spec, "family": "zimage"})
    assert reason is None or bench_memory_modes.KEYS["block_swap"] in reason
    with pytest.raises(SystemExit, match="block_swap"):  # a swapping mode needs the spec's count ...
        bench_memory_modes.overrides("lora_swap", spec)
    reason = bench_memory.skip_reason("lora_swap", {**spec, "family": "zimage"})  # ... else it is skipped, saying so
    assert reason.startswith("skipped:") and "block_swap" in reason and "lora_swap" in reason


def test_the_big_families_take_their_shapes_from_the_reference_models():
    """flux, qwen_image, zimage, flux2_klein and flux2_dev: the transformer of the family's reference model
    (published parameter counts), its VAE, and encoder stand-ins whose width is the reference encoder's and
    feeds the transformer's text input; goals as issue 36 states them."""
    import yaml

    from sd_training.families.reference_models import ENCODERS
    from sd_training.families.registry import FAMILIES

    models = yaml.safe_load(bench_memory.MODELS.read_text())
    billions = {"flux": 11.9, "qwen_image": 20.43, "zimage": 6.15, "flux2_klein": 3.88, "flux2_dev": 32.2}
    for name, size in billions.items():
        _n, spec = bench_memory_models.load_spec(str(bench_memory.MODELS), name, "cuda")
        ref = FAMILIES[spec["family"]].reference_models()[models[name]["reference"]]
        assert spec["data"] == "latents" and spec["resolution"] == 1024
        assert spec["net"] == bench_memory_models.as_lists(ref.config)
        assert bench_memory_models.net_params(spec) / 1e9 == pytest.approx(size, rel=0.01), name
        widths = {c: e["width"] for c, e in spec["components"].items() if "stand_in" in e}
        assert list(widths.values()) == [bench_memory_models.encoder_width(ENCODERS[e][1]) for e in ref.encoders]
        net, text = spec["net"], widths["text_encoder"]
        layers = 3 if spec["family"].startswith("flux2") else 1  # FLUX.2 stacks three layers' states
        text_in = net.get("cap_feat_dim") or net["joint_attention_dim"]
        assert text_in == layers * (widths.get("text_encoder_2") or text), name
        if spec["family"] == "flux":
            assert net["pooled_projection_dim"] == text  # CLIP-L's pooled output
    goals = {m: models[m]["goals"] for m in ("flux", "qwen_image", "zimage", "flux2_dev", "sdxl")}
    assert goals["flux"]["lora_nf4"] == goals["flux"]["lora_fp8"] == 10 and goals["flux"]["full_swap_adafactor"] == 16
    assert models["flux"]["speed_goals"]["lora_nf4"] == 0.5 and goals["sdxl"]["full_swap_8bit"] == 12
    assert goals["qwen_image"]["lora_nf4"] == 16 and goals["flux2_dev"]["lora_nf4"] == 24
    assert goals["zimage"]["lora_fp8"] == 8
    for name, spec in models.items():  # every swapping mode with a goal has its count
        for mode in (spec.get("goals") or {}) if name != "defaults" else ():
            assert mode in bench_memory.MODES, (name, mode)
            if "swap" in bench_memory_modes.MODE_LEVERS[mode][1]:
                assert spec["block_swap"][mode] > 0, (name, mode)


@pytest.mark.parametrize("family", ["zimage", "qwen_image"])
def test_a_stand_in_encoder_keeps_the_tiny_one_but_its_width(family, family_pipeline):
    """The stand-in of a text encoder: the tiny pipeline's (its vocabulary, layers and head size) at another
    hidden width, which its hidden states then have (Qwen2.5-VL: heads scaled to keep the head size)."""
    import json

    import torch

    folder = family_pipeline(family) / "text_encoder"
    cls = json.loads((folder.parent / "model_index.json").read_text())["text_encoder"][1]
    tiny = json.loads((folder / "config.json").read_text())
    text = tiny.get("text_config", tiny)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        wide = bench_memory_models.stand_in_encoder(folder, cls, 2 * text["hidden_size"])
    conf = getattr(wide.config, "text_config", None) or wide.config
    assert conf.num_hidden_layers == text["num_hidden_layers"] and conf.vocab_size == text["vocab_size"]
    ids = torch.randint(0, text["vocab_size"], (1, 5))
    with torch.no_grad():
        out = wide(input_ids=ids, output_hidden_states=True)
    assert out.hidden_states[-1].shape[-1] == 2 * text["hidden_size"]
    assert len(out.hidden_states) == text["num_hidden_layers"] + 1


def test_the_latent_shard_path_trains_with_the_encoders_and_vae_off_the_device(zimage_work):
    """bench_memory on the tiny Z-Image from its latent shards with stored text: two steps of a LoRA whose
    batches hold latents and text states (no pixels), with the text encoder and the VAE placed off the device
    (``placement_of``: offload) and in host memory after the steps; the plan's rows are the tensors the trainer
    held. (The other modes on this path: their configs above; each one's run costs a process, ~12 CPU-s.)"""
    work, _spec, _shards = zimage_work
    out = work / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = forked.run([sys.executable, "benchmarks/bench_memory.py", "--device", "cpu", "--model", TINY_LLM,
                       "--mode", "lora", "--steps", "2", "--work", str(work), "--out", str(out)],
                      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model"] == TINY_LLM and result["data"] == "latents" and result["resolution"] == 32
    lora = result["results"]["lora"]
    assert "error" not in lora, lora.get("log_tail")
    assert {"latents", "encoder_hidden_states"} <= set(lora["batch_keys"]) and "pixel_values" not in lora["batch_keys"]
    offloaded = {"placement": "offload", "weights_on": ["cpu"]}
    assert lora["off_device"] == {"text_encoder": offloaded, "vae": offloaded}
    assert len(lora["losses"]) == 2 and all(x == x for x in lora["losses"]) and lora["steps_per_sec"] > 0
    assert 0 < lora["measured"]["trained_params"] < lora["net_params"] / 10
    for key, (planned, held) in lora["plan_vs_measured_gib"].items():
        assert held == pytest.approx(planned, rel=1e-3, abs=1e-6), key
    # docs/memory.md's rows from the JSON: the plan beside the measured peak; a skipped mode says why
    import memory_table

    table = memory_table.rows(result)
    assert len(table) == 1 and table[0].startswith(f"| {TINY_LLM} (cpu, 32 px, batch 1) | `lora` |")
    assert f"| {result['summary']['lora']['peak_gib']:.1f} |" in table[0]
    skipped = {**result, "summary": {"lokr": {"error": "skipped: this build's config has no x", "skipped": True}}}
    assert "| skipped: this build's config has no x |" in memory_table.rows(skipped)[0]
