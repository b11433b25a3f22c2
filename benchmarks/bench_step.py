"""Overhead of our training step over a minimal hand-written diffusers loop; SD 1.x throughput and MFU on GPU.

    python benchmarks/bench_step.py                       # CPU: tiny pipeline, batch 8, fp32
    python benchmarks/bench_step.py --device cuda         # + SD 1.x UNet at 256 and 512 px in bf16
    python benchmarks/bench_step.py --device cuda --sd-only --sd-resolutions 512 --sd-batch 32 \
        --compile --channels-last on --sd-baseline --profile  # compiled + channels-last vs eager, by kernel kind

Speed levers (issue 24), for our Trainer in every section: ``--compile [auto|blocks|whole]`` (model.compile
and model.compile_scope; the first step's seconds are the compile warm-up), ``--compile-cache DIR``
(model.compile_cache: run twice with the same DIR and a fresh TORCHINDUCTOR_CACHE_DIR each time, the
second is a requeue's warm-up), ``--channels-last auto|on|off`` (model.channels_last), ``--sd-baseline``
(the SD rows first eager in the default NCHW layout, each later row's speed-up against it), ``--profile``
(device time by kernel kind of the last SD row, or of the tiny step without the SD section: see
benchmarks/kernel_kinds.py).

Ours: ``sd_training.loop.Trainer`` after ``_setup()`` (tiny config from ``sd_training.configure.load``),
one ``micro_step(batch, sync=True)`` then ``optimizer_step()``. Baseline: what diffusers'
train_text_to_image.py does per step - VAE encode, text encode, noise, add_noise, UNet, MSE,
backward, clip_grad_norm_, AdamW step, LR scheduler step, zero_grad - on its own copy of the same
models from the same folder. Same batch (already in memory, on the device), precision and device.

The two are timed interleaved in one process (ours, baseline, baseline, ours, ...: the order flips
every trial so drift and cache effects hit both alike) after a warm-up, one step at a time (with a
device sync on GPU); the medians are compared. Target: overhead <= 3%.

Writes benchmarks/results/bench_step.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kernel_kinds import profile_steps  # noqa: E402  (benchmarks/ is not a package)

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
SD1_UNET = dict(  # Stable Diffusion 1.x: the diffusers defaults with CLIP ViT-L/14's 768-wide text states
    sample_size=64, block_out_channels=[320, 640, 1280, 1280], cross_attention_dim=768, attention_head_dim=8,
)
SD1_TEXT_ENCODER = dict(  # CLIP ViT-L/14 text tower, as in SD 1.x
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
    vocab_size=49408, projection_dim=768, hidden_act="quick_gelu", bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--precision", default=None, help="no | bf16 | fp16 (default: no on CPU, bf16 on CUDA)")
    p.add_argument("--batch", type=int, default=8, help="images per step (tiny comparison)")
    p.add_argument("--resolution", type=int, default=64, help="pixels (tiny comparison)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of each before timing")
    p.add_argument("--trials", type=int, default=12, help="interleaved trials")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each per trial")
    p.add_argument("--sd", action="store_true", help="also run the SD 1.x section (default: on CUDA only)")
    p.add_argument("--sd-resolutions", default="256,512", help="pixels of the SD 1.x section")
    p.add_argument("--sd-batch", default="64,16", help="images per step at each SD resolution")
    p.add_argument("--sd-steps", type=int, default=10, help="timed steps per SD resolution (after 3 warm-up)")
    p.add_argument("--sd-unet", default=None, help="JSON UNet params replacing SD 1.x's (smoke tests on CPU)")
    p.add_argument("--sd-text-encoder", default=None,
                   help="JSON CLIP text config entries over SD 1.x's (smoke tests on CPU: a small hidden_size)")
    p.add_argument("--sd-only", action="store_true", help="only the SD 1.x section (no tiny comparison, syncs, stall)")
    p.add_argument("--sd-baseline", action="store_true",
                   help="SD section: first the eager NCHW row (no compile, channels-last off), then the chosen levers")
    p.add_argument("--compile", nargs="?", const="auto", default="none", choices=("none", "auto", "blocks", "whole"),
                   help="model.compile for our step, with this model.compile_scope (auto: the family's; blocks; whole)")
    p.add_argument("--compile-mode", default="default",
                   choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                   help="model.compile_mode with --compile (reduce-overhead: CUDA graphs)")
    p.add_argument("--compile-cache", default=None, help="model.compile_cache: folder of the compiler's cache artifacts")
    p.add_argument("--channels-last", default="auto", choices=("auto", "on", "off"), help="model.channels_last")
    p.add_argument("--profile", action="store_true", help="device time by kernel kind (torch.profiler)")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps (after the timed ones)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense peak TFLOP/s per device (default: table)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's). On a shared machine 1 keeps other jobs' load from "
                        "stalling every op (with 2 threads on 2 busy cores a step was measured up to 100x slower)")
    p.add_argument("--out", default=str(HERE / "results" / "bench_step.json"), help="JSON result")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# The two steps.
# ----------------------------------------------------------------------------------------------


def levers(args, baseline: bool = False) -> dict:
    """Config keys of the speed levers chosen on the command line (``baseline``: eager, NCHW)."""
    if baseline:
        return {"model.compile": "false", "model.channels_last": "off"}
    out = {"model.channels_last": args.channels_last, "model.compile": str(args.compile != "none").lower()}
    if args.compile != "none":
        out["model.compile_scope"] = args.compile
        out["model.compile_mode"] = args.compile_mode
        if args.compile_cache:
            out["model.compile_cache"] = args.compile_cache
    return out


def make_trainer(root: Path, pipeline: Path, shards: str, device: str, precision: str, batch: int, resolution: int,
                 yaml_text: str | None = None, name: str | None = None, extra: dict | None = None):
    """A real Trainer after ``_setup()`` on a tiny config (as tests/conftest.py's train_args); ``extra``:
    more key=value settings (the speed levers)."""
    from sd_training import distributed
    from sd_training.configure import load
    from sd_training.loop import Trainer

    args = {
        "experiment.log_dir": str(root / "runs"), "experiment.name": name or f"bench_{resolution}",
        "experiment.num_examples_to_see": 10**6, "experiment.sample_per_prompt": 0, "experiment.resume": False,
        "system.batch_size": batch, "system.workers": 0, "system.device": device,
        "model.pretrained": str(pipeline),
        # Quoted: YAML 1.1 reads a bare `no` as False, which the schema then rejects.
        "model.mixed_precision": f"'{precision}'",
        "dataset.params.path": shards, "dataset.params.resolution": resolution, "dataset.params.resampled": True,
        "wandb.mode": "disabled", "lr_scheduler.params.warmup_length": 0, **(extra or {}),
    }
    cfg = load([f"{k}={v}" for k, v in args.items()], yaml_text=yaml_text)
    trainer = Trainer(cfg, distributed.setup(device))
    trainer.setup()
    return trainer


def ours_step(trainer, batch: dict) -> None:
    trainer.micro_step(batch, sync=True)
    trainer.optimizer_step()


class Baseline:
    """The per-step lines of diffusers' examples/text_to_image/train_text_to_image.py, nothing more."""

    def __init__(self, pipeline: Path, device: torch.device, precision: str, lr: float, weight_decay: float, max_norm: float):
        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
        from transformers import CLIPTextModel

        self.device = device
        self.vae = AutoencoderKL.from_pretrained(pipeline, subfolder="vae").to(device).requires_grad_(False).eval()
        self.text_encoder = CLIPTextModel.from_pretrained(pipeline, subfolder="text_encoder").to(device).requires_grad_(False).eval()
        self.unet = UNet2DConditionModel.from_pretrained(pipeline, subfolder="unet").to(device).train()
        self.scheduler = DDPMScheduler.from_pretrained(pipeline, subfolder="scheduler")
        self.optimizer = torch.optim.AdamW(self.unet.parameters(), lr=lr, weight_decay=weight_decay)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        self.dtype = AUTOCAST.get(precision)
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.max_norm = max_norm

    def step(self, batch: dict) -> None:
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            with torch.no_grad():
                latents = self.vae.encode(batch["pixel_values"]).latent_dist.sample() * self.vae.config.scaling_factor
                hidden = self.text_encoder(batch["input_ids"], return_dict=False)[0]
            noise = torch.randn_like(latents)
            t = torch.randint(0, self.scheduler.config.num_train_timesteps, (latents.shape[0],), device=latents.device)
            noisy = self.scheduler.add_noise(latents, noise, t)
            pred = self.unet(noisy, t, hidden, return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.unet.parameters(), self.max_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


def make_batch(tokenizer, batch: int, resolution: int, device: torch.device, latents: int | None = None) -> dict:
    """Real token ids and fixed pixels (or latents), already on the device."""
    g = torch.Generator().manual_seed(0)
    words = ["red", "green", "blue", "yellow"]
    ids = tokenizer([f"a {words[i % 4]} shape number {i}" for i in range(batch)], padding="max_length",
                    max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt").input_ids
    out = {"input_ids": ids.to(device)}
    if latents:
        out["latents"] = torch.randn(batch, 4, latents, latents, generator=g).to(device)
    else:
        out["pixel_values"] = (torch.rand(batch, 3, resolution, resolution, generator=g) * 2 - 1).to(device)
    return out


# ----------------------------------------------------------------------------------------------
# Timing.
# ----------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # note: a host-device sync, so each step is timed whole


def timed_steps(fn, n: int, device: torch.device) -> list[float]:
    times = []
    for _ in range(n):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def interleaved(ours, baseline, device, warmup: int, trials: int, steps: int) -> dict:
    for fn in (ours, baseline):
        timed_steps(fn, warmup, device)
    times = {"ours": [], "baseline": []}
    per_trial = []
    for t in range(trials):
        order = [("ours", ours), ("baseline", baseline)]
        if t % 2:
            order.reverse()
        trial = {}
        for name, fn in order:
            trial[name] = timed_steps(fn, steps, device)
            times[name] += trial[name]
        per_trial.append(statistics.median(trial["ours"]) / statistics.median(trial["baseline"]))
    ours_s, base_s = statistics.median(times["ours"]), statistics.median(times["baseline"])
    return {
        "ours_median_step_s": ours_s,
        "baseline_median_step_s": base_s,
        "ratio": ours_s / base_s,
        "overhead_pct": 100 * (ours_s / base_s - 1),
        "per_trial_ratio": {"min": min(per_trial), "median": statistics.median(per_trial), "max": max(per_trial)},
        "ours_step_s": {"min": min(times["ours"]), "max": max(times["ours"])},
        "baseline_step_s": {"min": min(times["baseline"]), "max": max(times["baseline"])},
        "timed_steps_each": len(times["ours"]),
    }


# ----------------------------------------------------------------------------------------------
# Sections.
# ----------------------------------------------------------------------------------------------


def bench_overhead(root: Path, pipeline: Path, shards: str, args) -> dict:
    device = torch.device(args.device)
    trainer = make_trainer(root, pipeline, shards, args.device, args.precision, args.batch, args.resolution,
                           extra=levers(args))
    p = trainer.cfg.optimizer.params
    base = Baseline(pipeline, device, args.precision, p.learning_rate, p.weight_decay, p.max_grad_norm)
    batch = make_batch(trainer.models.tokenizer, args.batch, args.resolution, device)
    result = interleaved(lambda: ours_step(trainer, batch), lambda: base.step(batch), device,
                         args.warmup, args.trials, args.steps)
    result["ours_images_per_sec"] = args.batch / result["ours_median_step_s"]
    result["baseline_images_per_sec"] = args.batch / result["baseline_median_step_s"]
    result["target_overhead_pct"] = 3.0
    result["within_target"] = result["overhead_pct"] <= 3.0
    return result, trainer, batch


def count_host_syncs(trainer, batch: dict, device: torch.device, steps: int) -> list[str]:
    """Calls in ``steps`` of our step that make the host wait for the device. CUDA: every synchronisation
    the sync debug mode reports; CPU: the blocking tensor calls (.item(), bool(), .cpu(), ...) that would."""
    import warnings

    from sd_training.speed.sync_count import BlockingCalls

    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    ours_step(trainer, batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    with BlockingCalls() as calls:
        for _ in range(steps):
            ours_step(trainer, batch)
    return [name for _, name in calls.found]


def bench_host_syncs(root: Path, pipeline: Path, shards: str, args, trainer, batch: dict) -> dict:
    """Host synchronisations per step (goal 0) with the fused AdamW (the CUDA default, also on CPU here)
    and with the optimizer this run's device picks by default."""
    device = torch.device(args.device)
    fused = make_trainer(root, pipeline, shards, args.device, args.precision, args.batch, args.resolution,
                         yaml_text="optimizer:\n  implementation: fused\n", name="bench_fused")
    ours_step(fused, batch)  # warm-up (lazy state)
    out = {"steps": args.steps, "goal": 0}
    for label, t in (("fused_adamw", fused), ("default_" + type(trainer.optimizer).__name__, trainer)):
        found = count_host_syncs(t, batch, device, args.steps)
        out[label] = {"syncs_per_step": len(found) / args.steps, "first": found[:5],
                      "fused": bool(t.optimizer.defaults.get("fused"))}
    return out


def bench_checkpoint_stall(trainer, step_s: float, saves: int = 3) -> dict:
    """How long one resume checkpoint holds the training thread, synchronous (the baseline) against
    asynchronous, as a share of the training time at checkpoint_every=100 (goal: under 1%)."""
    out = {}
    ck = trainer.checkpoints.store
    for mode in ("synchronous", "asynchronous"):
        ck.asynchronous = mode == "asynchronous"
        stalls, totals = [], []
        for _ in range(saves):
            t0 = time.perf_counter()
            trainer.checkpoints.save()
            stalls.append(ck.last_stall_s)
            ck.wait()
            totals.append(time.perf_counter() - t0)
            trainer.state.step += 1  # the next save is a new step folder
        stall = statistics.median(stalls)
        out[mode] = {"stall_s": stall, "save_to_disk_s": statistics.median(totals),
                     "stall_pct_at_checkpoint_every_100": 100 * stall / (100 * step_s)}
    out["step_s"] = step_s
    out["goal_pct"] = 1.0
    out["within_goal"] = out["asynchronous"]["stall_pct_at_checkpoint_every_100"] < 1.0
    return out


def write_sd_pipeline(tiny: Path, out: Path, text_encoder: dict | None = None) -> Path:
    """The tiny pipeline with an SD 1.x-sized (random) text encoder, so the UNet cross-attends to 768-wide
    states of the real cost; the UNet itself is built from ``model.unet.params``."""
    import shutil

    from transformers import CLIPTextConfig, CLIPTextModel

    if not out.exists():
        shutil.copytree(tiny, out)
        shutil.rmtree(out / "text_encoder")
        CLIPTextModel(CLIPTextConfig(**{**SD1_TEXT_ENCODER, **(text_encoder or {})})).save_pretrained(out / "text_encoder")
    return out


def bench_sd(root: Path, tiny: Path, shards: str, args) -> list[dict]:
    """Our step on the SD 1.x UNet (from scratch, latents and token ids in memory): images/s, MFU, HFU; with
    ``--sd-baseline`` first eager in NCHW, then with the chosen levers (speed-up against the first)."""
    device = torch.device(args.device)
    unet = json.loads(args.sd_unet) if args.sd_unet else SD1_UNET
    pipeline = write_sd_pipeline(tiny, root / "sd1_pipeline", json.loads(args.sd_text_encoder or "{}"))
    rows = []
    resolutions = [int(r) for r in args.sd_resolutions.split(",")]
    batches = [int(b) for b in args.sd_batch.split(",")]
    variants = ([("eager_nchw", True)] if args.sd_baseline else []) + [("levers", False)]
    for res, batch in zip(resolutions, batches):
        yaml_text = json.dumps({"model": {"unet": {"params": {**unet, "sample_size": res // 8}}}})
        base = None
        for label, baseline in variants:
            trainer = make_trainer(root, pipeline, shards, args.device, args.precision, batch, res, yaml_text,
                                   name=f"sd_{res}_{label}", extra=levers(args, baseline))
            row = sd_row(trainer, args, device, res, batch)
            row["variant"] = label
            if base is None:
                base = row
            else:
                row["speedup_vs_first"] = row["images_per_sec"] / base["images_per_sec"]
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), file=sys.stderr)
            rows.append(row)
            trainer.trackers.close()
            del trainer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def compile_scope(trainer) -> str:
    """model.compile_scope as it was applied (auto: the family's choice)."""
    scope = trainer.cfg.model.compile_scope
    return trainer.family.compile_scope_auto if scope == "auto" else scope


def sd_row(trainer, args, device: torch.device, res: int, batch: int) -> dict:
    """One trainer's SD 1.x row: the first step (the compile warm-up) timed apart, 2 more warm-up steps,
    ``--sd-steps`` timed ones; then, with ``--profile``, device time by kernel kind."""
    from sd_training.speed import flops
    from sd_training.families.components.unet import uses_channels_last

    override = args.peak_tflops * 1e12 if args.peak_tflops else None
    peak = flops.peak_flops(device, args.precision if args.precision != "no" else torch.float32, override)
    # The trainer counts them at start-up (for its own MFU metric); counted here when it does not.
    step_flops = trainer.metrics.step_flops or trainer.family.step_flops()
    if step_flops.vae_encode:  # the trainer counted the VAE, which this in-memory-latents step does not run
        step_flops = flops.StepFlops(step_flops.unet_forward, step_flops.unet_train, 0, step_flops.text_encode)
    data = make_batch(trainer.models.tokenizer, batch, res, device, latents=res // 8)
    first = timed_steps(lambda: ours_step(trainer, data), 1, device)[0]
    warm = timed_steps(lambda: ours_step(trainer, data), 2, device)
    times = timed_steps(lambda: ours_step(trainer, data), args.sd_steps, device)
    ips = batch / statistics.median(times)
    m = trainer.cfg.model
    row = {
        "resolution": res, "batch": batch, "median_step_s": statistics.median(times), "images_per_sec": ips,
        "compile": compile_scope(trainer) if m.compile else "none", "compile_mode": m.compile_mode,
        "channels_last": uses_channels_last(m, device),
        "first_step_s": first, "warmup_s": first + sum(warm),
        "compile_warmup_s": first - statistics.median(times) if m.compile else None,
        "model_tflops_per_image": step_flops.model / 1e12, "hardware_tflops_per_image": step_flops.hardware / 1e12,
        "unet_forward_tflops_per_image": step_flops.unet_forward / 1e12,
        "peak_tflops": peak / 1e12 if peak else None,
        "mfu": flops.mfu(ips, step_flops.model, peak), "hfu": flops.mfu(ips, step_flops.hardware, peak),
    }
    cache = trainer.family.compile_cache
    if cache is not None:
        row["compile_cache"] = {"path": str(cache.path), "loaded": cache.loaded, "load_s": cache.load_s,
                                "saved_bytes": cache.saved_bytes}
    if device.type == "cuda":
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    if args.profile:
        row["profile"] = profile_steps(lambda: ours_step(trainer, data), args.profile_steps, device)
    return row


def main(argv=None) -> dict:
    args = parse(sys.argv[1:] if argv is None else argv)
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "no")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    import diffusers

    from sd_training.data.synthetic import write_shapes_shards
    from sd_training.families.registry import make_tiny_pipeline

    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        root = Path(tmp)
        pipeline = make_tiny_pipeline(root / "tiny_pipeline")
        shards = write_shapes_shards(str(root / "shards"), n_samples=8, n_shards=1, size=args.resolution)
        device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
        result = {
            "what": "our Trainer step vs a minimal diffusers loop, same tiny model / batch / precision / device",
            "device": args.device, "device_name": device_name, "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "diffusers": diffusers.__version__,
            "batch": args.batch, "resolution": args.resolution, "precision": args.precision,
            "warmup": args.warmup, "trials": args.trials, "steps_per_trial": args.steps,
        }
        result["levers"] = {"compile": args.compile, "compile_mode": args.compile_mode, "compile_cache": args.compile_cache,
                            "channels_last": args.channels_last, "sd_baseline": args.sd_baseline}
        if not args.sd_only:
            result["overhead"], trainer, batch = bench_overhead(root, pipeline, shards, args)
            result["host_syncs"] = bench_host_syncs(root, pipeline, shards, args, trainer, batch)
            result["checkpoint_stall"] = bench_checkpoint_stall(trainer, result["overhead"]["ours_median_step_s"])
            for key in ("overhead", "host_syncs", "checkpoint_stall"):
                print(json.dumps({key: result[key]}, indent=1), file=sys.stderr)
        if args.sd or args.sd_only or args.device == "cuda":
            result["sd1_unet"] = bench_sd(root, pipeline, shards, args)
        elif args.profile:  # the tiny step's kinds (the CPU's ops when no GPU)
            result["profile"] = profile_steps(lambda: ours_step(trainer, batch), args.profile_steps,
                                              torch.device(args.device))
    # 1-minute load averages: well above the core count means other jobs shared the CPU (noisy numbers).
    result["load_average"] = {"start": load_start, "end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                              "cpus": os.cpu_count()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(out)
    return result


if __name__ == "__main__":
    main()
