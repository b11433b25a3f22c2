"""Peak memory of training modes, measured through our own Trainer, beside the memory plan's prediction.

    python benchmarks/bench_memory.py --device cuda                  # full-size SDXL shapes, 1024 px, lora + full
    python benchmarks/bench_memory.py --device cpu                   # the tiny SDXL-shaped pipeline, 64 px
    python benchmarks/bench_memory.py --device cuda --mode lora      # one mode (--mode is repeatable or a list)

The model (``--model``, from benchmarks/memory_models.yaml) is built with random weights, nothing is
downloaded: the family's tiny pipeline with its components replaced by full-size random ones (on a GPU:
SDXL's CLIP ViT-L and OpenCLIP bigG text encoders and its VAE, saved once to a temporary folder), and the
trained net built from scratch by the trainer from its config (``model.<net>.params``: SDXL's UNet, 2.57B
parameters). SDXL's text conditioning is the real encoders' (frozen, in the training precision) on captions
of synthetic shape images written at the resolution, encoded by the frozen VAE every step: the template's
path (a folder of images), not precomputed latents.

The big transformer families (``flux``: Flux.1-dev, ``qwen_image``, ``zimage``, ``flux2_klein``,
``flux2_dev``) take their shapes from their family's ``reference_models()`` and read latent shards with
stored text (``data: latents``), written once per model by scripts/precompute_latents.py through the work
folder's pipeline, so the text encoders and the VAE stay in host memory during the steps, as the issue's
goals assume. Their encoders are width-true stand-ins (benchmarks/bench_memory_models.py says why).

    python benchmarks/bench_memory.py --device cuda --model flux --mode lora,lora_nf4,lora_fp8
    python benchmarks/bench_memory.py --device cpu --model zimage-tiny --mode lora --resolution 32

Each mode runs in its own process (a fresh CUDA context and a clean peak RSS), through the product:
``sd_training.loop.Trainer`` after ``setup()`` (the config checks, the memory plan at start-up, the
family, ``model.adapter``, the optimizer), one batch from its own loader, then ``--steps`` of its
``micro_step`` + ``optimizer_step`` (the first untimed: it allocates the optimizer state). Gradient
checkpointing on, bf16 mixed precision, AdamW, no EMA (``--ema`` to add it), batch ``--batch``.

Modes (``MODES``, benchmarks/bench_memory_modes.py: each a list of levers, each lever one set of config
overrides): ``full`` (every weight of the net trains: fp32 master weights, gradients and AdamW state) and
``lora`` (``model.adapter``: a LoRA of the model's rank on its preset; the base frozen in bf16), the full
fine-tunes for one GPU: ``offload`` (FSDP2 on one rank with ``distributed.fsdp_cpu_offload``),
``opt_in_backward`` (``optimizer.in_backward``: no full set of gradients), ``adam8bit`` and
``adam8bit+opt_in_backward``; and issue 36's: ``lora_nf4``, ``lora_int8``, ``lora_int8_weight``,
``lora_fp8`` (a quantised frozen base, ``model.adapter.base_quantization``), ``lora_swap``,
``full_swap``, ``full_swap_8bit`` (``model.block_swap``: the spec's count),
``lokr``, ``loha``. A mode whose config key this build lacks is reported as skipped, naming the key.
``--mode all`` runs every one.

Measured per mode: on CUDA ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the steps
(peak stats reset after set-up, synchronised before reading), on the CPU the process's peak RSS; images/s
and steps/s (median step); where the frozen text encoders and VAE were (``off_device``); and the bytes
the trainer actually holds (trained and frozen parameters by dtype, the gradients of the last step, the
optimizer state, the frozen components), beside the start-up memory
plan's rows for the run's strategy (``memory_plan.json``). Writes benchmarks/results/bench_memory.json
(``--out``) with each goal's pass/fail (the spec's ``goals``: peak GiB allocated, ``speed_goals``:
steps/s; on a GPU with the full-size model); prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = HERE / "memory_models.yaml"
GIB = 2**30
sys.path.insert(0, str(HERE))  # its sibling modules, also when imported from elsewhere
from bench_memory_models import (  # noqa: E402
    batches, host_memory_available, host_memory_needed, make_pipeline, net_params,
)
from bench_memory_models import load_spec as load_model_spec  # noqa: E402
from bench_memory_modes import MODES, missing_keys  # noqa: E402
from bench_memory_modes import overrides as mode_overrides  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--mode", action="append", default=None,
                   help=f"a mode or a comma-separated list; repeatable ({', '.join(MODES)}, all; default: lora and full)")
    p.add_argument("--model", default=None, help="a model of --models (default: its defaults for the device)")
    p.add_argument("--models", default=str(MODELS), help="the YAML file of models (default: %(default)s)")
    p.add_argument("--resolution", type=int, default=None, help="pixels (default: the model's)")
    p.add_argument("--batch", type=int, default=1, help="images per step")
    p.add_argument("--steps", type=int, default=None, help="steps per mode, the first untimed (default: 6 cuda, 3 cpu)")
    p.add_argument("--precision", default="bf16", help="model.mixed_precision: bf16 | fp16 | no")
    p.add_argument("--ema", action="store_true", help="model.use_ema on the device (default: off)")
    p.add_argument("--compile", default="none", choices=("none", "auto", "blocks", "whole"),
                   help="model.compile with this model.compile_scope (the first, untimed step compiles)")
    p.add_argument("--compile-mode", default="default",
                   choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                   help="model.compile_mode (reduce-overhead: CUDA graphs)")
    p.add_argument("--channels-last", default="auto", choices=("auto", "on", "off"), help="model.channels_last")
    p.add_argument("--checkpoint", action="store_true",
                   help="after the steps, time two asynchronous resume checkpoints: how long training waits for "
                        "each (goal for full-size SDXL: under 3 s) and how long the write to disk takes")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one mode may take (set-up included)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: 1 on the CPU)")
    p.add_argument("--work", default=None, help="folder for the pipeline, shards and runs (default: a temporary one)")
    p.add_argument("--out", default=str(HERE / "results" / "bench_memory.json"), help="JSON result")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one mode, write --out
    return p.parse_args(argv)


def modes_of(args) -> list[str]:
    names = [m.strip() for entry in (args.mode or ["lora,full"]) for m in entry.split(",") if m.strip()]
    names = [n for m in names for n in (MODES if m == "all" else [m])]
    unknown = [m for m in names if m not in MODES]
    if unknown:
        raise SystemExit(f"bench_memory: unknown mode {unknown[0]!r} (known: {', '.join(MODES)})")
    return list(dict.fromkeys(names))


def load_spec(args) -> tuple[str, dict]:
    return load_model_spec(args.models, args.model, args.device)


# ----------------------------------------------------------------------------------------------
# The parent: the pipeline and shards once, then one process per mode.
# ----------------------------------------------------------------------------------------------


def skip_reason(mode: str, spec: dict) -> str | None:
    """Why ``mode`` cannot run in this build (a config key its lever sets is missing, or the spec has no block
    swap count for it), else None."""
    try:
        missing = missing_keys(mode_overrides(mode, spec))
    except SystemExit as exn:  # e.g. --mode all on a spec without a swap count for every swapping mode
        return f"skipped: {str(exn).removeprefix('bench_memory: ')}"
    if missing:
        return (f"skipped: this build's config has no {', '.join(missing)} (the lever of mode {mode} has not "
                "landed; the mode turns on when it does)")
    return None


def run_mode(mode: str, args, work: Path, pipeline: Path, shards: str) -> dict:
    """One mode in a child process; its JSON, or what went wrong."""
    out = work / f"mode_{mode}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--device", args.device,
           "--batch", str(args.batch), "--steps", str(args.steps), "--precision", args.precision,
           "--resolution", str(args.resolution), "--work", str(work), "--out", str(out)]
    cmd += ["--model", args.model, "--models", str(Path(args.models).resolve())] + (["--ema"] if args.ema else []) + (["--threads", str(args.threads)] if args.threads else [])
    cmd += ["--compile", args.compile, "--compile-mode", args.compile_mode, "--channels-last", args.channels_last]
    cmd += ["--checkpoint"] if args.checkpoint else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               HF_HUB_OFFLINE="1", WANDB_MODE="disabled", BENCH_PIPELINE=str(pipeline), BENCH_SHARDS=shards)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", ((e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace"))[-3000:]
    if rc == 0 and out.exists():
        result = json.loads(out.read_text())
    else:
        result = {"mode": mode, "error": f"exit {rc}", "log_tail": tail}
    result["wall_s"] = time.perf_counter() - t0
    return result


def main(argv=None) -> dict:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.child:
        return child(args)
    modes = modes_of(args)
    args.model, spec = load_spec(args)
    args.resolution = args.resolution or int(spec.get("resolution", 64))
    args.steps = args.steps or (6 if args.device == "cuda" else 3)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        machine = host_memory_shortfall(args.model, spec)
        skips = {m: machine or skip_reason(m, spec) for m in modes}
        if not all(skips.values()):
            pipeline = make_pipeline(spec, work / f"pipeline_{args.model}")
            shards = batches(spec, args.model, pipeline, work, args.resolution, args.batch, args.device)
        prepare_s = time.perf_counter() - t0
        print(f"bench_memory: {args.model} pipeline and shards ready in {prepare_s:.0f} s", file=sys.stderr)
        results = {}
        for mode in modes:
            if skips[mode]:  # reported, not run: a lever not in this build, or a net this machine cannot build
                results[mode] = {"mode": mode, "error": skips[mode], "skipped": True, "wall_s": 0.0}
            else:
                results[mode] = run_mode(mode, args, work, pipeline, shards)
            print(json.dumps({mode: summary_row(results[mode])}), file=sys.stderr)
            # Written after every mode: a command cut short by its own timeout keeps the modes it finished.
            result = write_result(args, spec, modes, results, prepare_s, load_start, t0)
    print(table(result))
    print(args.out)
    if any("error" in r and not r.get("skipped") for r in results.values()) and argv is None:
        sys.exit(1)  # a mode that failed (out of memory, a timeout) fails the command; its log tail is in the JSON
    return result


def host_memory_shortfall(model: str, spec: dict) -> str | None:
    """Why this machine cannot build the model's net (None: it can): ``model.<net>.params`` builds it in fp32 in
    host memory (FLUX.2 dev's 32B: ~132 GiB), and a process killed for memory tells nothing."""
    need, have = host_memory_needed(spec), host_memory_available()
    if need and have is not None and need > have:
        return (f"skipped: building {model}'s net ({net_params(spec) / 1e9:.1f}B parameters) from "
                f"model.<net>.params takes ~{need:.0f} GiB of host memory in fp32 and {have:.0f} GiB is available "
                "(a machine with more, or a trainer that builds from-scratch nets in the training precision)")
    return None


def write_result(args, spec: dict, modes: list[str], results: dict, prepare_s: float, load_start, t0: float) -> dict:
    """The JSON of the modes run so far (``--out``), with each mode's summary and goal."""
    result = {
        "what": "peak memory of training modes through our Trainer, beside the start-up memory plan",
        "model": args.model, "model_what": " ".join(str(spec.get("what", "")).split()), "family": spec["family"],
        "device": args.device, "resolution": args.resolution, "batch": args.batch, "steps": args.steps,
        "precision": args.precision, "gradient_checkpointing": True, "ema": args.ema,
        "levers": {"compile": args.compile, "compile_mode": args.compile_mode, "channels_last": args.channels_last},
        "modes": {m: MODES[m][0] for m in modes}, "goals_gib_allocated": spec.get("goals") or {},
        "goals_steps_per_sec": spec.get("speed_goals") or {}, "data": spec.get("data", "images"),
        "net_params": net_params(spec),
        "prepare_s": prepare_s, "results": results, "summary": {m: summary_row(r) for m, r in results.items()},
        "load_average": {"start": load_start, "end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                         "cpus": os.cpu_count()},
        "total_s": time.perf_counter() - t0,
    }
    for mode, goal in result["goals_gib_allocated"].items():
        peak = (results.get(mode) or {}).get("measured", {}).get("peak_allocated_gib")
        if peak is not None and args.device == "cuda" and spec.get("net"):
            result["summary"][mode]["goal_gib"] = goal
            result["summary"][mode]["within_goal"] = peak <= goal
    for mode, goal in result["goals_steps_per_sec"].items():
        rate = (results.get(mode) or {}).get("steps_per_sec")
        if rate is not None and args.device == "cuda" and spec.get("net"):
            result["summary"][mode]["goal_steps_per_sec"] = goal
            result["summary"][mode]["within_speed_goal"] = rate >= goal
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def summary_row(r: dict) -> dict:
    if "error" in r:
        return {"error": r["error"], **({"skipped": True} if r.get("skipped") else {})}
    m, plan = r["measured"], r["plan"]["row"]
    peak = m.get("peak_allocated_gib", m.get("peak_rss_gib"))
    return {"peak_gib": peak, "peak_what": "allocated" if "peak_allocated_gib" in m else "process RSS",
            "reserved_gib": m.get("peak_reserved_gib"), "plan_total_gib": plan["total"],
            "plan_over_peak": plan["total"] / peak if peak else None, "images_per_sec": r["images_per_sec"],
            "steps_per_sec": r.get("steps_per_sec"), "off_device": r.get("off_device", {}),
            "trained_params": m["trained_params"],
            **({"checkpoint_stall_s": r["checkpoint"]["stall_s"]} if "checkpoint" in r else {})}


def table(result: dict) -> str:
    lines = [f"bench_memory: {result['model']} on {result['device']}, {result['resolution']} px, batch {result['batch']}, "
             f"{result['precision']}, gradient checkpointing",
             f"  {'mode':<26}{'peak GiB':>10}{'reserved':>10}{'plan GiB':>10}{'plan/peak':>10}{'img/s':>8}"
             f"{'steps/s':>8}{'trained':>14}  goal"]
    for mode, s in result["summary"].items():
        if s.get("skipped"):
            lines.append(f"  {mode:<26}{s['error']}")
            continue
        if "error" in s:
            lines.append(f"  {mode:<26}FAILED: {s['error']} (see results.{mode}.log_tail)")
            continue
        goal = "" if "goal_gib" not in s else f"<= {s['goal_gib']:g}: {'yes' if s['within_goal'] else 'NO'}"
        if "goal_steps_per_sec" in s:
            goal += f"; >= {s['goal_steps_per_sec']:g} steps/s: {'yes' if s['within_speed_goal'] else 'NO'}"
        reserved = f"{s['reserved_gib']:10.2f}" if s["reserved_gib"] is not None else f"{'-':>10}"
        lines.append(f"  {mode:<26}{s['peak_gib']:10.2f}{reserved}{s['plan_total_gib']:10.2f}{s['plan_over_peak']:10.2f}"
                     f"{s['images_per_sec']:8.2f}{s['steps_per_sec'] or 0:8.2f}{s['trained_params']:14,}  {goal}")
        if "checkpoint_stall_s" in s:
            lines.append(f"  {'':<26}checkpoint: training waited {s['checkpoint_stall_s']:.2f} s per save (goal < 3 s)")
    lines.append("  (peak: CUDA max_memory_allocated over the steps; on the CPU the process's peak RSS, libraries included)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The child: one mode through the Trainer.
# ----------------------------------------------------------------------------------------------


def rss_gib() -> dict:
    """This process's resident memory now and at its peak (Linux: ru_maxrss in KiB)."""
    now = None
    try:
        with open("/proc/self/statm") as fh:
            now = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB
    except (OSError, ValueError, IndexError):
        pass
    return {"rss_gib": now, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def trainer_config(args, spec: dict, mode: str, pipeline: str, shards: str):
    """The checked config (``configure.load``) of ``mode``: its overrides on a config like the templates'."""
    from sd_training.configure import load
    from sd_training.families.registry import FAMILIES

    work = Path(args.work)
    overrides = {
        "experiment.log_dir": str(work / "runs"), "experiment.name": f"{args.model}_{mode}",
        "experiment.num_examples_to_see": 10**6, "experiment.sample_per_prompt": 0, "experiment.resume": False,
        "experiment.start_fresh": True, "experiment.progress_bar": "off",
        "system.batch_size": args.batch, "system.workers": 0, "system.device": args.device,
        "model.pretrained": pipeline, "model.family": spec["family"],
        "model.mixed_precision": f"'{args.precision}'", "model.gradient_checkpointing": True,
        "model.use_ema": bool(args.ema),
        "dataset.params.path": shards, "dataset.params.resolution": args.resolution,
        "dataset.params.resampled": True, "wandb.mode": "disabled", "lr_scheduler.params.warmup_length": 0,
        # the steps reuse one batch: no buffer of 1000 samples (FLUX.2 dev's stored text is 31 MB a sample)
        "dataset.params.shuffle_buffer": max(4, args.batch),
        "model.channels_last": args.channels_last, "model.compile": args.compile != "none",
        **mode_overrides(mode, spec),
    }
    if args.compile != "none":
        overrides.update({"model.compile_scope": args.compile, "model.compile_mode": args.compile_mode})
    yaml_text = None
    if spec.get("net"):  # the trainer builds the net from scratch (random weights) from its config
        yaml_text = json.dumps({"model": {FAMILIES[spec["family"]].net_name: {"params": spec["net"]}}})
    argv = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in overrides.items()]
    return load(argv, yaml_text=yaml_text)


def make_trainer(args, spec: dict, mode: str):
    """A real Trainer after ``setup()`` on the mode's config (:func:`trainer_config`)."""
    from sd_training import distributed
    from sd_training.loop import Trainer

    cfg = trainer_config(args, spec, mode, os.environ["BENCH_PIPELINE"], os.environ["BENCH_SHARDS"])
    # distributed.strategy=fsdp in one process: FSDP2 in a process group of one (as train.py starts it).
    trainer = Trainer(cfg, distributed.setup(args.device, one_rank_group=cfg.distributed.strategy == "fsdp"))
    trainer.setup()
    return trainer


def checkpoint_stall(trainer, step_s: float | None, saves: int = 2) -> dict:
    """Two asynchronous resume checkpoints of the trained state, timed as a run sees them: the staging
    buffers' background allocation (started after the first optimizer step) is waited for first, as a run
    saving every few hundred steps never sees it; each save's ``stall_s`` is how long the training thread
    waited, ``save_s`` until the checkpoint was complete on disk."""
    store = trainer.checkpoints.store
    out = {"asynchronous": store.asynchronous, "reserve_wait_s": store.wait_reserved(), "saves": []}
    for _ in range(saves):
        t0 = time.perf_counter()
        trainer.checkpoints.save()
        stall = store.last_stall_s
        trainer.checkpoints.wait()
        folder = store.latest()
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder else 0
        out["saves"].append({"stall_s": stall, "save_s": time.perf_counter() - t0, "bytes": size})
        trainer.state.step += 1  # the next save is a new step folder
    out["stall_s"] = max(s["stall_s"] for s in out["saves"])
    out["goal_s"] = 3.0
    out["within_goal"] = out["stall_s"] < out["goal_s"]
    out["stall_in_steps"] = out["stall_s"] / step_s if step_s else None
    return out


def stored(t) -> list:
    """The plain tensors that hold ``t``'s data: itself, or a tensor subclass's inner tensors (torchao's
    quantised weights report their original dtype and size, not what they store)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(t, DTensor) or not is_traceable_wrapper_subclass(t):  # FSDP2's: counted whole, as one rank holds
        return [t]
    inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
    return [x for tensor in inner if torch.is_tensor(tensor) for x in stored(tensor)]


def tensor_bytes(tensors) -> int:
    return sum(x.numel() * x.element_size() for t in tensors for x in stored(t))


def off_device(trainer) -> dict:
    """The frozen text encoders and VAE: how each is placed (``components.placement``: device, cpu or offload)
    and the devices its weights are on after the steps (cpu: host memory; the steps did not bring it in)."""
    from sd_training.families.components.placement import placement_of

    family = trainer.family
    frozen = dict(family.frozen_text_encoders()) if hasattr(family, "frozen_text_encoders") else {}
    vae = getattr(getattr(family, "models", None), "vae", None)
    if vae is not None:
        frozen["vae"] = vae
    return {name: {"placement": placement_of(m), "weights_on": sorted({p.device.type for p in m.parameters()})}
            for name, m in frozen.items()}


def held(trainer) -> dict:
    """What the trainer holds, counted from its tensors (the plan's rows, measured)."""
    import torch

    from sd_training.distributed.strategy import local

    params = list(trainer.net.parameters())
    trained = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    encoders = {id(m): m for m in trainer.encoders.values()}.values()
    enc_params = [p for m in encoders for p in m.parameters()]
    by_dtype: dict[str, int] = {}
    for x in (x for p in frozen for x in stored(p)):  # elements by the dtype they are stored in
        by_dtype[str(x.dtype).replace("torch.", "")] = by_dtype.get(str(x.dtype).replace("torch.", ""), 0) + x.numel()
    return {
        "trained_params": sum(p.numel() for p in trained), "trained_bytes": tensor_bytes(trained),
        "trained_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in trained}),
        "trained_on": sorted({local(p).device.type for p in trained}),  # cpu: offloaded (FSDP2's CPU shards)
        "optimizer_state_on": sorted({local(t).device.type for t in state if t.dim() > 0}),
        "optimizer_state_dtypes": sorted({str(t.dtype).replace("torch.", "") for t in state if t.dim() > 0}),
        "base_params": sum(p.numel() for p in frozen), "base_bytes": tensor_bytes(frozen), "base_params_by_dtype": by_dtype,
        "optimizer_state_bytes": tensor_bytes(state),
        "encoder_trained_params": sum(p.numel() for p in enc_params if p.requires_grad),
        "frozen_component_bytes": tensor_bytes(t for m in trainer.family.frozen_modules()
                                               for t in [*m.parameters(), *m.buffers()]),
        "ema_bytes": tensor_bytes([*trainer.ema.shadow.parameters(), *trainer.ema.shadow.buffers()]) if trainer.ema else 0,
    }


def child(args) -> dict:
    import torch

    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    import diffusers

    _name, spec = load_spec(args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    mem = {"after_import": rss_gib()}
    t0 = time.perf_counter()
    trainer = make_trainer(args, spec, args.child)
    setup_s = time.perf_counter() - t0
    mem["after_setup"] = rss_gib()
    plan = json.loads(trainer.run_dir.memory_plan.read_text())
    batch = next(iter(trainer.loader))  # one batch of the run's own loader, re-used every step

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    sync()
    measured = {}
    if cuda:
        measured["allocated_after_setup_gib"] = torch.cuda.memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    times, losses, grads = [], [], 0
    for step in range(args.steps):
        sync()
        start = time.perf_counter()
        out = trainer.micro_step(batch, sync=True)
        if step == args.steps - 1:  # the gradients one step holds, before the optimizer step frees them
            grads = tensor_bytes(p.grad for p in trainer.net.parameters() if p.grad is not None)
        trainer.optimizer_step()
        sync()
        if step:  # the first step allocates the optimizer state (and warms up kernels)
            times.append(time.perf_counter() - start)
        losses.append(float(out.loss.detach().float()))
    if cuda:
        measured["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        measured["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        measured["allocated_after_steps_gib"] = torch.cuda.memory_allocated(device) / GIB
    mem["after_steps"] = rss_gib()
    measured.update(held(trainer), gradient_bytes=grads, peak_rss_gib=mem["after_steps"]["peak_rss_gib"])
    net_params = sum(p.numel() for n, p in trainer.net.named_parameters() if "lora_" not in n)
    step_s = statistics.median(times) if times else None
    row = next(r for r in plan["rows"] if r["strategy"] == plan["strategy"])
    result = {
        "mode": args.child, "what": MODES[args.child][0], "device_name": torch.cuda.get_device_name(device) if cuda
        else platform.processor() or platform.machine(), "torch": torch.__version__, "diffusers": diffusers.__version__,
        "torch_threads": torch.get_num_threads(), "net_params": net_params, "net_params_expected": spec.get("net_params"),
        "setup_s": setup_s, "median_step_s": step_s, "images_per_sec": args.batch / step_s if step_s else None,
        "steps_per_sec": 1 / step_s if step_s else None, "off_device": off_device(trainer),
        "batch_keys": sorted(batch),  # latent shards with stored text: latents and encoder_hidden_states
        "losses": losses, "nonfinite_skipped": int(trainer.guards.nonfinite_total), "measured": measured, "process_memory": mem,
        "plan": {"strategy": plan["strategy"], "row": row, "rows": plan["rows"]},
        "plan_vs_measured_gib": {  # the plan's rows beside the tensors the trainer holds
            "weights": [row["weights"], measured["trained_bytes"] / GIB],
            "gradients": [row["gradients"], grads / GIB],
            "optimizer": [row["optimizer"], measured["optimizer_state_bytes"] / GIB],
            "base": [row.get("base", 0.0), measured["base_bytes"] / GIB],
            "ema": [row["ema"], measured["ema_bytes"] / GIB],
        },
    }
    if args.checkpoint:
        result["checkpoint"] = checkpoint_stall(trainer, step_s)
    trainer.trackers.close()
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    from sd_training import distributed

    distributed.teardown()  # the one-rank group of fsdp modes
    return result


if __name__ == "__main__":
    main()
