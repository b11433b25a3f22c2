"""Bytes each strategy's collectives move per optimizer step (counted from real process groups), one device's
step time, and a model of per-GPU throughput at 8, 64 and 512 GPUs for SDXL, Flux.1-dev and FLUX.2 dev.

    python benchmarks/bench_scaling.py                      # CPU: 4 gloo ranks, tiny Flux transformer
    python benchmarks/bench_scaling.py --device cuda        # + each model's reduced-depth copy timed on the GPU

1. Counted run: ``--ranks`` processes (forked from this one, gloo, a FileStore rendezvous) train the tiny net
   (``--net``: the tiny Flux transformer or SDXL UNet of the test pipelines, the family's FSDP units) under ddp,
   fsdp and hsdp (``--hsdp-ranks``, 2 shard groups of half of them), wrapped as training wraps them
   (``distributed.strategy.Strategy``); the second step's collectives are counted per process group
   (``sd_training.distributed.traffic.TrafficCounter``) beside the model's prediction (``traffic.predicted``).
   The baseline in the same run is the ddp row.
2. One device's step (forward, backward, AdamW) of the same tiny net, timed (median of ``--steps``). With
   ``--device cuda``, each model's reduced-depth copy at full width (``benchmarks/scaling.yaml``: ``reduced``)
   at its resolution and batch, bf16 autocast, gradient checkpointing: its MFU replaces the stated one.
3. The model (``benchmarks/scaling.yaml``): the same ring volumes as ``traffic.predicted`` at each model's real
   parameter count (the published configs, counted on the meta device; the units' padding and the root's
   share are ignored: under 0.1% at these sizes), over NVLink inside a node and the network across nodes;
   compute from model FLOPs per image (3 x one forward, counted on the meta device) / (peak x MFU); exposed
   communication = max(0, comm - overlap x compute). Per strategy and scale: traffic seconds per step,
   step seconds, images/s per GPU, weights + gradients + AdamW state per GPU.

Writes JSON (``--out``, default benchmarks/results/bench_scaling.json) and a markdown table beside it (.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sd_training.distributed import traffic  # noqa: E402

STRATEGIES = ("ddp", "fsdp", "hsdp")
GB = 1e9


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu | cuda (cuda: also time each model's reduced copy)")
    p.add_argument("--ranks", type=int, default=4, help="processes of the counted ddp and fsdp runs")
    p.add_argument("--hsdp-ranks", type=int, default=None, help="processes of the counted hsdp run (default: --ranks), "
                   "2 shard groups of half of them")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--net", default=None, help="the tiny net counted and timed: a key of scaling.yaml's tiny_nets "
                   "(default: its first)")
    p.add_argument("--fsdp-unit", default="block", choices=("layer", "block"))
    p.add_argument("--param-dtype", default="fp32", choices=("fp32", "bf16"), help="fsdp/hsdp gathered dtype")
    p.add_argument("--grad-reduce-dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--resolution", type=int, default=64, help="the tiny net's image pixels")
    p.add_argument("--batch", type=int, default=2, help="the tiny net's batch per device")
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up)")
    p.add_argument("--models", default=None, help="names from scaling.yaml to model (default: all)")
    p.add_argument("--config", default=str(ROOT / "benchmarks" / "scaling.yaml"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_scaling.json"))
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# The tiny nets and their inputs
# ----------------------------------------------------------------------------------------------

def family(name: str):
    from sd_training.families import registry

    return registry.FAMILIES[name]


def materialize(x, batch: int, gen: torch.Generator, device):
    """Real tensors shaped as the family's meta inputs, dim 0 of size 1 widened to ``batch``."""
    if isinstance(x, dict):
        return {k: materialize(v, batch, gen, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(materialize(v, batch, gen, device) for v in x)
    if not isinstance(x, torch.Tensor):
        return x
    shape = (batch, *x.shape[1:]) if x.dim() >= 1 and x.shape[0] == 1 else tuple(x.shape)
    if x.dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(device)
    return torch.zeros(shape, dtype=x.dtype, device=device)


def flux_inputs(config, h: int, w: int, tokens: int) -> dict:
    """One image's forward kwargs of a Flux-style transformer (Flux.1, FLUX.2) on the meta device: the latent
    grid packed 2 x 2 into tokens, the text states, position ids (one column per rope axis), as the families'
    ``flops_inputs`` lay them out for text-to-image."""
    n, axes = (h // 2) * (w // 2), len(config.axes_dims_rope)
    kw = dict(hidden_states=torch.empty(1, n, config.in_channels, device="meta"),
              encoder_hidden_states=torch.empty(1, tokens, config.joint_attention_dim, device="meta"),
              timestep=torch.ones(1, device="meta"), img_ids=torch.zeros(n, axes, device="meta"),
              txt_ids=torch.zeros(tokens, axes, device="meta"),
              guidance=torch.ones(1, device="meta") if config.guidance_embeds else None)
    if "pooled_projection_dim" in config:  # Flux.1's pooled CLIP vector
        kw["pooled_projections"] = torch.empty(1, config.pooled_projection_dim, device="meta")
    return kw


def net_inputs(fam_name: str, net, resolution: int, batch: int, device, text_tokens: int, seed: int = 0):
    """(args, kwargs) of one batch as the family calls its net, made real (random states, zero ids)."""
    h = w = resolution // 8
    gen = torch.Generator().manual_seed(seed)
    if hasattr(net.config, "axes_dims_rope"):  # a Flux-style transformer: kwargs for one image
        return (), materialize(flux_inputs(net.config, h, w, text_tokens), batch, gen, device)
    with torch.device("meta"):
        args, kwargs = family(fam_name).flop_inputs(net, (h, w), text_tokens, 1)  # the UNet families'
    return materialize(args, batch, gen, device), materialize(kwargs, batch, gen, device)


def tiny_net(spec: dict):
    """(family name, the family's tiny test net, its text tokens) of a scaling.yaml ``tiny_nets`` entry: the net
    class the family trains, built from the config constant its module names (``config``)."""
    import diffusers

    fam = family(spec["family"])
    config = getattr(sys.modules[fam.__module__], spec["config"])
    return spec["family"], getattr(diffusers, fam.net_class)(**config), int(spec["text_tokens"])


def first(out) -> torch.Tensor:
    out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
    return out


def train_step(model, opt, args, kwargs) -> None:
    loss = first(model(*args, **kwargs, return_dict=False)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------
# 1. The counted run: forked ranks on gloo
# ----------------------------------------------------------------------------------------------

def wrap(strategy: str, net, fam, a, rank: int, world: int, shard: int):
    """(the module to call, process group name -> label: hsdp's mesh dims) with the net wrapped as training
    wraps it (``Strategy.wrap``: the family's units, the mixed-precision policy; hsdp's 2-D mesh)."""
    from sd_training.config.schema import DistributedConfig
    from sd_training.distributed import DistInfo
    from sd_training.distributed.strategy import Strategy

    dtype = torch.bfloat16 if a.param_dtype == "bf16" else None
    cfg = DistributedConfig(fsdp_unit=a.fsdp_unit, grad_reduce_dtype=a.grad_reduce_dtype, hsdp_shard_size=shard)
    info = DistInfo(rank=rank, world_size=world, local_world_size=shard, backend="gloo")
    s = Strategy(strategy, True, torch.device("cpu"), dtype, cfg, info=info)
    model = s.wrap(net, None, fam.shard_units)
    if strategy == "ddp":
        traffic.count_ddp(model)
    return model, traffic.mesh_labels(s.mesh) if s.mesh is not None else {}


def predicted_for(strategy: str, net, fam, a, world: int, shard: int) -> dict:
    groups = traffic.unit_params(net, fam.shard_units(net, a.fsdp_unit) if strategy != "ddp" else [])
    param_bytes = 2 if a.param_dtype == "bf16" else 4
    reduce_bytes = 2 if a.grad_reduce_dtype == "bf16" else 4
    return traffic.predicted(strategy, groups, world, shard, param_bytes=param_bytes, reduce_bytes=reduce_bytes,
                             grad_bytes=reduce_bytes)


def counted_rank(rank: int, world: int, store: str, strategy: str, a, out: str) -> None:
    """One rank: two steps of the tiny net, the second counted."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
        torch.manual_seed(0)  # the same weights on every rank, as after a broadcast
        fam_name, net, tokens = tiny_net(a.tiny)
        fam, shard = family(fam_name), max(1, world // 2)
        predicted = predicted_for(strategy, net, fam, a, world, shard)
        params = sum(p.numel() for p in net.parameters())
        model, labels = wrap(strategy, net, fam, a, rank, world, shard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        args, kwargs = net_inputs(fam_name, net, a.resolution, 1, torch.device("cpu"), tokens, seed=rank)
        train_step(model, opt, args, kwargs)  # the first step builds FSDP's and DDP's state
        counter = traffic.TrafficCounter(labels)
        with counter:
            train_step(model, opt, args, kwargs)
        result = dict(rank=rank, counted=counter.rows(), predicted=predicted, params=params)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (the parent reports it)
        result = dict(rank=rank, error=traceback.format_exc())
    Path(out, f"{strategy}_rank{rank}.json").write_text(json.dumps(result))


def preload(a) -> None:
    """Import what the ranks use before forking them (each would pay diffusers' and its quantisers' imports)."""
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    from sd_training.config.schema import DistributedConfig  # noqa: F401
    from sd_training.distributed.strategy import Strategy  # noqa: F401

    with torch.device("meta"):
        tiny_net(a.tiny)


def count_strategy(strategy: str, a, world: int) -> dict:
    """Fork ``world`` ranks, wait for them, return rank 0's counts (and whether every rank counted the same)."""
    preload(a)
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=counted_rank, args=(r, world, store, strategy, a, tmp)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world):
            f = Path(tmp, f"{strategy}_rank{r}.json")
            results.append(json.loads(f.read_text()) if f.exists() else dict(rank=r, error="no result (killed?)"))
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"the counted {strategy} run failed:\n{errors[0]}")
    same = all(r["counted"] == results[0]["counted"] for r in results)
    shard = world // 2 if strategy == "hsdp" else world
    return dict(results[0], ranks=world, same_on_every_rank=same, shard_size=shard)


# ----------------------------------------------------------------------------------------------
# 2. One device's step
# ----------------------------------------------------------------------------------------------

def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(net, fam_name: str, resolution: int, batch: int, tokens: int, steps: int, device,
               autocast: bool) -> float:
    """Median seconds of one step (forward, backward, AdamW) after one warm-up step."""
    cuda = device.type == "cuda"  # the fused kernel on a GPU, the per-tensor loop on the CPU (bench_step's finding)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=cuda, foreach=None if cuda else False)
    args, kwargs = net_inputs(fam_name, net, resolution, batch, device, tokens)
    times = []
    for i in range(steps + 1):
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            loss = first(net(*args, **kwargs, return_dict=False)).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_tiny(a) -> dict:
    torch.manual_seed(0)
    fam_name, net, tokens = tiny_net(a.tiny)
    device = torch.device(a.device)
    t = time_steps(net.to(device), fam_name, a.resolution, a.batch, tokens, a.steps, device, device.type == "cuda")
    return dict(net=f"tiny {a.net}", params=sum(p.numel() for p in net.parameters()), resolution=a.resolution,
                batch=a.batch, device=str(device), step_s=t, images_per_s=a.batch / t)


# ----------------------------------------------------------------------------------------------
# 3. The real models: parameters, FLOPs per image, the reduced copy on a GPU
# ----------------------------------------------------------------------------------------------

def model_spec(spec: dict) -> tuple[str, dict, int]:
    """(net class, config, text tokens) of a scaling.yaml model."""
    if "reference" in spec:
        model = family(spec["family"]).reference_models()[spec["reference"]]
        return model.net_class, dict(model.config), model.text_tokens
    nets = yaml.safe_load((ROOT / "benchmarks" / "memory_models.yaml").read_text())
    return family(spec["family"]).net_class, dict(nets[spec["net"]]["net"]), int(spec.get("text_tokens", 77))


def build(cls_name: str, config: dict, device):
    import diffusers

    with torch.device(device):
        return getattr(diffusers, cls_name).from_config(config)


def forward_flops(spec: dict, config: dict) -> int:
    """FLOPs of one forward on one image at the model's resolution, counted on the meta device."""
    from sd_training.speed.flops import count_flops

    cls_name, _, tokens = model_spec(spec)
    net = build(cls_name, config, "meta").eval()  # diffusers' default attention: SDPA, which meta counts
    args, kwargs = net_inputs(spec["family"], net, spec["resolution"], 1, torch.device("meta"), tokens)
    with torch.no_grad():
        return count_flops(lambda: net(*args, **kwargs, return_dict=False))


def meta_params(cls_name: str, config: dict) -> int:
    return sum(p.numel() for p in build(cls_name, config, "meta").parameters())


def measure_reduced(spec: dict, steps: int, device) -> dict:
    """The reduced-depth copy at full width on the GPU: step seconds and its MFU (model FLOPs / peak)."""
    from sd_training.speed.flops import peak_flops

    cls_name, config, tokens = model_spec(spec)
    config = dict(config, **(spec.get("reduced") or {}))
    torch.manual_seed(0)
    net = build(cls_name, config, device)
    net.enable_gradient_checkpointing()
    try:
        t = time_steps(net.train(), spec["family"], spec["resolution"], spec["batch"], tokens, steps, device, True)
    finally:
        del net
        if device.type == "cuda":
            torch.cuda.empty_cache()
    flops = 3 * forward_flops(spec, config) * spec["batch"]
    peak = peak_flops(device, torch.bfloat16) if device.type == "cuda" else None
    return dict(params=meta_params(cls_name, config), step_s=t, model_flops=flops, peak_flops=peak,
                mfu=flops / t / peak if peak else None,
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
                note="reduced copy, bf16 autocast, fp32 AdamW, gradient checkpointing")


def model_rows(name: str, spec: dict, cfg: dict, measured: dict | None) -> dict:
    """Per strategy and scale: traffic seconds per link, step seconds, images/s per GPU, state GiB per GPU."""
    cls_name, config, _ = model_spec(spec)
    params = meta_params(cls_name, config)
    flops = 3 * forward_flops(spec, config) * spec["batch"]  # model FLOPs of one step on one GPU
    gpu, link, dt = cfg["gpu"], cfg["interconnect"], cfg["dtypes"]
    mfu, source = gpu["mfu"], f"FLOPs / ({gpu['name']} peak {gpu['peak_tflops']} TFLOP/s x MFU {gpu['mfu']})"
    if measured and measured.get("mfu"):
        mfu, source = measured["mfu"], f"MFU {measured['mfu']:.3f} measured on {measured['gpu']} (reduced copy)"
    compute = flops / (gpu["peak_tflops"] * 1e12 * mfu)
    rows = {}
    for strategy in STRATEGIES:
        for n in cfg["scales"]:
            t = traffic.traffic_seconds(strategy, params, n, link["nvlink_gbps"], link["internode_gbps"],
                                        link["gpus_per_node"], **dt)
            step = compute + max(0.0, t["total"] - cfg["overlap"] * compute)
            holders = {"ddp": 1, "fsdp": n, "hsdp": min(n, link["gpus_per_node"])}[strategy]
            rows[f"{strategy}@{n}"] = dict(strategy=strategy, gpus=n, traffic_nvlink_s=t["nvlink"],
                                           traffic_network_s=t["network"], step_s=step,
                                           images_per_s_per_gpu=spec["batch"] / step, efficiency=compute / step,
                                           state_gib_per_gpu=params * 16 / holders / 2**30)
    return dict(params=params, resolution=spec["resolution"], batch=spec["batch"], model_flops_per_step=flops,
                compute_s=compute, compute_from=source, rows=rows)


def issue_check(models: dict, cfg: dict) -> dict:
    """Issue 38's paper figures (scaling.yaml's ``issue_check``: Flux.1 full fine-tune, 1024 px, 50 GB/s across
    nodes: ~1.9 s of traffic per step under fsdp, 0.12 s under hsdp) against this model."""
    want = cfg.get("issue_check") or {}
    ref = models.get(want.get("model"))
    if not ref:
        return {}
    fsdp, hsdp = ref["rows"][f"fsdp@{want['gpus']}"], ref["rows"][f"hsdp@{want['gpus']}"]
    return dict(want, fsdp_network_s=fsdp["traffic_network_s"], issue_fsdp_s=want["fsdp_network_s"],
                hsdp_network_s=hsdp["traffic_network_s"], hsdp_nvlink_s=hsdp["traffic_nvlink_s"],
                issue_hsdp_s=want["hsdp_network_s"],
                note="hsdp's network share is a ring all-reduce of each GPU's fp32 gradient shard "
                     "(2(r-1)/r x P/8 x 4 B); "
                     "the issue's figure is P/8 x 4 B once (no ring factor 2), or the ring in bf16; it left out the "
                     "NVLink part")


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------

def counted_table(counted: dict) -> list[str]:
    lines = ["| strategy | ranks | process group | collective | calls | bytes counted | bytes modelled "
             "| ring bytes sent per rank |",
             "|---|---|---|---|---|---|---|---|"]
    for strategy, r in counted.items():
        for group, kinds in r["counted"].items():
            for kind, row in kinds.items():
                model = r["predicted"].get(group, {}).get(kind, {}).get("bytes")
                modelled = f"{model:,}" if model is not None else "- (not modelled)"
                lines.append(f"| {strategy} | {r['ranks']} | {group} ({row['group_size']}) | {kind} | {row['calls']} | "
                             f"{row['bytes']:,} | {modelled} | {row['wire_bytes']:,.0f} |")
    return lines


def model_table(models: dict, cfg: dict) -> list[str]:
    link = cfg["interconnect"]
    scales = cfg["scales"]
    lines = [f"Modelled, not measured: {link['gpus_per_node']} GPUs per node, NVLink {link['nvlink_gbps']} GB/s and "
             f"{link['internode_gbps']} GB/s per GPU across nodes, overlap {cfg['overlap']}; bf16 gathers, fp32 "
             "gradient reduction. Cells: images/s per GPU (traffic seconds per step: NVLink + network).", "",
             "| model (params, px, batch/GPU, compute s) | strategy | " + " | ".join(f"{n} GPUs" for n in scales)
             + " | weights+grads+AdamW GiB/GPU |", "|---|---|" + "---|" * (len(scales) + 1)]
    for name, m in models.items():
        label = f"{name} ({m['params'] / 1e9:.2f}B, {m['resolution']}, {m['batch']}, {m['compute_s']:.2f})"
        for strategy in STRATEGIES:
            cells, state = [], []
            for n in scales:
                r = m["rows"][f"{strategy}@{n}"]
                cells.append(f"{r['images_per_s_per_gpu']:.2f} "
                             f"({r['traffic_nvlink_s']:.2f} + {r['traffic_network_s']:.2f})")
                state.append(f"{r['state_gib_per_gpu']:.1f}")
            lines.append(f"| {label} | {strategy} | " + " | ".join(cells) + f" | {' / '.join(state)} |")
    return lines


def markdown(result: dict, cfg: dict) -> str:
    m = result["measured"]
    out = [f"Counted on {result['host']} (gloo, tiny {result['args']['net']}, {m['params']:,} parameters, "
           f"fsdp unit {result['args']['fsdp_unit']}, gathered in {result['args']['param_dtype']}, reduced in "
           f"{result['args']['grad_reduce_dtype']}); one optimizer step:", "", *counted_table(result["counted"]), "",
           f"One device ({m['device']}): {m['step_s'] * 1000:.1f} ms per step, {m['images_per_s']:.1f} images/s "
           f"({m['resolution']} px, batch {m['batch']}).", "", *model_table(result["models"], cfg)]
    check = result.get("issue_check")
    if check:
        out += ["", f"Issue 38's figures ({check['model']}, {check['gpus']} GPUs): fsdp "
                f"{check['fsdp_network_s']:.2f} s of network traffic per step (issue: {check['issue_fsdp_s']}), hsdp "
                f"{check['hsdp_network_s']:.2f} s network + "
                f"{check['hsdp_nvlink_s']:.2f} s NVLink (issue: {check['issue_hsdp_s']}): {check['note']}."]
    return "\n".join(out) + "\n"


def main(argv=None) -> dict:
    a = parse(argv if argv is not None else sys.argv[1:])
    cfg = yaml.safe_load(Path(a.config).read_text())
    a.net = a.net or next(iter(cfg["tiny_nets"]))
    a.tiny = cfg["tiny_nets"][a.net]
    a.hsdp_ranks = a.hsdp_ranks or a.ranks
    if a.ranks < 2 or a.hsdp_ranks < 4 or a.hsdp_ranks % 2:
        raise SystemExit(f"--ranks {a.ranks} --hsdp-ranks {a.hsdp_ranks}: at least 2 ranks, and an even hsdp count "
                         "of at least 4 (2 shard groups of half of them)")
    # Forked first, before this process starts a thread or CUDA.
    counted = {s: count_strategy(s, a, a.hsdp_ranks if s == "hsdp" else a.ranks) for s in a.strategies.split(",")}
    measured = measure_tiny(a)
    names = a.models.split(",") if a.models else list(cfg["models"])
    device = torch.device(a.device)
    models, reduced = {}, {}
    for name in names:
        spec = cfg["models"][name]
        if device.type == "cuda":
            reduced[name] = measure_reduced(spec, a.steps, device)
        models[name] = model_rows(name, spec, cfg, reduced.get(name))
    import platform

    result = dict(args=vars(a), host=platform.node() or "this machine", torch=torch.__version__, config=cfg,
                  counted=counted, measured=measured, reduced=reduced, models=models)
    result["issue_check"] = issue_check(models, cfg)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result, cfg))
    print(out.with_suffix(".md").read_text())
    return result


if __name__ == "__main__":
    main()
