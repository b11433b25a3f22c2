"""Helpers the test modules share: tiny-run arguments with a module's defaults, a Trainer in this process,
the largest difference of two state dicts, and a family's step checked against a diffusers example's
(``step_equals_example``; the examples themselves: example_steps.py). (Fixtures stay in conftest.py; these
are plain functions.)"""

from __future__ import annotations

import contextlib
import types

from conftest import train_args


def dotted(over: dict) -> dict:
    """``{"a.b": v}`` or ``{"a__b": v}`` as the ``a.b`` keys ``conftest.train_args`` writes."""
    return {k.replace("__", "."): v for k, v in over.items()}


def args_with(defaults: dict, name: str = "run"):
    """A module's ``args(tmp_path, pipeline, shards, name=name, **over)``: ``conftest.train_args`` with
    ``defaults`` (dotted keys) under the call's overrides (dotted keys, or ``__`` for the dots)."""
    default_name = name

    def args(tmp_path, pipeline, shards, name=default_name, **over):
        return train_args(tmp_path, pipeline, shards, name=name, **{**dotted(defaults), **dotted(over)})

    return args


def ready_trainer(cfg):
    """A ``Trainer`` of ``cfg`` in this process on the CPU, set up (components, optimizer, data, resume)."""
    from sd_training import distributed
    from sd_training.loop import Trainer

    t = Trainer(cfg, distributed.setup("cpu"))
    t.setup()
    return t


def run_trainer(cfg):
    """``cfg`` trained to its end in this process on the CPU (``Trainer.run``); the process group, if any,
    is torn down even when the run fails. Returns the Trainer (its net, optimizer, run folder)."""
    from sd_training import distributed
    from sd_training.loop import Trainer

    t = Trainer(cfg, distributed.setup("cpu"))
    try:
        t.run()
    finally:
        distributed.teardown()
    return t


def max_diff(a, b, strict: bool = False) -> float:
    """The largest absolute difference between two tensors or (nested) dicts / lists of them, over ``a``'s keys
    (shapes equal; integer tensors and other values must be equal). ``strict``: the same keys and dtypes too."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, (getattr(a, "shape", a), getattr(b, "shape", b))
        assert not strict or a.dtype == b.dtype, (a.dtype, b.dtype)
        if not a.is_floating_point():
            assert torch.equal(a, b.to(a.dtype))
            return 0.0
        return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict):
        assert a.keys() == b.keys() if strict else a.keys() <= b.keys(), sorted(set(a) ^ set(b))[:5]
        return max((max_diff(a[k], b[k], strict) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        return max((max_diff(x, y, strict) for x, y in zip(a, b)), default=0.0)
    assert a == b, (a, b)
    return 0.0


def largest(a) -> float:
    """The largest magnitude of a tensor or (nested) dict / list of them (the scale of a ``max_diff``)."""
    import torch

    if isinstance(a, torch.Tensor):
        return float(a.double().abs().max()) if a.is_floating_point() and a.numel() else 0.0
    if isinstance(a, dict):
        return max((largest(v) for v in a.values()), default=0.0)
    if isinstance(a, (list, tuple)):
        return max((largest(v) for v in a), default=0.0)
    return 0.0


def alive(pid: int) -> bool:
    """A live process (a zombie, dead but not yet reaped, has exited: its files and locks are released)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def example_timesteps(fm, seeds):
    """u in [0, 1] per sample, drawn as diffusers' training examples draw it
    (``compute_density_for_timestep_sampling`` with ``flow_matching``'s settings), from each sample's own
    "timesteps" generator: the draws the family's loss makes for the same seeds."""
    import torch
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from sd_training.families.components.ddpm import sample_generators

    return torch.cat([compute_density_for_timestep_sampling(fm.timestep_sampling, 1, fm.logit_mean, fm.logit_std,
                                                            fm.mode_scale, generator=g)
                      for g in sample_generators(seeds, "timesteps", "cpu")])


