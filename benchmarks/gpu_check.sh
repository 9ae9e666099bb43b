#!/usr/bin/env bash
# The GPU rows of docs/performance.md in one run of under 8 minutes on one H100/H200 (issue 28):
#
#     bash benchmarks/gpu_check.sh                      # on the GPU machine, from the repository root
#     GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh      # the same steps on the CPU at tiny sizes (~3 min, 2 cores;
#                                                       # torch.compile disabled: Inductor would take minutes)
#
# Installs bt_hub from this tree without network, then runs, each step under its own `timeout`
# and going on when one fails or runs out of time:
#   1. pytest -m gpu (the CUDA tests)                                               -> pytest_gpu.txt
#   2. evaluation throughput, ResNet-50, 224 px, 500x375 JPEGs: (a) model-only ceiling,
#      (b) bt_hub from files, (c) ImageFolder + PIL in 4 and in 16 workers          -> eval_throughput.txt
#   3. compiled pretraining, batch 256: (a) compiled ceiling, (b) bt_hub --compile  -> pretrain_compiled.txt
#   4. `bt-hub eval all --device cuda` on a generated 224-px ImageFolder (train/, val/) with a
#      torchvision-default-init ResNet-50 exported by `bt-hub export`, timed            -> eval_all.txt
# and writes machine.txt (GPU, torch, CPU model and flags, the install's log) and summary.md (each
# step's exit status and seconds; the ratios the issue targets). Everything goes to $OUT (default
# ./gpu_check_out): six files, no folders. PYTHON picks the interpreter (default python3).
set -uo pipefail

OUT=${OUT:-./gpu_check_out}
DRY=${GPU_CHECK_DRY:-0}
[[ "${1:-}" == "--dry-run" ]] && DRY=1
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/bt_hub_gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
BENCH=$(cd "$(dirname "$0")" && pwd)
START=$SECONDS

if [[ "$DRY" == 1 ]]; then
    DEVICE=cpu
    EVAL_SIZES=(--arch resnet18 --small-image-stem --image-size 32 --jpeg-size 64x48 --batch-size 16 --steps 2
        --warmup 1 --workers 1 --reference-workers 1 2)
    PRETRAIN_SIZES=(--arch resnet18 --image-size 32 --projector 64-64 --batch-size 8 --warmup 1 --steps 2
        --jpeg-size 64x48 --workers 1)
    ALL_ARCH=resnet18 ALL_PX=32 ALL_TRAIN=60 ALL_VAL=20 ALL_WORKERS=1 ALL_EPOCHS="--linear-epochs 10 --semi-epochs 1"
    BUDGET=(60 60 60 90)
    export TORCH_COMPILE_DISABLE=1  # Inductor's C++ build of ResNet-18 alone outlasts the dry run on 2 cores
else
    DEVICE=cuda
    EVAL_SIZES=(--arch resnet50 --image-size 224 --jpeg-size 500x375 --batch-size 256 --steps 20 --warmup 2
        --workers 16 --reference-workers 4 16)
    PRETRAIN_SIZES=(--arch resnet50 --image-size 224 --projector 8192-8192-8192 --batch-size 256 --warmup 3
        --steps 10 --jpeg-size 500x375 --workers 16)
    ALL_ARCH=resnet50 ALL_PX=224 ALL_TRAIN=500 ALL_VAL=100 ALL_WORKERS=8 ALL_EPOCHS=""  # the presets' epochs
    BUDGET=(120 60 240 45)  # seconds of steps 1-4: 465 (on an H100: tests 63 s, compiles 120 + 103 s), under 8 minutes
fi

# step NAME SECONDS LOG COMMAND...: run COMMAND under `timeout`, its output to the screen and LOG;
# the exit status (124: out of time) and seconds go to $WORK/steps for summary.md.
step() {
    local name=$1 budget=$2 log=$3
    shift 3
    local tick=$SECONDS
    echo "== $name (timeout ${budget} s)" | tee -a "$log"
    timeout -k 10 "$budget" "$@" 2>&1 | tee -a "$log"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - tick)) s" | tee -a "$log"
    echo "$name|$rc|$((SECONDS - tick))|$budget" >>"$WORK/steps"
}

