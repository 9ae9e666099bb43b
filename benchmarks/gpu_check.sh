#!/usr/bin/env bash
# The GPU rows of docs/performance.md in one run of under 9.5 minutes on one H100/H200 (issues 28, 33 and 42):
#
#     bash benchmarks/gpu_check.sh                      # on the GPU machine, from the repository root
#     GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh      # the same steps on the CPU at tiny sizes (~5 min, 2 idle cores;
#                                                       # torch.compile disabled: Inductor would take minutes)
#     GPU_CHECK_PARSE=1 bash benchmarks/gpu_check.sh    # the GPU run's command lines parsed, nothing run (seconds;
#                                                       # tests/test_gpu_scripts.py runs it in the CPU suite)
#     GPU_CHECK_STRETCH=1 bash benchmarks/gpu_check.sh  # the stretch row (8.) alone: it does not fit beside the rest
#
# Installs bt_hub from this tree without network, and nvImageCodec from the wheels brought along in
# benchmarks/wheels/ (git-ignored; the GPU machine has no network: fetch them beforehand, on any machine, with
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#         --platform manylinux2014_x86_64 -d benchmarks/wheels nvidia-nvimgcodec-cu13==0.9.0.20 nvidia-nvjpeg==13.3.2.43
# , 29 MB, and carry the folder to the GPU machine; they are installed with pip install --no-index --no-deps
# --target into a temporary folder put on PYTHONPATH; without them the (n) row is skipped and --decode auto times
# torchvision alone), then runs, each step under its own `timeout` (and all of them under GPU_CHECK_SECONDS, 560
# by default: a step that would start after it is skipped) and going on when one fails or runs out of time, in
# the order of what is least known:
#   1. pytest -m gpu (the CUDA tests)                                               -> pytest_gpu.txt
#   2. evaluation throughput, ResNet-50, 224 px, 500x375 JPEGs: (a) model-only ceiling, (b) bt_hub from files
#      (--decode auto: the faster device decoder, the workers decoding their measured share of each batch),
#      (t) the same decoded by torchvision's nvJPEG alone, (n) by nvImageCodec alone, (p) (b)'s phases, (s) bt_hub
#      from the decoded store, (c) ImageFolder + PIL in 4 and in 16 workers          -> eval_throughput.txt
#   3. the same for small images: ResNet-18 small stem, 32 px, 28-px grey PNGs: (a), (b), (s) -> eval_small.txt
#   4. pretraining on 28-px grey PNGs, ResNet-18 small stem, 32 px: (a) ceiling, (b) bt_hub from a store in GPU
#      memory (--store device), (f) with --store off (workers decode every epoch); the profiler's top rows of
#      (b) and (f) over the steps after the timed ones                            -> pretrain_small.txt
#   5. compiled pretraining, batch 256: (a) compiled ceiling, (b) bt_hub --compile, and (b)'s profiler rows
#                                                                                   -> pretrain_compiled.txt
#   6. a learning curve: a folder of 60,000 + 10,000 28-px grey PNGs, a short pretraining run keeping 10 steps,
#      then `bt-hub eval compare --over-steps` (kNN + linear, pixels and random-init baselines), timed, with
#      its seconds per cell                                                         -> curve.txt
#   7. `bt-hub eval all --device cuda` on a generated 224-px ImageFolder (train/, val/) with a
#      torchvision-default-init ResNet-50 exported by `bt-hub export`, timed            -> eval_all.txt
#   8. the stretch row, only with GPU_CHECK_STRETCH=1 (then alone; ~8-9 min estimated on an H200, so not beside
#      1-7) and in the dry and parse runs: 100 epochs (--preset cifar) of 60,000 28-px grey PNGs keeping 10 steps,
#      then their curve as in 6.; target: both within 600 s                             -> stretch.txt
# and writes machine.txt (GPU, torch, CPU model and flags, the install's log) and summary.md (each
# step's exit status and seconds; the ratios the issues target). Everything goes to $OUT (default
# ./gpu_check_out): files only, no folders. PYTHON picks the interpreter (default python3).
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

