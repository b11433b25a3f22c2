"""What the multi-rank kill-and-resume tests share (test_elastic.py, test_hsdp.py,
test_flow_families_distributed.py, test_multinode.py): the settings of a run that checkpoints every 2 steps and
records each step's samples, the samples each step trained on, dropping the checkpoints a slow kill let
complete, and a checkpoint as full tensors (FSDP's DCP shards gathered). Launching, killing and finishing runs:
test_resume.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import train_args


def elastic_args(tmp_path, pipeline, shards, name, steps: int, global_batch: int, **over):
    """``conftest.train_args`` for ``steps`` optimizer steps of ``global_batch`` samples (``system.global_batch_size``:
    the same on any number of ranks) from micro-batches of 1, checkpointed every 2 steps (all kept, written before
    the next step), each step's sample keys recorded, EMA on, no sample grids; ``over``: the run's own keys
    (strategy, precision, loader workers and readers ...), dotted."""
    return train_args(tmp_path, pipeline, shards, name=name, **{
        "experiment.num_examples_to_see": steps * global_batch,
        "experiment.checkpoint_every": 2,
        "experiment.keep_last_checkpoints": 10,
        "experiment.sample_per_prompt": 0,
        "experiment.record_sample_keys": "true",
        "experiment.checkpoint_async": "false",
        "system.batch_size": 1,
        "system.global_batch_size": global_batch,
        "dataset.params.shuffle_buffer": 4,
        "model.use_ema": "true",
        "model.ema.decay": 0.9,
        **over,
    })


def steps_keys(run: Path, global_batch: int) -> dict[int, set[str]]:
    """Step -> the samples it trained on, over every rank, from the attempt that wrote the step last
    (the one that started from the newest checkpoint at or before it); each step must have trained on
    ``global_batch`` samples."""
    rows = [json.loads(line) for f in sorted((run / "sample_keys").glob("rank_*.jsonl"))
            for line in f.read_text().splitlines()]
    out = {}
    for step in sorted({r["step"] for r in rows}):
        mine = [r for r in rows if r["step"] == step]
        newest = max(mine, key=lambda r: (r["start_step"], r["started"]))
        attempt = {r["rank"]: r for r in mine  # per rank its last line of that attempt (rows are in file order)
                   if (r["start_step"], r["world_size"]) == (newest["start_step"], newest["world_size"])}
        chosen = list(attempt.values())
        assert sorted(attempt) == list(range(newest["world_size"])), f"step {step}: not every rank recorded it"
        keys = [k for r in chosen for k in r["keys"]]
        assert len(keys) == global_batch, f"step {step} trained on {len(keys)} samples"
        out[step] = sorted(keys)
    return out


def drop_checkpoints_after(run: Path, step: int) -> None:
    """Remove the checkpoints after ``step`` that a slow kill let complete, so the next start resumes from ``step``."""
    from sd_training.checkpoint import complete_steps

    for s in complete_steps(run / "checkpoints"):
        if s > step:
            shutil.rmtree(run / "checkpoints" / f"step_{s:08d}")


def full_checkpoint(run: Path, step: int) -> tuple[dict, dict]:
    """Checkpoint ``step`` of ``run`` as full tensors (DCP shards gathered) and its train state."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from sd_training.checkpoint import Checkpointer

    folder = run / "checkpoints" / f"step_{step:08d}"
    shared, _, state = Checkpointer.load(folder, 0)
    if (folder / "sharded").is_dir():
        full = folder.parent / f"full_{step}.pt"
        dcp_to_torch_save(str(folder / "sharded"), str(full))
        shared.update(torch.load(full, weights_only=False))
    return shared, state