bt_hub() { "$PY" -m bt_hub.cli "$@"; }

# ---------------------------------------------------------------------------- install, machine
echo "gpu_check.sh, $(date -u +%FT%TZ), dry run: $DRY, device: $DEVICE, git: $(git rev-parse --short HEAD 2>/dev/null)" |
    tee "$OUT/machine.txt"
if "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/machine.txt" 2>&1; then
    echo "install: pip install --no-deps --no-build-isolation --no-index -e . (ok)" | tee -a "$OUT/machine.txt"
else  # no setuptools that builds an editable install: the installed layout, copied, on PYTHONPATH
    mkdir -p "$WORK/site" && cp -r bt_hub "$WORK/site/" && cp -r eval "$WORK/site/bt_hub/eval" &&
        cp -r detection_configs "$WORK/site/bt_hub/detection_configs"
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "install: pip failed (above); a copy of the installed layout on PYTHONPATH" | tee -a "$OUT/machine.txt"
fi
{
    nvidia-smi -L || echo "nvidia-smi: not available"
    "$PY" -c "import sys, torch, torchvision; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| torchvision', torchvision.__version__, '| cuda', torch.version.cuda, '| GPU:',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
    "$PY" -c "import sys; sys.path.insert(0, '$BENCH'); import machine; print('CPU:', machine.cpu())"
    echo "logical CPUs: $(nproc); uptime: $(uptime)"
} 2>&1 | tee -a "$OUT/machine.txt"

# ---------------------------------------------------------------------------- 1. CUDA tests
step "pytest -m gpu" "${BUDGET[0]}" "$OUT/pytest_gpu.txt" \
    "$PY" -m pytest -m gpu -q -p no:cacheprovider

# ---------------------------------------------------------------------------- 2. evaluation throughput
step "evaluation throughput" "${BUDGET[1]}" "$OUT/eval_throughput.txt" \
    "$PY" "$BENCH/eval_throughput.py" --device "$DEVICE" "${EVAL_SIZES[@]}" --out "$WORK/eval_throughput"

# ---------------------------------------------------------------------------- 3. compiled pretraining
step "compiled pretraining" "${BUDGET[2]}" "$OUT/pretrain_compiled.txt" \
    "$PY" "$BENCH/pretrain_throughput.py" --device "$DEVICE" "${PRETRAIN_SIZES[@]}" --compile only \
    --out "$WORK/pretrain_throughput"

# ---------------------------------------------------------------------------- 4. bt-hub eval all
eval_all() {
    "$PY" - "$WORK/data" "$ALL_PX" "$ALL_TRAIN" "$ALL_VAL" "$ALL_ARCH" "$BENCH" <<'EOF' || return
"""A generated ImageFolder (10 classes, train/ and val/ of distinct pictures) and torchvision-default-init weights."""
import sys
from multiprocessing import Pool
from pathlib import Path

import torch
import torchvision

root, px, n_train, n_val, arch, bench = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
sys.path.insert(0, bench)
from pretrain_throughput import _photo

jobs = [(root / "train", i, i) for i in range(n_train)] + [(root / "val", i, n_train + i) for i in range(n_val)]
with Pool(8) as pool:
    pictures = pool.starmap(_photo, [(seed, px, px) for _, _, seed in jobs])
for (split, i, _), picture in zip(jobs, pictures):
    (split / f"class{i % 10}").mkdir(parents=True, exist_ok=True)
    (split / f"class{i % 10}" / f"{i:05d}.jpg").write_bytes(picture)
torch.manual_seed(0)
torch.save(getattr(torchvision.models, arch)().state_dict(), root.parent / f"{arch}_default_init.pth")
print(f"{n_train} + {n_val} JPEGs of {px}x{px} px in {root}, weights: torchvision {arch}() default init")
EOF
    bt_hub export --weights "$WORK/${ALL_ARCH}_default_init.pth" --format safetensors \
        --out "$WORK/${ALL_ARCH}.safetensors" || return
    local tick=$SECONDS
    bt_hub eval all --weights "$WORK/${ALL_ARCH}.safetensors" --data "$WORK/data" --image-size "$ALL_PX" \
        --device "$DEVICE" --num-workers "$ALL_WORKERS" $ALL_EPOCHS --out "$WORK/eval_all" || return
    echo "eval all wall time: $((SECONDS - tick)) s"
    cat "$WORK/eval_all/results.md"
}
export PY WORK DEVICE BENCH ALL_ARCH ALL_PX ALL_TRAIN ALL_VAL ALL_WORKERS ALL_EPOCHS
export -f eval_all bt_hub
step "bt-hub eval all" "${BUDGET[3]}" "$OUT/eval_all.txt" bash -c eval_all

