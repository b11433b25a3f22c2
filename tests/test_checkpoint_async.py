"""Asynchronous resume checkpoints: the step waits only for a host copy; what is written is the state at
the save, whatever training does meanwhile; a writer's failure surfaces in the training thread and
leaves the previous checkpoint the newest complete one."""

from __future__ import annotations

import threading

import pytest
import torch

from sd_training.checkpoint import MARKER, Checkpointer, complete_steps


def _state(value: float) -> dict:
    return {"unet": {"w": torch.full((256, 256), value), "step": 3}, "optimizer": {"state": {0: {"m": torch.ones(4)}}}}


def test_async_save_writes_the_state_of_the_save_not_later_changes(tmp_path):
    ck = Checkpointer(tmp_path, asynchronous=True)
    shared = _state(1.0)
    per_rank = {"rng": torch.arange(5), "data": {"pos": [1, 2]}}
    final = ck.save(10, shared, per_rank, {"step": 10}, "a: 1\n", rank=0)
    # Training goes on at once: in-place updates, a new data position.
    shared["unet"]["w"].add_(5.0)
    per_rank["rng"].zero_()
    per_rank["data"]["pos"].append(3)
    ck.wait()
    assert (final / MARKER).exists() and complete_steps(tmp_path) == [10]
    loaded, rank_state, train_state = Checkpointer.load(final, 0)
    assert torch.equal(loaded["unet"]["w"], torch.full((256, 256), 1.0)) and loaded["unet"]["step"] == 3
    assert torch.equal(rank_state["rng"], torch.arange(5)) and rank_state["data"] == {"pos": [1, 2]}
    assert train_state["step"] == 10
    assert ck.last_stall_s < 5.0


def test_the_next_save_waits_for_the_one_in_flight_and_retention_still_applies(tmp_path, monkeypatch):
    import sd_training.checkpoint.store as checkpoint

    ck = Checkpointer(tmp_path, keep_last=2, asynchronous=True)
    gate = threading.Event()
    real = checkpoint._atomic_torch_save

    def slow(obj, path):  # the first save's writer is held until the second save has been asked for
        if path.parent.name.startswith("step_00000001"):
            assert gate.wait(10)
        real(obj, path)

    monkeypatch.setattr(checkpoint, "_atomic_torch_save", slow)
    ck.save(1, _state(1.0), {"rng": torch.zeros(1)}, {"step": 1}, "", rank=0)
    assert complete_steps(tmp_path) == []  # still being written
    threading.Timer(0.3, gate.set).start()
    for step in (2, 3):
        ck.save(step, _state(float(step)), {"rng": torch.zeros(1)}, {"step": step}, "", rank=0)
    ck.wait()
    assert complete_steps(tmp_path) == [2, 3]  # one at a time, in order; keep_last=2


def test_a_failed_background_write_is_raised_at_wait_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    """(A full disk in the writer, as the synchronous path's tmpfs test produces it for real.)"""
    import sd_training.checkpoint.store as checkpoint

    ck = Checkpointer(tmp_path, asynchronous=True)
    ck.save(1, _state(1.0), {"rng": torch.zeros(1)}, {"step": 1}, "", rank=0)
    ck.wait()
    real = checkpoint._atomic_torch_save

    def full(obj, path):
        if path.name == "unet.pt":
            raise checkpoint.CheckpointWriteError(f"cannot write {path}: no space left on the device")
        real(obj, path)

    monkeypatch.setattr(checkpoint, "_atomic_torch_save", full)
    ck.save(2, _state(2.0), {"rng": torch.zeros(1)}, {"step": 2}, "", rank=0)  # returns: the writer fails later
    with pytest.raises(checkpoint.CheckpointWriteError, match="no space left"):
        ck.wait()
    assert complete_steps(tmp_path) == [1]
    Checkpointer.load(tmp_path / "step_00000001", 0)
    ck.wait()  # raised once, in the training thread
