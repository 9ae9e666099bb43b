#!/usr/bin/env bash
# The learning curve of the small-image recipe on a GPU, with images/s (issue 27, item 6):
#
#     bash benchmarks/gpu_curve.sh                  # on a CUDA machine, from the repository root (~5 min on an H100)
#     GPU_CURVE_DRY=1 bash benchmarks/gpu_curve.sh  # the same steps on the CPU, 1 epoch, 600 generated images
#
# On the embedded digits (8 px) and on generated 32-px images (synthetic:2000): three pretraining
# runs (seeds 0-2) of the `digits` preset (batch 256, 40 epochs, `--keep-every log`), then
# `bt-hub eval compare --over-steps --as-seeds` of their kept steps against pixels and random init
# (kNN and the linear grid). Writes to $OUT (default ./gpu_curve_out): curve_<data>/ (compare.md,
# curve.png, the records) and summary.md (the crossings, and the pretraining images/s: the median
# of metrics.jsonl's pairs_per_s x 2 views). Without a CUDA device (and not a dry run) it says so
# and exits 0: the script is ready, the rows unmeasured.
set -euo pipefail

OUT=${OUT:-./gpu_curve_out}
PY=${PYTHON:-python3}
DRY=${GPU_CURVE_DRY:-0}
DEVICE=cuda EPOCHS=40 SYNTHETIC=synthetic:2000
if [[ "$DRY" == 1 ]]; then
    DEVICE=cpu EPOCHS=1 SYNTHETIC=synthetic:600
elif ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_curve.sh: no CUDA device here; the GPU curve is unmeasured (run this script where one is lent)"
    exit 0
fi
mkdir -p "$OUT"
bt_hub() { "$PY" -m bt_hub.cli "$@"; }
echo "# GPU curve, $(date -u +%FT%TZ), device $DEVICE, git $(git rev-parse --short HEAD 2>/dev/null)" >"$OUT/summary.md"
"$PY" -c "import torch; print('-', torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU')" >>"$OUT/summary.md"

for data in digits "$SYNTHETIC"; do
    name=${data%%:*}
    px=$([[ $name == digits ]] && echo 8 || echo 32)
    runs=()
    for seed in 0 1 2; do
        run="$OUT/pretrain_${name}_seed$seed"
        bt_hub pretrain --preset digits --data "$data" --image-size "$px" --epochs "$EPOCHS" --keep-every log \
            --seed "$seed" --device "$DEVICE" --out "$run" --overwrite
        runs+=("$run")
    done
    split=$([[ $name == digits ]] && echo "--test-split test" || echo "--test-split val")
    bt_hub eval compare --weights "${runs[@]}" --as-seeds --over-steps --data "$data" --image-size "$px" $split \
        --device "$DEVICE" --out "$OUT/curve_$name" --overwrite
    "$PY" - "$OUT" "$name" "${runs[@]}" >>"$OUT/summary.md" <<'PYEOF'
import json, statistics, sys
from pathlib import Path

out, name, runs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
found = json.loads((out / f"curve_{name}" / "results.json").read_text())
rates = [r["pairs_per_s"] * 2 for run in runs for r in map(json.loads, open(Path(run) / "metrics.jsonl")) if "pairs_per_s" in r]
print(f"\n## {name}\n\npretraining: median {statistics.median(rates):.0f} images/s over {len(runs)} runs\n")
print("\n".join(f"- {line}" for line in found["curve"]["crossings"]))
PYEOF
done
cat "$OUT/summary.md"
