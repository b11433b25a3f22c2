"""Where a training step spends its device time, by kernel kind (``bench_step.py --profile``).

torch.profiler over a few steps; each kernel (CUDA) or each op's own time (CPU, where no kernels run)
goes to one kind: convolutions, attention, GEMMs, norms, layout transposes (cuDNN's NCHW<->NHWC
conversions), copies and casts, element-wise (Triton-fused included), optimizer, other. The kinds are
those of ``../shared/notes/gpu-path.md``'s H100 profile, so a new profile reads against it.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

# Checked in order: the first kind whose pattern matches a (lower-case) kernel or op name wins.
KINDS = (
    ("optimizer", r"multi_tensor_apply|fused_adam|adamw|_fused_sgd|optimizer\.step|lerp|addcdiv|_foreach"),
    ("layout transposes", r"nchwtonhwc|nhwctonchw|nchw_to_nhwc|nhwc_to_nchw|convertlayout|transpose_readwrite"),
    ("attention", r"flash|fmha|attention|sdpa|_efficient_attention|cudnn_generated_fort_native_sdpa|softmax"),
    ("convolutions", r"conv|fprop|dgrad|wgrad|implicit_gemm|cudnn|winograd|mkldnn_convolution"),
    ("GEMMs", r"gemm|\bmm\b|aten::mm|aten::addmm|aten::bmm|aten::linear|matmul|cutlass|nvjet|sm\d+_xmma|ampere_|cublas"),
    ("norms", r"group_norm|layer_norm|groupnorm|layernorm|rms_norm|batch_norm|native_norm|rowwisemoments|"
              r"computefusedparams|gammabeta|welford"),
    ("copies and casts", r"copy|memcpy|memset|(?<!no)cast|to_copy|contiguous|clone|cat\b|aten::cat|fill"),
    ("element-wise", r"triton|elementwise|vectorized|unrolled|reduce|aten::(add|mul|sub|div|silu|gelu|sigmoid|exp|"
                     r"neg|pow|sum|mean|rsqrt|where|tanh|sqrt|square|mse)"),
)
_COMPILED = [(kind, re.compile(pattern)) for kind, pattern in KINDS]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pattern in _COMPILED:
        if pattern.search(low):
            return kind
    return "other"


def _in_optimizer(event) -> bool:
    while event is not None:
        if event.name.startswith("Optimizer.step") or event.name.startswith("Optimizer.zero_grad"):
            return True
        event = event.cpu_parent
    return False


def device_times(prof, device: torch.device) -> dict[str, float]:
    """Microseconds of device time per kernel (CUDA) or per op's own time (CPU), by name."""
    times: dict[str, float] = defaultdict(float)
    if device.type == "cuda":
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA or (
                    e.self_device_time_total > 0 and not e.key.startswith(("aten::", "cuda", "Optimizer", "ProfilerStep"))):
                times[e.key] += e.self_device_time_total
        return times
    for e in prof.events():  # the CPU: the ops' own times, those under an optimizer step tagged as such
        if e.self_cpu_time_total <= 0 or e.name.startswith("ProfilerStep"):
            continue
        times[("Optimizer.step: " if _in_optimizer(e) else "") + e.name] += e.self_cpu_time_total
    return times


def profile_steps(step, steps: int, device: torch.device, top: int = 15) -> dict:
    """Run ``step()`` ``steps`` times under torch.profiler; device time by kind (share and ms per step) and
    the ``top`` kernels / ops by time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    times = device_times(prof, device)
    total = sum(times.values()) or 1.0
    by_kind: dict[str, float] = defaultdict(float)
    for name, us in times.items():
        by_kind[kind_of(name)] += us
    kinds = {k: {"share": us / total, "ms_per_step": us / 1e3 / steps}
             for k, us in sorted(by_kind.items(), key=lambda kv: -kv[1])}
    biggest = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    return {
        "what": "device time by kernel kind (CUDA kernels; on the CPU each op's own time)",
        "device": device.type, "steps": steps, "ms_per_step": total / 1e3 / steps, "kinds": kinds,
        "top": [{"name": n[:160], "kind": kind_of(n), "share": us / total} for n, us in biggest],
    }
