"""Helpers the test modules share: tiny-run arguments with a module's defaults, a Trainer in this process,
and the largest difference of two state dicts. (Fixtures stay in conftest.py; these are plain functions.)"""

from __future__ import annotations

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
