"""The step never waits for the host: between two log lines (and the flag checks every
``distributed.flag_sync_every`` steps) the training step makes no host-device synchronisation.

On the CPU a "sync" costs nothing, so the test counts the calls that would block on a GPU: ``.item()``,
``bool(t)``, ``float(t)``, ``int(t)``, ``.tolist()``, ``.cpu()``, ``.numpy()`` on a tensor, made by the
training loop of a bf16 run with EMA and a fused optimizer (the CUDA default): none in the micro-steps
and optimizer steps, none anywhere in the loop outside the steps that check flags and log.
``scripts/gpu_check.sh`` runs the same window under ``torch.cuda.set_sync_debug_mode("error")``."""

import pytest
from conftest import train_args

from sd_training import distributed
from sd_training.configure import load
from sd_training.loop import Trainer
from sd_training.speed.sync_count import BlockingCalls

pytestmark = pytest.mark.usefixtures("one_thread")


def test_no_host_sync_in_the_steps_between_two_checks(tmp_path, tiny_pipeline, shapes_shards, monkeypatch):
    cfg = load(train_args(tmp_path, tiny_pipeline, shapes_shards, name="sync", **{
        "model.mixed_precision": "bf16", "model.use_ema": "true", "optimizer.implementation": "fused",
        "experiment.log_every": 6, "distributed.flag_sync_every": 6, "experiment.num_examples_to_see": 2 * 12,
        "system.batch_size": 2,  # bf16 convolutions' backward costs in proportion to the batch on this CPU
        "experiment.save_every": 100, "experiment.checkpoint_every": 100, "experiment.sample_per_prompt": 0,
        "dataset.params.resolution": 32}))
    t = Trainer(cfg, distributed.setup("cpu"))
    in_step = [False]
    # Counts over the whole run (the loop body included), each call tagged with the step and whether it
    # came from the step methods.
    counter = BlockingCalls(label=lambda: (t.state.step, in_step[0]))
    checks = []
    real_any_rank = distributed.any_rank
    monkeypatch.setattr(distributed, "any_rank", lambda flag, dev: checks.append(t.state.step) or real_any_rank(flag, dev))
    for method in ("micro_step", "optimizer_step"):
        real = getattr(Trainer, method)

        def watched(self, *a, _real=real, **k):
            in_step[0] = True
            try:
                return _real(self, *a, **k)
            finally:
                in_step[0] = False

        monkeypatch.setattr(Trainer, method, watched)
    with counter:
        out = t.run()
    assert out["step"] == 12
    # None in the micro-steps and optimizer steps, ever.
    assert [c for c in counter.found if c[0][1]] == [], counter.found[:10]
    # None anywhere in the loop (batch hand-off, timers, progress, EMA, scheduler) except at the steps
    # that check flags and log (6 and 12); step 0 is the first iteration's, whose step methods are
    # covered above.
    assert {step for (step, _), _name in counter.found} <= {0, 6, 12}, counter.found[:10]
    # The ranks' agreement (stop signal, timed save) only at the check steps, never in between.
    assert set(checks) - {0} <= {6, 12}, sorted(set(checks))
