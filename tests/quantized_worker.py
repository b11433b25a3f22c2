"""Run under torchrun (or alone): one training run of ``train.py``'s config arguments, then every rank saves
its net's trained parameters (the adapter) to ``OUT.rank<r>.pt``: whether the ranks hold the same adapter.

    python tests/quantized_worker.py OUT key=value ...
"""

import sys

import torch

from sd_training import distributed
from sd_training.configure import load
from sd_training.loop import Trainer


def main(out: str, argv: list[str]) -> None:
    cfg = load(argv)
    info = distributed.setup(cfg.system.device, cfg.distributed.dist_backend, cfg.distributed.dist_url)
    try:
        t = Trainer(cfg, info)
        t.run()
        trained = {n: p.detach().cpu().clone() for n, p in t.net.named_parameters() if p.requires_grad}
        torch.save(trained, f"{out}.rank{info.rank}.pt")
    finally:
        distributed.teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