# ---------------------------------------------------------------------------- summary.md
"$PY" - "$OUT" "$WORK/steps" "$DRY" "$((SECONDS - START))" <<'EOF'
"""summary.md: each step's status and seconds, the images/s rows and the ratios issue 28 targets."""
import re
import sys
from pathlib import Path

out, steps, dry, total = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]


def read(name):
    path = out / name
    return path.read_text() if path.exists() else ""


def rates(name):
    """The `<row label>: <rate> images/s (<n> s)` lines the benchmarks print as each row ends."""
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\(\w\).*): ([\d.]+) images/s \(\d+ s\)$", read(name), re.M)}


def pick(rows, prefix, contains=""):
    return next((v for k, v in rows.items() if k.startswith(prefix) and contains in k), None)


def ratio(num, den, target):
    if not num or not den:
        return f"unmeasured | >= {target:g} | —"
    return f"{num / den:.2f} | >= {target:g} | {'yes' if num / den >= target else 'NO'}"


extraction, pretrain = rates("eval_throughput.txt"), rates("pretrain_compiled.txt")
lines = ["# GPU check (issue 28)", ""]
if dry:
    lines += ["**Dry run on the CPU at tiny sizes: the numbers say only that every step ran.**", ""]
keep = ("gpu_check", "GPU ", "python ", "CPU:", "logical", "install:")
lines += [f"    {line}" for line in read("machine.txt").splitlines() if line.startswith(keep)]
lines += ["", f"Total wall time: {total} s.", "", "| step | exit | seconds | timeout |", "|---|---|---|---|"]
for row in steps.read_text().splitlines() if steps.exists() else []:
    name, rc, seconds, budget = row.split("|")
    lines.append(f"| {name} | {rc}{' (timed out)' if rc == '124' else ''} | {seconds} | {budget} |")
tests = [s for s in read("pytest_gpu.txt").splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", s)]
lines += ["", f"pytest -m gpu: {tests[-1] if tests else 'no result line (pytest_gpu.txt)'}", ""]
lines += ["| ratio (one run, one machine) | measured | target | met |", "|---|---|---|---|"]
b = pick(extraction, "(b)")
c4 = pick(extraction, "(c)", " 4 workers") or (pick(extraction, "(c)") if dry else None)
lines.append(f"| extraction (b)/(a) | {ratio(b, pick(extraction, '(a)'), 0.9)} |")
lines.append(f"| extraction (b)/(c at 4 workers) | {ratio(b, c4, 2)} |")
lines.append(f"| compiled pretraining (b)/(a) | {ratio(pick(pretrain, '(b)'), pick(pretrain, '(a)'), 0.95)} |")
lines += ["", "| row | images/s |", "|---|---|"] + [f"| {k} | {v:.1f} |" for k, v in {**extraction, **pretrain}.items()]
wall = re.search(r"^eval all wall time: .*$", read("eval_all.txt"), re.M)
lines += ["", f"bt-hub eval all: {wall[0] if wall else 'did not finish (eval_all.txt)'}"]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
