"""Asynchronous saves copy device tensors into host buffers kept from save to save (pinned on CUDA). Pinning
is slow (seconds per 10 GB), so the buffers are allocated in a background thread after the first optimizer
step, and the first save only copies into them. The pinned buffers need a GPU; here the staging predicate
and the allocator are pointed at CPU tensors so the same code paths run and can be counted."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import train_args
from helpers import run_trainer

from sd_training.checkpoint import Checkpointer, complete_steps
from sd_training.checkpoint.store import Snapshot
from sd_training.configure import load

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def counted_buffers(monkeypatch):
    """Every CPU tensor staged as a device tensor would be; each buffer allocation recorded with its thread."""
    made: list[tuple[str, tuple]] = []

    def new_buffer(t):
        made.append((threading.current_thread().name, tuple(t.shape)))
        return torch.empty(t.shape, dtype=t.dtype)

    monkeypatch.setattr(Snapshot, "staged", staticmethod(lambda t: True))
    monkeypatch.setattr(Snapshot, "new_buffer", staticmethod(new_buffer))
    return made


def test_reserved_buffers_are_the_ones_the_save_copies_into(tmp_path, counted_buffers):
    ck = Checkpointer(tmp_path, asynchronous=True)
    shared = {"unet": {"w": torch.full((64, 64), 2.0), "b": torch.ones(3)},
              "optimizer": {"state": {0: {"exp_avg": torch.ones(5)}}, "param_groups": [{"lr": 0.1}]}}
    ck.reserve(shared, {})
    ck._snapshot._reserving.join()
    reserved = dict(ck._snapshot._buffers)
    assert len(reserved) == 3 and all(name == "checkpoint-staging" for name, _ in counted_buffers)
    counted_buffers.clear()
    final = ck.save(4, shared, {"rng": torch.arange(3)}, {"step": 4}, "a: 1\n", rank=0)
    ck.wait()
    assert counted_buffers == [("MainThread", (3,))]  # only the rank file's tensor was not reserved
    assert all(ck._snapshot._buffers[k] is v for k, v in reserved.items())
    loaded, _, _ = Checkpointer.load(final, 0)
    assert torch.equal(loaded["unet"]["w"], torch.full((64, 64), 2.0))
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], torch.ones(5))


def test_a_training_run_reserves_after_its_first_step_and_its_first_save_allocates_nothing(
        tmp_path, tiny_pipeline, shapes_shards, counted_buffers):
    """bf16 with EMA: the net, AdamW's moments and the EMA shadow are reserved in the background thread."""
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, experiment__num_examples_to_see=16,
                          experiment__checkpoint_every=2, experiment__checkpoint_async="true",
                          model__mixed_precision="bf16", model__use_ema="true", experiment__sample_per_prompt=0,
                          dataset__params__resolution=32))  # bf16 convolutions are slow kernels on this CPU
    t = run_trainer(cfg)
    assert complete_steps(t.run_dir.checkpoints)[-1] == 4
    background = [shape for name, shape in counted_buffers if name == "checkpoint-staging"]
    n_params = len(list(t.net.parameters()))
    assert len(background) >= 4 * n_params  # weights, two AdamW moments, the EMA shadow
    # The training thread allocated only the buffers of the small per-save state (RNG, LR schedule).
    main = [shape for name, shape in counted_buffers if name != "checkpoint-staging"]
    assert sum(torch.Size(s).numel() for s in main) < 10_000, main[:5]
