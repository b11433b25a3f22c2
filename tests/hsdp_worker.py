"""One rank of tests/test_hsdp.py's gradient-norm check (started by torchrun: 4 gloo ranks).

A small net wrapped by ``Strategy("hsdp")`` (2 groups of 2 ranks), each rank a quarter of the batch,
against the same net unwrapped on the whole batch (every rank computes it): the gradients, the global
gradient norm of ``optim.clip_gradients`` (DTensor norms on the 2-D mesh), the norm ``optimizer.in_backward``
reports (its squares summed over the shard group only), the clipped update, and ``full_state_dict``. Once
for each mode named (comma-separated, in one process group: one start of 4 interpreters): ``device``, and
``offload``: the shards in CPU memory (CPUOffloadPolicy, under hsdp too). Writes
``<out>/rank_<R>_<mode>.json`` with the differences.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 4))


def main(out: Path, modes: list[str]) -> None:
    dist.init_process_group("gloo")
    for mode in modes:
        result = check(mode == "offload")
        (out / f"rank_{dist.get_rank()}_{mode}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def check(offload: bool) -> dict:
    """The differences of one mode (see the module's docstring)."""
    from sd_training.config.schema import DistributedConfig, OptimizerConfig, OptimizerParams
    from sd_training.distributed import DistInfo
    from sd_training.distributed.strategy import Strategy
    from sd_training.optim import build_optimizer, clip_gradients

    rank, world = dist.get_rank(), dist.get_world_size()
    info = DistInfo(rank=rank, world_size=world, local_world_size=2, launcher="torchrun", backend="gloo")
    cfg = DistributedConfig(strategy="hsdp", hsdp_shard_size=0, fsdp_cpu_offload=offload)  # 0: one "node"'s 2
    strategy = Strategy("hsdp", True, torch.device("cpu"), None, cfg, info)
    ref, model = net(), net()
    units = lambda m, level: [m[0], m[2], m[4]]  # noqa: E731 (a family's shard_units)
    strategy.wrap(model, None, units)
    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    part = slice(rank * 2, rank * 2 + 2)  # each rank a quarter of the batch; the mean over ranks is the batch's
    torch.nn.functional.mse_loss(model(x[part]), y[part]).backward()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05)  # clips: the norm is larger
    norm = clip_gradients(torch.optim.SGD(model.parameters(), lr=0.1), 0.05)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    result = {
        "mesh": [strategy.replicas, strategy.shard_size, strategy.name],
        "placements": str(model[0].weight.placements),
        "norm": abs(float(norm) - float(ref_norm)),
        "clipped_grads": max(float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()),
        "ref_norm": float(ref_norm),
    }
    # optimizer.in_backward: the norm of the gradients its updates used, counted once per shard
    model2, ref2 = net(), net()
    strategy2 = Strategy("hsdp", True, torch.device("cpu"), None, cfg, info)
    strategy2.wrap(model2, None, units)
    o = OptimizerConfig(name="sgd", in_backward=True, params=OptimizerParams(weight_decay=0.0))
    opt = build_optimizer([{"params": list(model2.parameters())}], o, strategy2.optimizer_device, 0.1)
    torch.nn.functional.mse_loss(model2(x[part]), y[part]).backward()
    torch.nn.functional.mse_loss(ref2(x), y).backward()
    ref2_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref2.parameters()]))
    result["in_backward_norm"] = abs(float(clip_gradients(opt, None)) - float(ref2_norm))
    with torch.no_grad():
        for p in ref2.parameters():
            p -= 0.1 * p.grad
    full = strategy2.full_state_dict(model2)
    result["in_backward_update"] = max(float((full[k].cpu() - v).abs().max()) for k, v in ref2.state_dict().items())
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