PARSE=${GPU_CHECK_PARSE:-0}
STRETCH=${GPU_CHECK_STRETCH:-0}
DEADLINE=${GPU_CHECK_SECONDS:-560}
if [[ "$DRY" == 1 ]]; then
    DEVICE=cpu
    EVAL_SIZES=(--arch resnet18 --small-image-stem --image-size 32 --jpeg-size 64x48 --batch-size 16 --steps 2
        --warmup 1 --workers 1 --reference-workers 1 2)
    SMALL_EVAL=(--arch resnet18 --small-image-stem --image-size 32 --format png --jpeg-size 28x28 --batch-size 32
        --steps 2 --warmup 1 --workers 1)
    SMALL_PRETRAIN=(--arch resnet18 --small-image-stem --image-size 32 --format png --jpeg-size 28x28
        --projector 64-64 --batch-size 16 --warmup 1 --steps 2 --workers 1 --profile 1)
    PRETRAIN_SIZES=(--arch resnet18 --image-size 32 --projector 64-64 --batch-size 8 --warmup 1 --steps 2
        --jpeg-size 64x48 --workers 1 --profile 1)
    CURVE_TRAIN=300 CURVE_VAL=60
    CURVE_PRETRAIN="--warmup-epochs 1 --batch-size 32 --projector 64-64 --max-steps 10 --keep-every 1"
    CURVE_WORKERS=1
    STRETCH_TRAIN=200 STRETCH_VAL=40 STRETCH_BUDGET=120
    STRETCH_PRETRAIN="--batch-size 32 --projector 64-64 --epochs 1 --warmup-epochs 0 --keep-every 3"
    PROFILED=40  # seconds rows 4 and 5 get beside their BUDGET: the steps they profile after the timed ones
    ALL_ARCH=resnet18 ALL_PX=32 ALL_TRAIN=60 ALL_VAL=20 ALL_WORKERS=1 ALL_EPOCHS="--linear.epochs 10 --semi.epochs 1"
    BUDGET=(60 90 40 60 60 150 90)
    export TORCH_COMPILE_DISABLE=1  # Inductor's C++ build of ResNet-18 alone outlasts the dry run on 2 cores
else
    DEVICE=cuda
    EVAL_SIZES=(--arch resnet50 --image-size 224 --jpeg-size 500x375 --batch-size 256 --steps 20 --warmup 2
        --workers 16 --reference-workers 4 16)
    SMALL_EVAL=(--arch resnet18 --small-image-stem --image-size 32 --format png --jpeg-size 28x28 --batch-size 1024
        --steps 20 --warmup 2 --workers 14)
    SMALL_PRETRAIN=(--arch resnet18 --small-image-stem --image-size 32 --format png --jpeg-size 28x28
        --projector 2048-2048-2048 --batch-size 512 --warmup 10 --steps 40 --workers 14 --profile 6)
    PRETRAIN_SIZES=(--arch resnet50 --image-size 224 --projector 8192-8192-8192 --batch-size 256 --warmup 3
        --steps 12 --jpeg-size 500x375 --workers 16 --profile 6)
    CURVE_TRAIN=60000 CURVE_VAL=10000
    CURVE_PRETRAIN="--warmup-epochs 1 --batch-size 512 --max-steps 50 --keep-every 5"
    CURVE_WORKERS=14
    # 100 epochs of the cifar preset (batch 256): 23,400 steps, kept every 2,340
    STRETCH_TRAIN=60000 STRETCH_VAL=10000 STRETCH_PRETRAIN="--epochs 100 --keep-every 2340" STRETCH_BUDGET=560
    PROFILED=15  # ~10 s of profiled steps, and row 5's 2 more timed steps
    # eval all: the paper presets, one label fraction, fine-tuning's 800-step floor at batch 64
    ALL_ARCH=resnet50 ALL_PX=224 ALL_TRAIN=500 ALL_VAL=100 ALL_WORKERS=8 ALL_EPOCHS="--fractions 10 --semi.batch-size 64"
    BUDGET=(120 100 45 70 200 120 60)  # H200: the CUDA tests outgrew 70 s; compiles 108 + 71 s; eval all 18 s
fi
if [[ "$PARSE" == 1 ]]; then
    export BT_HUB_PARSE_ONLY=1  # bt-hub and the benchmark scripts parse their command lines and stop
fi

