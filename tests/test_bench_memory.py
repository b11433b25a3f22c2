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
