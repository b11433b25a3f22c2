"""Degenerate data noticed (issue 34, case 11): shards whose masks are all black train at loss 0.0000. The run
warns at its first such step naming the masks, skips those updates (weight decay would otherwise shrink every
weight while nothing is learnt), and stops with a data error after ``experiment.max_zero_weight_steps`` in a
row, the newest checkpoint intact: in this process on one rank, and through train.py on two ranks with loader
workers (exit code 2 from both, at the same step). A zero weight for another reason than masks (the flag is the
gradient norm) skips the update alike, with the host-side and the device-side (fused) skip."""

import logging
from pathlib import Path

import pytest
import torch
from conftest import train_args
from test_masked_loss import mask_shards, unet_state
from test_recipe import fixed_batch, make_trainer
from test_resume import launch

from sd_training import distributed
from sd_training.checkpoint import complete_steps
from sd_training.checkpoint.integrity import verify
from sd_training.configure import load
from sd_training.loop import Trainer
from sd_training.run.step_guards import ZeroWeightSteps

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.faults]

BLACK = {"dataset.params.masked_loss": "true", "dataset.params.resolution": 32, "system.batch_size": 2,
         "experiment.sample_per_prompt": 0, "optimizer.params.weight_decay": 0.1}


def test_black_masks_warn_at_once_skip_the_updates_and_stop_at_the_bound(tmp_path, tiny_pipeline, caplog):
    cfg = load(train_args(tmp_path, tiny_pipeline, mask_shards(tmp_path / "black", 0), name="black", **{
        **BLACK, "experiment.num_examples_to_see": 2 * 6, "experiment.max_zero_weight_steps": 3,
        "experiment.checkpoint_every": 2, "experiment.log_every": 10, "distributed.flag_sync_every": 1}))
    before = unet_state(tiny_pipeline / "unet")
    t = Trainer(cfg, distributed.setup("cpu"))
    with caplog.at_level(logging.WARNING), pytest.raises(ZeroWeightSteps) as err:
        t.run()
    message = str(err.value)
    assert message.startswith("3 optimizer steps in a row (steps 1-3) had an exactly zero gradient"), message
    assert "experiment.max_zero_weight_steps=3" in message and "3 of them had only masks that are black everywhere" \
        in message and "unmasked_weight=0" in message, message
    assert t.state.step == 3  # stopped at the check of the third zero step, not at the end (6)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    first = [w for w in warnings if w.startswith("step 1: every sample of this rank's batch has a mask that is black")]
    assert len(first) == 1 and "dataset.params.unmasked_weight" in first[0], warnings
    assert any("1 optimizer step(s) of steps 1-1 had an exactly zero gradient" in w for w in warnings), warnings
    # No update, so no weight decay: the UNet is bit for bit the pipeline's (on today's code 0.1 decay moves it).
    after = {k: v.detach().cpu() for k, v in t.net.state_dict().items()}
    assert all(torch.equal(after[k], before[k]) for k in before)
    # The newest checkpoint (step 2) is whole; the stop wrote none.
    ckpts = t.run_dir.checkpoints
    assert complete_steps(ckpts) == [2]
    assert verify(ckpts / "step_00000002") is not None


def test_two_ranks_with_loader_workers_stop_together_with_a_data_error(tmp_path, tiny_pipeline):
    args = train_args(tmp_path, tiny_pipeline, mask_shards(tmp_path / "black", 0), name="two", **{
        **BLACK, "experiment.num_examples_to_see": 2 * 2 * 6, "experiment.max_zero_weight_steps": 2,
        "experiment.checkpoint_every": 1, "system.workers": 1})
    p = launch(tmp_path, args, nproc=2)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 2, out[-4000:]
    # The ranks stop at the same check (the flag is the all-reduced gradient's norm): no rank wrote the step-2
    # checkpoint, and a rank whose line made it out before the launcher ended the other says the same.
    stops = [line for line in out.splitlines() if line.startswith("config error:")]
    assert stops and len(set(stops)) == 1, out[-4000:]
    assert "2 optimizer steps in a row (steps 1-2)" in stops[0] and "max_zero_weight_steps=2" in stops[0], stops
    ckpts = tmp_path / "runs" / "two" / "checkpoints"
    assert complete_steps(ckpts) == [1]
    assert verify(Path(ckpts) / "step_00000001") is not None
    log = (tmp_path / "runs" / "two" / "train.log").read_text()
    assert "The run stopped, as the data trains nothing" in log and "mask that is black everywhere" in log


@pytest.mark.parametrize("implementation", ["for_loop", "fused"])
def test_a_zero_weight_batch_for_any_reason_skips_the_update_and_is_counted(tmp_path, tiny_pipeline, shapes_shards,
                                                                           implementation, caplog):
    """A batch whose loss weights are all 0 without masks the loader saw (the flag is the gradient norm): no
    weight decay and no Adam moment update, counted on the device, named at the check as not the masks."""
    t = make_trainer(tmp_path, tiny_pipeline, shapes_shards, name="w0", **{
        "optimizer.implementation": implementation, "optimizer.params.weight_decay": 0.1})
    t.micro_step(fixed_batch(t), sync=True)
    t.optimizer_step()  # one good step first, so the optimizer has state to protect
    before = {k: v.clone() for k, v in t.net.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in t.optimizer.state.values()]
    zero = {**fixed_batch(t), "loss_weight": torch.zeros(4, 1, 8, 8)}
    t.micro_step(zero, sync=True)
    t.optimizer_step()
    assert all(torch.equal(v, t.net.state_dict()[k]) for k, v in before.items())  # no update, no decay
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, t.optimizer.state.values()))
    assert int(t.guards.streak) == 1 and int(t.guards.nonfinite_total) == 0
    with caplog.at_level(logging.WARNING):
        t.guards.check(2, before_stop=lambda: None)
    assert any("1 optimizer step(s) of steps 1-2 had an exactly zero gradient" in r.getMessage()
               and "a loss weighting that gives 0" in r.getMessage() for r in caplog.records), caplog.text
    t.micro_step(fixed_batch(t), sync=True)
    t.optimizer_step()
    assert int(t.guards.streak) == 0  # a step with data resets the streak