# step NAME SECONDS LOG COMMAND...: run COMMAND under `timeout`, its output to the screen and LOG;
# the exit status (124: out of time) and seconds go to $WORK/steps for summary.md.
step() {
    local name=$1 budget=$2 log=$3
    shift 3
    [[ "$STRETCH" == 1 && "$name" != stretch* ]] && return  # GPU_CHECK_STRETCH=1: the stretch row alone
    local tick=$SECONDS left=$((DEADLINE - (SECONDS - START)))
    if ((left < 20)); then
        echo "== $name: skipped (GPU_CHECK_SECONDS=$DEADLINE spent)" | tee -a "$log"
        echo "$name|skipped|0|$budget" >>"$WORK/steps"
        return
    fi
    ((budget > left)) && budget=$left
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
if [[ "$PARSE" == 1 ]]; then
    echo "install: skipped in a parse check (the bt_hub this interpreter imports)" | tee -a "$OUT/machine.txt"
elif "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$OUT/machine.txt" 2>&1; then
    echo "install: pip install --no-deps --no-build-isolation --no-index -e . (ok)" | tee -a "$OUT/machine.txt"
else  # no setuptools that builds an editable install: the installed layout, copied, on PYTHONPATH
    mkdir -p "$WORK/site" && cp -r bt_hub "$WORK/site/" && cp -r eval "$WORK/site/bt_hub/eval" &&
        cp -r detection_configs "$WORK/site/bt_hub/detection_configs"
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "install: pip failed (above); a copy of the installed layout on PYTHONPATH" | tee -a "$OUT/machine.txt"
fi
WHEELS=("$BENCH"/wheels/*.whl)
if [[ "$PARSE" == 1 || ! -e "${WHEELS[0]}" ]]; then
    echo "nvImageCodec wheels: none in benchmarks/wheels (or a parse check); this Python's own, if any" |
        tee -a "$OUT/machine.txt"
elif "$PY" -m pip install -q --no-index --no-deps --target "$WORK/wheels" "${WHEELS[@]}" >>"$OUT/machine.txt" 2>&1; then
    export PYTHONPATH="$WORK/wheels${PYTHONPATH:+:$PYTHONPATH}"
    echo "nvImageCodec wheels: ${WHEELS[*]##*/} installed (--target, on PYTHONPATH)" | tee -a "$OUT/machine.txt"
else
    echo "nvImageCodec wheels: pip failed (above); this Python's own, if any" | tee -a "$OUT/machine.txt"
fi
{
    nvidia-smi -L || echo "nvidia-smi: not available"
    "$PY" -c "import sys, torch, torchvision; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| torchvision', torchvision.__version__, '| cuda', torch.version.cuda, '| GPU:',
torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
    "$PY" -c "import sys; sys.path.insert(0, '$BENCH'); import machine; print('CPU:', machine.cpu())"
    "$PY" -c "from bt_hub.data.decode import nvimgcodec; print('nvImageCodec', nvimgcodec().__version__)" 2>&1 |
        tail -1
    echo "logical CPUs: $(nproc); uptime: $(uptime)"
} 2>&1 | tee -a "$OUT/machine.txt"

# ---------------------------------------------------------------------------- 1. CUDA tests
if [[ "$PARSE" == 1 ]]; then
    echo "pytest -m gpu: not run in a parse check (tests/test_gpu_scripts.py parses the CUDA tests' command lines)"
else  # -o addopts=: in this process, without pyproject's -n 2 (pytest-xdist is not installed here; one GPU)
    step "pytest -m gpu" "${BUDGET[0]}" "$OUT/pytest_gpu.txt" "$PY" -m pytest -o addopts= -m gpu -q -p no:cacheprovider
fi

# ---------------------------------------------------------------------------- 2. evaluation throughput
step "evaluation throughput" "${BUDGET[1]}" "$OUT/eval_throughput.txt" \
    "$PY" "$BENCH/eval_throughput.py" --device "$DEVICE" "${EVAL_SIZES[@]}" --rows pabtnsc --out "$WORK/eval_throughput"

# ---------------------------------------------------------------------------- 3. small-image extraction
step "small-image extraction" "${BUDGET[2]}" "$OUT/eval_small.txt" \
    "$PY" "$BENCH/eval_throughput.py" --device "$DEVICE" "${SMALL_EVAL[@]}" --rows abs --out "$WORK/eval_small"

# ---------------------------------------------------------------------------- 4. small-image pretraining
step "small-image pretraining" "$((BUDGET[3] + PROFILED))" "$OUT/pretrain_small.txt" \
    "$PY" "$BENCH/pretrain_throughput.py" --device "$DEVICE" "${SMALL_PRETRAIN[@]}" --rows abf --store device \
    --out "$WORK/pretrain_small"

# ---------------------------------------------------------------------------- 5. compiled pretraining
step "compiled pretraining" "$((BUDGET[4] + PROFILED))" "$OUT/pretrain_compiled.txt" \
    "$PY" "$BENCH/pretrain_throughput.py" --device "$DEVICE" "${PRETRAIN_SIZES[@]}" --compile only \
    --out "$WORK/pretrain_throughput"

# ---------------------------------------------------------------------------- 6. and 8. learning curves
# curve NAME TRAIN VAL FLAGS: TRAIN + VAL 28-px grey PNGs, `bt-hub pretrain --preset cifar FLAGS` on train/ keeping
# its steps, then `eval compare --over-steps` of them against pixels and random-init (kNN + linear), each timed
curve() {
    local dir=$WORK/$1 tick=$SECONDS start=$SECONDS
    if [[ "$PARSE" != 1 ]]; then
        "$PY" - "$dir/data" "$2" "$3" "$BENCH" <<'EOF' || return
"""train/ and val/ of distinct 28-px grey PNGs in 10 classes (pretrain_throughput.py's pictures)."""
import sys
from multiprocessing import Pool
from pathlib import Path

root, n_train, n_val, bench = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, bench)
from pretrain_throughput import _photo

with Pool(16) as pool:
    pictures = pool.starmap(_photo, [(seed, 28, 28, "png") for seed in range(n_train + n_val)], chunksize=500)
for i, picture in enumerate(pictures):
    folder = root / ("train" if i < n_train else "val") / f"class{i % 10}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{i:06d}.png").write_bytes(picture)
