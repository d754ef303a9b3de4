#!/usr/bin/env bash
# The GPU protocol: everything this project measures on one NVIDIA GPU, without Ray, in under
# 9 minutes, run from the repository root of a checkout (the engine from the checkout itself):
#
#   bash benchmarks/gpu_suite.sh              # -> benchmarks/results/gpu_{oracle,fp8_loss,profile,suite}.json, gpu.json
#   bash benchmarks/gpu_suite.sh --dry-run    # print what it would run, run nothing
#   bash benchmarks/gpu_suite.sh --cpu DIR    # the same scripts in their CPU modes, tiny, results in DIR
#
# 1. benchmarks/gpu_oracle.py: the engine on the GPU against the CPU reference loop (fp32 cases
#    to 1e-4, bf16 and FP8 losses within their bounds); the FP8 cases are left out, and said, where
#    torchao is not installed.
# 2. benchmarks/bench_gpu.py: the engine in bf16 eager and compiled and in FP8 compiled against a plain PyTorch
#    loop on the 0.77B and 8B-layer shapes (results/gpu.json; FP8 where the GPU and torchao allow).
# 3. benchmarks/bench_gpu.py --fp8-loss-steps 200: FP8 rowwise against bf16, both compiled, 200 steps
#    on the shipped corpus (results/gpu_fp8_loss.json; the goal: last losses within 1 %).
# 4. benchmarks/gpu_profile.py: run.profile_steps on the GPU (trace, memory snapshot, top kernels).
#
# Each part has its own time limit (GPU_SUITE_LIMITS="oracle bench fp8_loss profile" seconds, 150 265 80 45 by
# default); a part that fails or runs out of time is recorded and the next one still runs.
# benchmarks/results/gpu_suite.json records each part's exit status and seconds. Python: $PYTHON
# (default python3), which needs torch and transformers; Ray is not used.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
read -r LIMIT_ORACLE LIMIT_BENCH LIMIT_FP8_LOSS LIMIT_PROFILE EXTRA <<<"${GPU_SUITE_LIMITS:-150 265 80 45}"
for limit in "$LIMIT_ORACLE" "$LIMIT_BENCH" "$LIMIT_FP8_LOSS" "$LIMIT_PROFILE"; do
    [[ $limit =~ ^[0-9]+$ && -z $EXTRA ]] || {
        echo "gpu_suite: GPU_SUITE_LIMITS takes four whole seconds (oracle bench fp8_loss profile), e.g. \"150 265 80 45\"; got \"${GPU_SUITE_LIMITS:-}\"" >&2
        exit 2
    }
done

MODE=gpu
OUT=benchmarks/results
# bench_gpu.py's engine cases here: bf16 eager and compiled, FP8 compiled (rowwise, tensorwise). Its
# others (selective checkpointing, FP8 eager) run without --variants; their compiles would take
# the suite past its minutes.
SUITE_VARIANTS=engine_eager,engine_compiled,engine_compiled_fp8,engine_compiled_fp8_tensorwise
case "${1:-}" in
"") ;;
--dry-run) MODE=dry ;;
--cpu)
    MODE=cpu
    OUT=${2:?"--cpu needs a directory for its results"}
    ;;
*)
    echo "usage: bash benchmarks/gpu_suite.sh [--dry-run | --cpu DIR]" >&2
    exit 2
    ;;
esac
mkdir -p "$OUT"

if [ "$MODE" = gpu ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_suite: no CUDA device for $PY (--cpu DIR runs the scripts' CPU modes)" >&2
    exit 2
fi

# The oracle's cases: all of them, less FP8 where this machine runs none (no torchao, or a GPU
# below compute capability 8.9), and said.
IFS=$'\t' read -r CASES FP8_NOTE < <("$PY" - <<'EOF'
import sys
import torch
sys.path.insert(0, "benchmarks")
import bench_gpu, gpu_oracle
why = bench_gpu.fp8_skipped(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
cases = [c for c in gpu_oracle.CASES if not why or "fp8" not in c]
print(",".join(cases), f"no FP8 case ran: {why}" if why else "", sep="\t")
EOF
)
[ -n "$CASES" ] || { echo "gpu_suite: $PY could not read the oracle's cases (torch, transformers?)" >&2; exit 2; }
if [ "$MODE" = cpu ]; then
    CASES=llama-fp32 # the FP8 plumbing runs emulated in bench_gpu.py's smoke (compiling it here takes minutes)
    ORACLE=("$PY" benchmarks/gpu_oracle.py --cpu --cases "$CASES" --out "$OUT/gpu_oracle.json")
    BENCH=("$PY" benchmarks/bench_gpu.py --smoke --out "$OUT/gpu.json")
    FP8_LOSS=("$PY" benchmarks/bench_gpu.py --smoke --fp8-loss-steps 12 --out "$OUT/gpu_fp8_loss.json")
    PROFILE=("$PY" benchmarks/gpu_profile.py --cpu --out "$OUT/gpu_profile.json")
else
    ORACLE=("$PY" benchmarks/gpu_oracle.py --cases "$CASES" --out "$OUT/gpu_oracle.json")
    BENCH=("$PY" benchmarks/bench_gpu.py --steps 12 --warmup 4 --variants "$SUITE_VARIANTS" --out "$OUT/gpu.json")
    FP8_LOSS=("$PY" benchmarks/bench_gpu.py --fp8-loss-steps 200 --out "$OUT/gpu_fp8_loss.json")
    PROFILE=("$PY" benchmarks/gpu_profile.py --out "$OUT/gpu_profile.json")
fi

PARTS=()
run_part() { # name limit command...
    local name=$1 limit=$2 start rc
    shift 2
    if [ "$MODE" = dry ]; then
        echo "$name (limit ${limit}s): $*"
        return
    fi
    echo "== $name: $*" >&2
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    PARTS+=("$name $rc $(($(date +%s) - start)) $limit")
}

SUITE_START=$(date +%s)
run_part oracle "$LIMIT_ORACLE" "${ORACLE[@]}"
run_part bench "$LIMIT_BENCH" "${BENCH[@]}"
[ -n "$FP8_NOTE" ] || run_part fp8_loss "$LIMIT_FP8_LOSS" "${FP8_LOSS[@]}"
run_part profile "$LIMIT_PROFILE" "${PROFILE[@]}"
[ "$MODE" = dry ] && exit 0

"$PY" - "$OUT/gpu_suite.json" "$(($(date +%s) - SUITE_START))" "$FP8_NOTE" "$MODE" "${GPU_SUITE_LIMITS:-}" "${PARTS[@]}" <<'EOF'
import json, sys, time

import torch

path, total, fp8_note, mode, limits, *parts = sys.argv[1:]
rows = {}
for part in parts:
    name, rc, seconds, limit = part.split()
    rows[name] = {"exit": int(rc), "seconds": int(seconds), "limit_s": int(limit), "timed_out": rc in ("124", "137")}
record = {
    "command": "cd <repo> && "
    + (f'GPU_SUITE_LIMITS="{limits}" ' if limits else "")
    + "bash benchmarks/gpu_suite.sh"
    + (" --cpu DIR" if mode == "cpu" else ""),
    "date": time.strftime("%Y-%m-%d"),
    "device": torch.cuda.get_device_name(0) if mode == "gpu" else "cpu",
    "torch": torch.__version__,
    "seconds": int(total),
    "parts": rows,
    "fp8_not_run": fp8_note or None,
    "ok": all(r["exit"] == 0 for r in rows.values()),
}
open(path, "w").write(json.dumps(record, indent=2) + "\n")
print(json.dumps(record))
sys.exit(0 if record["ok"] else 1)
EOF
