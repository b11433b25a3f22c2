"""Does the training step wait for the host? Trains a window of steps of the tiny pipeline and reports
the host-device synchronisations made inside the micro-steps and optimizer steps between two checks.

    python scripts/sync_check.py --device cuda     # torch.cuda.set_sync_debug_mode("error") in the window
    python scripts/sync_check.py --device cpu      # counts the calls that would block on a GPU

Exit status 0 when the window has none. Used by scripts/gpu_check.sh; tests/test_host_sync.py is the CPU
test of the same property.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from sd_training.config.script_args import integer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--steps", type=integer(6, 600), default=12, help="steps, 6 to 600; checks at every 6th")
    a = ap.parse_args(argv)

    from sd_training import distributed
    from sd_training.configure import load
    from sd_training.data.synthetic import write_shapes_shards
    from sd_training.families.registry import make_tiny_pipeline
    from sd_training.loop import Trainer
    from sd_training.speed.sync_count import BlockingCalls

    work = Path(tempfile.mkdtemp(prefix="sync_check_"))
    pipe = make_tiny_pipeline(work / "pipe")
    shards = write_shapes_shards(work / "shapes", n_samples=64, n_shards=2, size=64, seed=0)
    cfg = load([
        f"experiment.log_dir={work / 'runs'}", "experiment.name=sync", f"experiment.num_examples_to_see={4 * a.steps}",
        "experiment.log_every=6", "distributed.flag_sync_every=6", "experiment.save_every=1000",
        "experiment.checkpoint_every=1000", "experiment.sample_per_prompt=0", "experiment.progress_bar=off",
        "system.batch_size=4", "system.workers=0", f"system.device={a.device}", f"model.pretrained={pipe}",
        f"model.mixed_precision={a.precision}", "model.use_ema=true", "optimizer.implementation=fused",
        f"dataset.params.path={shards}", "dataset.params.resolution=64", "wandb.mode=disabled",
    ])
    t = Trainer(cfg, distributed.setup(a.device))
    found: list = []
    counter = contextlib.nullcontext()
    if a.device == "cuda":
        def enter():
            torch.cuda.set_sync_debug_mode("error")

        def leave():
            torch.cuda.set_sync_debug_mode("default")
    else:
        counter = BlockingCalls(label=lambda: t.state.step, active=False)  # counts inside the step methods only
        found = counter.found

        def enter():
            counter.active = True

        def leave():
            counter.active = False

    for method in ("micro_step", "optimizer_step"):
        real = getattr(Trainer, method)

        def watched(self, *args, _real=real, **kw):
            enter()
            try:
                return _real(self, *args, **kw)
            except RuntimeError as e:  # sync debug mode "error" raises at the synchronising call
                found.append((self.state.step, str(e).splitlines()[0]))
                raise
            finally:
                leave()

        setattr(Trainer, method, watched)
    ok = True
    try:
        with counter:
            t.run()
    except RuntimeError:
        ok = False
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the tiny pipeline, shards and run folder (~400 MB)
    ok = ok and not found
    print(json.dumps({"device": a.device, "precision": a.precision, "syncs_in_steps": len(found),
                      "first": found[:5], "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    sys.exit(main())