print(f"{n_train} + {n_val} grey 28-px PNGs in {root}")
EOF
    fi
    echo "data: $((SECONDS - tick)) s"
    tick=$SECONDS
    # shellcheck disable=SC2086  # $4 holds several flags
    bt_hub pretrain --data "$dir/data/train" --preset cifar $4 --num-workers "$CURVE_WORKERS" --device "$DEVICE" \
        --out "$dir/run" || return
    echo "pretraining wall time (the store made, then the steps): $((SECONDS - tick)) s"
    tick=$SECONDS
    bt_hub eval compare --weights "$dir/run" --over-steps --data "$dir/data" --image-size 32 \
        --protocols knn linear --baselines pixels random-init --seeds 1 --num-workers "$CURVE_WORKERS" --device "$DEVICE" \
        --out "$dir/curve" || return
    echo "eval compare --over-steps wall time: $((SECONDS - tick)) s"
    [[ "$PARSE" == 1 ]] && return
    "$PY" - "$dir/curve/results.jsonl" "$((SECONDS - tick))" <<'EOF'
"""The curve's seconds per cell, and its records' wall_time_s summed by column (with the features each extracted:
the first kNN cell its row's, the linear column, scored together at its first cell, every other row's)."""
import json
import sys
from collections import Counter

records = [json.loads(line) for line in open(sys.argv[1])]
columns = Counter()
for record in records:
    columns[record["notes"]["compare"]["column"]] += record["wall_time_s"]
spent = ", ".join(f"{column} {seconds:.1f} s" for column, seconds in columns.items())
print(f"seconds per cell: {int(sys.argv[2]) / len(records):.2f} ({len(records)} cells; by column: {spent})")
EOF
    echo "curve wall time (data, pretraining and compare): $((SECONDS - start)) s"
    cat "$dir/curve/compare.md"
}

# ---------------------------------------------------------------------------- 7. bt-hub eval all
eval_all() {
    if [[ "$PARSE" != 1 ]]; then
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
    fi
    bt_hub export --weights "$WORK/${ALL_ARCH}_default_init.pth" --format safetensors \
        --out "$WORK/${ALL_ARCH}.safetensors" || return
    local tick=$SECONDS
    # shellcheck disable=SC2086  # ALL_EPOCHS holds several flags
    bt_hub eval all --weights "$WORK/${ALL_ARCH}.safetensors" --data "$WORK/data" --image-size "$ALL_PX" \
        --device "$DEVICE" --num-workers "$ALL_WORKERS" $ALL_EPOCHS --out "$WORK/eval_all" || return
    echo "eval all wall time: $((SECONDS - tick)) s"
    [[ "$PARSE" == 1 ]] || cat "$WORK/eval_all/results.md"
}
export PY WORK DEVICE BENCH PARSE CURVE_WORKERS ALL_ARCH ALL_PX ALL_TRAIN ALL_VAL ALL_WORKERS ALL_EPOCHS
export -f curve eval_all bt_hub
step "learning curve" "${BUDGET[5]}" "$OUT/curve.txt" \
    bash -c 'curve curve "$@"' - "$CURVE_TRAIN" "$CURVE_VAL" "$CURVE_PRETRAIN"