@contextlib.contextmanager
def without_forward_hooks(module):
    """``module`` with its forward hooks off for the block (an example script's transformer, without a family's
    hooks on it), then back."""
    hooks = dict(module._forward_hooks)
    module._forward_hooks.clear()
    try:
        yield module
    finally:
        module._forward_hooks.update(hooks)


@contextlib.contextmanager
def step_equals_example(family, batch, noise_shape, example, unused_in=None, other=None):
    """One step of ``family`` on ``batch`` against ``example(u, noise) -> (loss, timesteps)``, a step written as a
    diffusers training example computes it on ``family.net``, with the same u and noise (drawn from the batch's
    sample seeds' streams as the family draws them; the noise ``[B, *noise_shape]``) and the example's sigma
    table (the scheduler's own, unshifted): the timesteps equal (and not all one), the loss and every gradient
    within 1e-5 relative (float32: summation orders differ). ``unused_in``: the prefix of the parameters the
    example leaves without a gradient (there must be some; the family gives them zeros), None: none is.
    ``other()``: another loss of the family's (no gradient; on the same table), as ``.other``, to show what
    conditions the step.
    Yields ``.ours`` (the family's LossOutput) and ``.other`` with the example's gradients still on the net,
    for the caller's own checks; they are cleared after the block."""
    import torch

    from sd_training.families.components.ddpm import sample_generators

    fm, net = family.cfg.flow_matching, family.net
    plain = torch.autocast("cpu", enabled=False)
    fm.shift, fm.resolution_shift = 1.0, False  # the examples' table: the scheduler's own, unshifted
    try:
        seeds = batch["sample_seeds"]
        u = example_timesteps(fm, seeds)
        noise = torch.cat([torch.randn(1, *noise_shape, generator=g) for g in sample_generators(seeds, "noise", "cpu")])
        net.zero_grad(set_to_none=True)
        ours = family.loss(net, batch, plain)
        ours.loss.backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        net.zero_grad(set_to_none=True)
        want, timesteps = example(u, noise)
        want.backward()
        if other is not None:
            with torch.no_grad():
                other = other()
    finally:
        fm.shift, fm.resolution_shift = None, None
    try:
        assert torch.equal(ours.timesteps, timesteps.long()) and len(set(timesteps.tolist())) > 1
        torch.testing.assert_close(ours.loss, want, rtol=1e-5, atol=0)
        unused = {n for n, p in net.named_parameters() if p.grad is None}
        if unused_in is None:
            assert not unused, sorted(unused)[:5]
        else:
            assert unused and all(n.startswith(unused_in) for n in unused), sorted(unused)[:5]
        for n, p in net.named_parameters():
            torch.testing.assert_close(grads[n], torch.zeros_like(grads[n]) if n in unused else p.grad, rtol=1e-5,
                                       atol=1e-7, msg=n)
        yield types.SimpleNamespace(ours=ours, other=other)
    finally:
        net.zero_grad(set_to_none=True)


def train_config(config, work, timeout: int = 2000) -> None:
    """``train.py config=CONFIG`` as a user runs a shipped config, from the folder ``work`` (its data/ and runs/
    land there), forked (tests/forked.py), wandb off. Two threads when it has the machine; one beside parallel
    test workers (two threads that share a busy core wait on each other at every small op)."""
    import os
    import sys
    from pathlib import Path

    import forked

    threads = "1" if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 else "2"
    env = {**os.environ, "OMP_NUM_THREADS": threads, "WANDB_MODE": "disabled"}
    train = Path(__file__).resolve().parents[1] / "train.py"
    res = forked.run([sys.executable, str(train), f"config={config}", "wandb.mode=disabled"], cwd=work, env=env,
                     capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]


def val_losses(run) -> dict[int, float]:
    """Step -> the held-out loss (``val/loss``) of a run folder's metrics.jsonl."""
    import json
    from pathlib import Path

    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val/loss"] for r in rows if "val/loss" in r}
