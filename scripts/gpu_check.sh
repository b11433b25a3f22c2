#!/usr/bin/env bash
# The GPU production path in one command (about 14 minutes on one GPU): bf16 train + export + sample,
# torchrun DDP and FSDP2 over NCCL on the GPUs present, torch.compile, xformers when installed, a window of
# steps under torch.cuda.set_sync_debug_mode("error"), the step benchmark (images/s per GPU, MFU) and the memory
# benchmark (full-size SDXL shapes at 1024 px: LoRA and full fine-tune peaks beside the memory plan).
# It prints a table to paste into a bug report.      bash scripts/gpu_check.sh   (OUT=folder to keep logs)
set -uo pipefail
if [ -n "${OUT:-}" ]; then  # a relative OUT is the caller's, not the repository's
  mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$NGPU" -lt 1 ]; then
  echo "gpu_check: no CUDA device is visible to torch (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset})" >&2
  exit 2
fi
"$PY" - "$OUT" <<'PYEOF'
import sys
from pathlib import Path
from sd_training.families.registry import make_tiny_pipeline
from sd_training.data.synthetic import write_shapes_shards
out = Path(sys.argv[1])
if not (out / "pipe" / "model_index.json").exists():
    make_tiny_pipeline(out / "pipe")
if not (out / "shapes").exists():
    write_shapes_shards(out / "shapes", n_samples=512, n_shards=8, size=64, seed=0)
PYEOF
[ $? -eq 0 ] || { echo "gpu_check: could not write the tiny pipeline and shards to $OUT" >&2; exit 2; }
COMMON=(experiment.log_dir="$OUT/runs" experiment.num_examples_to_see=1024 experiment.save_every=16
        experiment.log_every=8 experiment.sample_per_prompt=2 experiment.sample_steps=10 system.batch_size=16
        system.workers=4 system.device=cuda model.pretrained="$OUT/pipe" model.mixed_precision=bf16 model.use_ema=true
        "dataset.params.path=$OUT/shapes/shapes-{000000..000007}.tar" dataset.params.resolution=64
        wandb.mode=disabled experiment.progress_bar=off experiment.start_fresh=true experiment.resume=false)
ROWS=()
check() {
  local name=$1; shift
  local t0=$SECONDS
  if "$@" > "$OUT/$name.log" 2>&1; then r=ok; else r="FAIL ($OUT/$name.log)"; fi
  ROWS+=("$(printf '%-28s %-8s %5ds' "$name" "$r" $((SECONDS - t0)))")
}
check bf16_train_export_sample "$PY" train.py "${COMMON[@]}" experiment.name=bf16
check ddp_nccl_${NGPU}gpu "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" train.py "${COMMON[@]}" \
  experiment.name=ddp distributed.strategy=ddp distributed.dist_backend=nccl
check fsdp2_nccl_${NGPU}gpu "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" train.py "${COMMON[@]}" \
  experiment.name=fsdp distributed.strategy=fsdp distributed.dist_backend=nccl
if [ "$NGPU" -lt 2 ]; then  # one rank: ddp runs "single"; fsdp starts a process group of one (parallel.Strategy)
  ROWS+=("  (1 GPU: the ddp row ran one rank without DDP; the fsdp row ran FSDP2 in a process group of one)")
fi
check compile "$PY" train.py "${COMMON[@]}" experiment.name=compile model.compile=true
if "$PY" -c "import xformers" 2>/dev/null; then
  check xformers "$PY" train.py "${COMMON[@]}" experiment.name=xformers model.xformers=true
  # A failing xformers (e.g. built for another torch) only logs a warning and trains with SDPA.
  if grep -q "using PyTorch SDPA attention instead" "$OUT/xformers.log"; then
    ROWS[${#ROWS[@]}-1]="$(printf '%-28s %-8s' xformers "FAIL (fell back to SDPA: $OUT/xformers.log)")"
  fi
else
  ROWS+=("$(printf '%-28s %-8s' xformers 'not installed')")
fi
check sync_debug_window "$PY" scripts/sync_check.py --device cuda
rm -f "$OUT/bench_step.json"  # a failed benchmark must not leave an earlier run's numbers to print
check bench_step "$PY" benchmarks/bench_step.py --device cuda --out "$OUT/bench_step.json"
rm -f "$OUT/bench_memory.json"
check bench_memory "$PY" benchmarks/bench_memory.py --device cuda --timeout 300 --work "$OUT/bench_memory" \
  --out "$OUT/bench_memory.json"
echo
echo "sd-training gpu_check ($(date -u '+%F %T') UTC)"
"$PY" -c "import torch, diffusers; p = torch.cuda.get_device_properties(0); print(f'torch {torch.__version__}, CUDA {torch.version.cuda}, diffusers {diffusers.__version__}; {torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB)')"
printf '%s\n' "${ROWS[@]}"
if [ -f "$OUT/bench_step.json" ]; then
  "$PY" - "$OUT/bench_step.json" <<'PYEOF' || true
import json, sys
for r in json.load(open(sys.argv[1])).get("sd1_unet", []):
    # No MFU (None) for a GPU missing from sd_training.flops.PEAK_TFLOPS: say so rather than print 0%.
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a (GPU not in the peak table)"
    print(f"  SD 1.x {r.get('resolution')} px: {r.get('images_per_sec', 0):.1f} img/s per GPU, MFU {mfu}, "
          f"peak {r.get('peak_memory_gb', 0):.1f} GB")
PYEOF
fi
if [ -f "$OUT/bench_memory.json" ]; then
  "$PY" - "$OUT/bench_memory.json" <<'PYEOF' || true
import json, sys
r = json.load(open(sys.argv[1]))
for mode, s in r.get("summary", {}).items():
    if "error" in s:
        print(f"  memory {mode}: FAILED ({s['error']})")
        continue
    goal = f", goal <= {s['goal_gib']:g} GiB: {'yes' if s['within_goal'] else 'NO'}" if "goal_gib" in s else ""
    print(f"  memory {r['model']} {mode} {r['resolution']} px batch {r['batch']}: peak {s['peak_gib']:.1f} GiB allocated "
          f"({s['reserved_gib'] or 0:.1f} reserved), plan {s['plan_total_gib']:.1f} GiB, {s['images_per_sec']:.2f} img/s{goal}")
PYEOF
fi
! printf '%s\n' "${ROWS[@]}" | grep -q FAIL