step "bt-hub eval all" "${BUDGET[6]}" "$OUT/eval_all.txt" bash -c eval_all
if [[ "$STRETCH" == 1 || "$DRY" == 1 || "$PARSE" == 1 ]]; then
    step "stretch: 100 epochs and their curve" "$STRETCH_BUDGET" "$OUT/stretch.txt" \
        bash -c 'curve stretch "$@"' - "$STRETCH_TRAIN" "$STRETCH_VAL" "$STRETCH_PRETRAIN"
fi

# ---------------------------------------------------------------------------- summary.md
"$PY" - "$OUT" "$WORK/steps" "$DRY" "$((SECONDS - START))" <<'EOF'
"""summary.md: each step's status and seconds, the images/s rows, the ratios issues 28, 33 and 42 target, the curves'
seconds and the profiler's busy time."""
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
small_eval, small_pretrain = rates("eval_small.txt"), rates("pretrain_small.txt")
lines = ["# GPU check (issues 28, 33 and 42)", ""]
if dry:
    lines += ["**Dry run on the CPU at tiny sizes: the numbers say only that every step ran.**", ""]
keep = ("gpu_check", "GPU ", "python ", "CPU:", "logical", "install:", "nvImageCodec")
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
lines.append(f"| 224-px JPEG extraction (b, --decode auto)/(a) | {ratio(b, pick(extraction, '(a)'), 0.5)} |")
for row, name in (("(t)", "torchvision"), ("(n)", "nvimgcodec")):
    lines.append(f"| 224-px JPEG extraction ({row[1]}, {name} alone)/(a) | {ratio(pick(extraction, row), pick(extraction, '(a)'), 0.5)} |")
lines.append(f"| 224-px JPEG extraction from the store (s)/(a) | {ratio(pick(extraction, '(s)'), pick(extraction, '(a)'), 0.9)} |")
lines.append(f"| 224-px JPEG extraction (b)/(c at 4 workers) | {ratio(b, c4, 2)} |")
lines.append(f"| small-image extraction (b)/(a) | {ratio(pick(small_eval, '(b)'), pick(small_eval, '(a)'), 0.9)} |")
lines.append(f"| small-image extraction (s)/(a) | {ratio(pick(small_eval, '(s)'), pick(small_eval, '(a)'), 0.9)} |")
small = {key: pick(small_pretrain, key) for key in ("(a)", "(b)", "(f)")}
lines.append(f"| small-image pretraining, store in GPU memory (b)/(a) | {ratio(small['(b)'], small['(a)'], 0.9)} |")
lines.append(f"| small-image pretraining, workers decoding (f)/(a) | {ratio(small['(f)'], small['(a)'], 0.9)} |")
lines.append(f"| the store against the workers (b)/(f): below 1, it leaves pretraining | {ratio(small['(b)'], small['(f)'], 1)} |")
lines.append(f"| compiled pretraining (b)/(a) | {ratio(pick(pretrain, '(b)'), pick(pretrain, '(a)'), 0.95)} |")
every = {**extraction, **{f"{k} [small]": v for k, v in {**small_eval, **small_pretrain}.items()}, **pretrain}
lines += ["", "| row | images/s |", "|---|---|"] + [f"| {k} | {v:.1f} |" for k, v in every.items()]
curves = (("learning curve", "curve.txt", 60, "its compare"), ("stretch, 100 epochs", "stretch.txt", 600, "the whole row"))
for name, log, target, what in curves:
    compare = re.search(r"^eval compare --over-steps wall time: (\d+) s$", read(log), re.M)
    whole = re.search(r"^curve wall time \(data, pretraining and compare\): (\d+) s$", read(log), re.M)
    took = compare if target == 60 else whole
    verdict = f"{took[1]} s, target {what} <= {target} s: {'met' if int(took[1]) <= target else 'NOT met'}" if took else ""
    found = re.findall(r"^(?:data|pretraining|eval compare|seconds per cell|curve wall time).*$", read(log), re.M)
    lines.append(f"{name}: {verdict + '; ' if verdict else ''}{'; '.join(found) if found else 'did not finish or run'}")
found = re.findall(r"^eval all wall time: .*$", read("eval_all.txt"), re.M)
lines.append(f"bt-hub eval all: {'; '.join(found) if found else 'did not finish'}")
for log in ("pretrain_small.txt", "pretrain_compiled.txt"):  # what the profiler says is left
    lines += [f"{log}: {line}" for line in re.findall(r"^profile of .*$", read(log), re.M)]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
