"""Will a run fit a GPU? The memory plan of a config, read without building anything or touching a GPU,
and the settings that would fit when it does not.

    python scripts/plan_memory.py config=configs/templates/sdxl-lora.yaml --gpu-gb 24
    python scripts/plan_memory.py config=my.yaml model.gradient_checkpointing=true --gpu-gb 24 --gpu-gb 80

The trained module is counted from its weight files' headers (a local folder or a hub id already in the
cache) or, with ``model.<net>.params``, built on the meta device; the activations are the plan's rough
lower estimate. Without ``--gpu-gb`` it plans for this machine's device (``system.device``). Exit status:
0 when the run fits every size asked, 1 when it does not, 2 for a config it cannot read.
"""

from __future__ import annotations

import argparse
import sys

from sd_training.config import ConfigError
from sd_training.config.loading import parse
from sd_training.config.script_args import number
from sd_training.memory.fit import device_memory, load_plan, need_bytes, report
from sd_training.memory.plan import GIB


MAX_GPU_GB = 4096.0  # GiB: well above any one accelerator; a larger value is a typo (MiB, bytes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu-gb", type=number(gt=0, hi=MAX_GPU_GB), action="append", default=[],
                    help=f"plan for a GPU of this many GiB, > 0 and <= {MAX_GPU_GB:g} (repeatable); default: this "
                         "machine's system.device")
    args, overrides = ap.parse_known_args(argv)
    try:
        cfg = parse(overrides)
    except ConfigError as e:
        print(f"plan_memory: {e}", file=sys.stderr)
        return 2
    targets = [(gb * GIB, f"the GPU has {gb:g} GiB") for gb in args.gpu_gb]
    if not targets:
        found = device_memory(cfg.system.device)
        if found is None:
            print(f"plan_memory: system.device={cfg.system.device} is not on this machine: give --gpu-gb", file=sys.stderr)
            return 2
        targets = [(found[0], found[1])]
    try:
        plan = load_plan(cfg)  # e.g. a model.adapter.target_regex past its matching budget (config.patterns)
    except ConfigError as e:
        print(f"plan_memory: {e}", file=sys.stderr)
        return 2
    fits = True
    for memory, where in targets:
        print(f"== {where}\n{report(cfg, memory, where)}\n")
        fits = fits and plan is not None and need_bytes(plan, cfg) <= memory
    return 0 if fits else 1


if __name__ == "__main__":
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    sys.exit(main())
