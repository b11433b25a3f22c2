"""The production path on the CPU: every precision x strategy x EMA x target x data x text-encoder
combination a user can configure either trains 2 steps, checkpoints, exports, writes a sample grid
and eval images and resumes, or is refused at start-up with a reason.

bf16 and fp16 autocast run on the CPU, so the class of defect that only showed on GPUs (a bf16 VAE
fed fp32 latents by the pipeline at the first sample grid, after the checkpoint was already written)
is caught here. The runnable combinations are grouped so that every value of every axis runs, bf16
with each strategy and each EMA placement, in 9 runs of two launches each.
"""

import json
import os
import sys
from pathlib import Path

import forked
import pytest
from conftest import run_precompute, train_args

ROOT = Path(__file__).resolve().parents[1]
RES = 32

# (mixed_precision, ranks, strategy, ema, train_target, data, text_encoder.train)
# Two runs were dropped as adding no axis value (a run costs the suite 1-2 min): bf16 x 1 x ddp x EMA on
# the device x unet x pixels (the default path: bf16 and EMA on the device run in the vae and fsdp rows below,
# pixels and 1 rank in most) and fp32 x 1 x ddp x device x unet x latents (fp32 unet runs on 2 ranks under
# fsdp, fp32 on 1 rank for the vae, latents in three rows, EMA on the device in three; the unet with EMA on the
# device on 1 rank trains, checkpoints, exports and resumes in test_resume[1-ddp-*], in bf16 and fp32).
RUNNABLE = [
    ("bf16", 1, "ddp", "cpu", "unet", "latents", False),
    ("bf16", 1, "ddp", "off", "unet", "pixels", True),
    ("fp16", 1, "ddp", "cpu", "unet", "pixels", True),
    ("bf16", 1, "ddp", "device", "vae", "pixels", False),
    ("no", 1, "ddp", "cpu", "vae", "pixels", False),
    pytest.param("bf16", 2, "ddp", "cpu", "unet", "pixels", True, marks=pytest.mark.distributed),
    pytest.param("fp16", 2, "ddp", "device", "unet", "latents", False, marks=pytest.mark.distributed),
    pytest.param("bf16", 2, "fsdp", "device", "unet", "latents", False, marks=pytest.mark.distributed),
    pytest.param("no", 2, "fsdp", "off", "unet", "pixels", False, marks=pytest.mark.distributed),
]

# Refused at start-up, with the words the error must contain.
REFUSED = [
    ({"model.mixed_precision": "fp16", "distributed.strategy": "fsdp"}, "model.mixed_precision=bf16"),
    ({"model.text_encoder.train": "true", "distributed.strategy": "fsdp"}, "use ddp"),
    ({"model.use_ema": "true", "model.ema.device": "cpu", "distributed.strategy": "fsdp"}, "sharded like the UNet"),
    ({"model.train_target": "vae", "distributed.strategy": "fsdp"}, "distributed.strategy=ddp"),
    ({"model.train_target": "vae", "model.mixed_precision": "fp16"}, "model.mixed_precision"),
]


@pytest.fixture(scope="module")
def latent_shards(tmp_path_factory, tiny_pipeline, shapes_shards):
    out = tmp_path_factory.mktemp("latents") / "out"
    run_precompute(["--input", shapes_shards, "--pipeline", str(tiny_pipeline), "--output", str(out),
                           "--resolution", str(RES), "--dtype", "fp32", "--batch-size", "32", "--workers", "0",
                           "--no-progress"])
    return str(out)


def launch(cwd, args, ranks):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if ranks == 1:
        cmd = [sys.executable, str(ROOT / "train.py"), *args]
    else:
        from test_distributed import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(ROOT / "train.py"), *args]
    res = forked.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)  # forked: no imports
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    return res.stdout + res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("precision, ranks, strategy, ema, target, data, train_te", RUNNABLE)
def test_combination_trains_checkpoints_exports_samples_and_resumes(
    tmp_path, tiny_pipeline, shapes_shards, latent_shards, precision, ranks, strategy, ema, target, data, train_te,
):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle on a blue background\na green square on a white background\n")
    batch = 4 // ranks
    kw = {
        "model.mixed_precision": precision, "distributed.strategy": strategy, "model.train_target": target,
        "model.use_ema": str(ema != "off").lower(), "model.ema.device": "cpu" if ema == "cpu" else "auto",
        "model.text_encoder.train": str(train_te).lower(), "system.batch_size": batch, "system.workers": 1,
        "dataset.params.resolution": RES, "experiment.num_examples_to_see": 2 * 4, "experiment.save_every": 2,
        "experiment.checkpoint_every": 2, "experiment.sample_steps": 2,
    }
    if target == "unet":
        kw.update({"experiment.num_eval_images": 2, "experiment.eval_caption_file": str(prompts)})
    if data == "latents":
        kw.update({"dataset.type": "latents", "dataset.params.latent_sampling": "mean"})
    source = latent_shards if data == "latents" else shapes_shards
    args = train_args(tmp_path, tiny_pipeline, source, name="m", **kw)
    launch(tmp_path, args, ranks)
    run = tmp_path / "runs" / "m"
    assert (run / "checkpoints" / "step_00000002").is_dir()
    assert (run / "samples" / "step_00000002.png").is_file()
    if target == "unet":
        assert sorted(p.name for p in (run / "eval" / "step_00000002").glob("*.png")) == ["000000.png", "000001.png"]
    # One more step from the checkpoint: the resume path in the same precision and layout.
    out = launch(tmp_path, [a if not a.startswith("experiment.num_examples_to_see=") else
                            "experiment.num_examples_to_see=12" for a in args], ranks)
    assert "resumed from" in out and "at step 2" in out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert steps == [1, 2, 3]
    assert (run / "samples" / "step_00000003.png").is_file()
    # The export is a complete diffusers pipeline with fp32 weights, whatever the training precision.
    from safetensors import safe_open

    component = "unet" if target == "unet" else "vae"
    files = list((run / "current_pipeline" / component).glob("*.safetensors"))
    assert files and json.loads((run / "current_pipeline" / "model_index.json").read_text())
    with safe_open(files[0], "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F32"}


@pytest.mark.parametrize("overrides, reason", REFUSED)
def test_unsupported_combination_is_refused_at_start_up_with_a_reason(tmp_path, tiny_pipeline, shapes_shards,
                                                                      overrides, reason):
    from sd_training.config import ConfigError
    from sd_training.configure import load

    with pytest.raises(ConfigError, match=reason.replace(".", r"\.")):
        load(train_args(tmp_path, tiny_pipeline, shapes_shards, **overrides))
