"""Train the quickstart's autoencoder with this project's own autoencoder stage and write it to
``sd_training/assets/quickstart_vae`` (config.json, diffusion_pytorch_model.safetensors, provenance.json).

    python scripts/train_quickstart_vae.py                 # its time on 2 CPU cores: docs/quickstarts.md
    python scripts/train_quickstart_vae.py --check         # rebuild in a scratch folder, compare bytes

Everything is fixed: the generated-shapes data (seed 0), the tiny random-weight starting point (seed 0),
the config (``configs/quickstart_vae.yaml``), one process, no loader workers, two intra-op threads. On
the same torch build and CPU the output is the same byte for byte (``--check`` says whether it is);
other CPUs may differ in the last bits of some kernels.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart_vae.yaml"
ASSET = ROOT / "sd_training" / "assets" / "quickstart_vae"
WEIGHTS = "diffusion_pytorch_model.safetensors"
THREADS = 2


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path, work: Path, overrides: list[str]) -> dict:
    """Train with the autoencoder stage in ``work`` and write the asset to ``out``; returns the provenance."""
    import torch

    from sd_training.configure import load
    from sd_training.loop import main as train
    from sd_training.quickstart import prepare

    torch.set_num_threads(THREADS)
    shutil.rmtree(work / "runs", ignore_errors=True)
    args = [f"config={CONFIG}", f"quickstart.tiny_pipeline={work / 'tiny_pipeline'}",
            f"quickstart.shapes_dataset={work / 'shapes'}", f"model.pretrained={work / 'tiny_pipeline'}",
            f"dataset.params.path={work / 'shapes'}/shapes-{{000000..000006}}.tar",
            f"validation.path={work / 'shapes'}/shapes-000007.tar", f"experiment.log_dir={work / 'runs'}",
            *overrides]
    cfg = load(args)
    summary = train(cfg, prepare=lambda info: prepare(cfg.quickstart, info.is_main))  # the tiny pipeline and shapes
    vae = Path(summary["run_dir"]) / "current_pipeline" / "vae"
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copy(vae / "config.json", tmp / "config.json")
    shutil.copy(vae / WEIGHTS, tmp / WEIGHTS)
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    val = [r["val/loss"] for r in rows if "val/loss" in r]
    provenance = {
        "what": "the quickstart's VAE (AutoencoderKL, sd_training.families.tiny.TINY_VAE), trained by sd-training's autoencoder stage",
        "rebuild": "python scripts/train_quickstart_vae.py (--check compares a rebuild with these bytes)",
        "config": str(CONFIG.relative_to(ROOT)),
        "overrides": overrides,
        "steps": summary["step"],
        "images_seen": summary["images_seen"],
        "held_out_reconstruction_loss": {"untrained": val[0], "trained": val[-1]} if val else None,
        "scaling_factor": json.loads((vae / "config.json").read_text())["scaling_factor"],
        "sha256": {WEIGHTS: sha256(tmp / WEIGHTS), "config.json": sha256(tmp / "config.json")},
        "torch": torch.__version__.split("+")[0],
        "threads": THREADS,
    }
    (tmp / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return provenance


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ASSET, help="asset folder to write")
    ap.add_argument("--work", type=Path, default=ROOT / "data" / "quickstart_vae_build", help="scratch folder")
    ap.add_argument("--check", action="store_true", help="rebuild into the scratch folder and compare with --out")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value), e.g. for a shorter build")
    a = ap.parse_args(argv)
    if not a.check:
        p = build(a.out, a.work, a.overrides)
        print(f"wrote {a.out}: {p['sha256'][WEIGHTS]}")
        return 0
    rebuilt = build(a.work / "asset", a.work, a.overrides)
    shipped = json.loads((a.out / "provenance.json").read_text())["sha256"]
    same = rebuilt["sha256"] == shipped and all(
        (a.work / "asset" / f).read_bytes() == (a.out / f).read_bytes() for f in (WEIGHTS, "config.json"))
    print(("identical" if same else "DIFFERENT") + f": rebuilt {rebuilt['sha256'][WEIGHTS]}, shipped {shipped[WEIGHTS]}")
    return 0 if same else 1


if __name__ == "__main__":
    from sd_training.config.secrets import scrub_script_output

    scrub_script_output()  # URLs with user:password and tokens never reach the terminal
    sys.exit(main())
