#!/usr/bin/env bash
# The GPU check: trains small reference models with a CUDA (or HIP) build of
# train_gpt and compares each loss curve with the same run on the CPU, then
# runs the device-built test programs that are present. One short script, so
# that a borrowed GPU machine is used for minutes, not hours.
#
#   scripts/gpu_check.sh baselines --bin CPU_BUILD/examples --out DIR
#       on a CPU build: writes DIR/<case>.cpu.json, the loss curves to compare
#       with (tests/gpu/baselines holds them for the cases below)
#   scripts/gpu_check.sh run --bin GPU_BUILD/examples --baselines DIR --out DIR [--tests "DIR/test_ops ..."]
#       on the GPU machine: runs every case against its baseline, then the tests
#   scripts/gpu_check.sh run --cpu ...
#       the same comparison on a CPU build, one-process cases only, no device
#       needed: proves the stored baselines are still the CPU's curves
#
# Exit status: 0 every case followed its baseline and every test passed;
# 1 something failed (the summary says what); 77 no GPU was found (skipped).
# Parity: step 0 within WEFT_GPU_FIRST_TOL (1e-5) relative, every step within
# WEFT_GPU_TOL (1e-4): float sums in another order drift slowly; a real bug
# shows at step 0 by orders of magnitude. The multi-rank cases (fsdp, tp with
# sequence parallelism, a 1F1B pipeline, ring context parallelism and expert
# parallelism, two ranks on one GPU, device views staged through MPI) run
# when mpirun is on PATH.
set -uo pipefail

mode="${1:-}"
[[ "$mode" == baselines || "$mode" == run ]] || { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2; }
shift
bin="" base="" out="" tests="" cpu=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --baselines) base="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --tests) tests="$2"; shift 2 ;;
    --cpu) cpu=1; shift ;;
    *) echo "gpu_check.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ -x "$bin/train_gpt" ]] || { echo "gpu_check.sh: --bin '$bin' holds no train_gpt" >&2; exit 2; }
[[ -n "$out" ]] || { echo "gpu_check.sh: --out DIR is required" >&2; exit 2; }
mkdir -p "$out"

# The cases: a name, the ranks, and train_gpt's flags. The model is tiny and
# the runs short: the point is each kernel's arithmetic on the device, not speed.
common="--steps 8 --layers 2 --d-model 64 --heads 4 --seq 32 --batch 8 --seed 7 --lr 2e-3"
cases=(
  "gpt 1 $common"
  "llama 1 $common --norm rmsnorm --mlp swiglu --pos rotary --kv-heads 2"
  "recompute 1 $common --recompute"
  "moe 1 $common --experts 4 --top-k 2 --dropless"
  "sgd 1 $common --optimizer sgd --clip 0"
  "gpt.fsdp 2 $common --mesh dp=2 --dp fsdp"
  "gpt.tp 2 $common --mesh tp=2 --sequence-parallel"
  "gpt.pp 2 $common --mesh pp=2 --schedule 1f1b --microbatches 2"
  "gpt.cp 2 $common --mesh cp=2 --context ring"
  "moe.ep 2 $common --experts 4 --top-k 2 --dropless --mesh ep=2"
)
# Serving: greedy generation of the same requests; every token must match the CPU's.
serve_flags="--layers 2 --d-model 64 --heads 4 --seq 64 --seed 7 --requests 16 --concurrency 4 --prompt-len 4-24 --output-len 4-24"
# A multi-rank case, model.layout, follows the one-process curve of its model.
baseline_of() { echo "${1%%.*}"; }

if [[ "$mode" == baselines ]]; then
  status=0
  for c in "${cases[@]}"; do
    read -r name ranks flags <<< "$c"
    [[ "$ranks" == 1 ]] || continue
    echo "gpu_check: baseline $name: train_gpt $flags"
    if ! "$bin/train_gpt" $flags --record "$out/$name.full.json" > "$out/$name.cpu.log" 2>&1; then
      status=1; tail -5 "$out/$name.cpu.log"; continue
    fi
    # Only the curve, and what made it, is kept.
    python3 - "$out/$name.full.json" "$out/$name.cpu.json" "train_gpt $flags" << 'PY'
import json, sys
r = json.load(open(sys.argv[1]))
keep = {"command": sys.argv[3], "loss": r["loss"]}
for k in ("commit", "git_commit", "kokkos", "compiler"):
    if k in r: keep[k] = r[k]
json.dump(keep, open(sys.argv[2], "w"), indent=1)
PY
    rm -f "$out/$name.full.json" "$out/$name.cpu.log"
  done
  if [[ -x "$bin/serve_gpt" ]]; then
    echo "gpu_check: baseline serve: serve_gpt $serve_flags"
    if "$bin/serve_gpt" $serve_flags --record "$out/serve.full.json" > "$out/serve.cpu.log" 2>&1; then
      python3 - "$out/serve.full.json" "$out/serve.cpu.json" "serve_gpt $serve_flags" << 'PY'
import json, sys
r = json.load(open(sys.argv[1]))
json.dump({"command": sys.argv[3], "outputs": r["outputs"]}, open(sys.argv[2], "w"), indent=None)
PY
      rm -f "$out/serve.full.json" "$out/serve.cpu.log"
    else
      status=1; tail -5 "$out/serve.cpu.log"
    fi
  fi
  exit $status
fi

[[ -d "$base" ]] || { echo "gpu_check.sh: --baselines '$base' is not a folder" >&2; exit 2; }
if [[ $cpu == 0 ]]; then
  if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > "$out/devices.txt" 2>&1; then
    echo "gpu_check: no GPU found (nvidia-smi); skipped"
    exit 77
  fi
  cat "$out/devices.txt"
fi
first_tol="${WEFT_GPU_FIRST_TOL:-1e-5}" tol="${WEFT_GPU_TOL:-1e-4}" limit="${WEFT_GPU_CASE_SECONDS:-120}"

# A crash gets a backtrace: the same command again under cuda-gdb, when there.
backtrace() {
  local log="$1"; shift
  command -v cuda-gdb > /dev/null || return 0
  echo "--- backtrace (cuda-gdb) ---" >> "$log"
  timeout "${WEFT_GPU_BT_SECONDS:-60}" cuda-gdb -batch -ex run -ex bt -ex 'info cuda kernels' --args "$@" >> "$log" 2>&1 || true
}

summary=() failed=0
for c in "${cases[@]}"; do
  read -r name ranks flags <<< "$c"
  ref="$base/$(baseline_of "$name").cpu.json"
  log="$out/$name.gpu.log"
  if [[ "$ranks" == 1 ]]; then
    cmd=("$bin/train_gpt" $flags --record "$out/$name.gpu.json")
  elif [[ $cpu == 1 ]]; then
    continue
  elif command -v mpirun > /dev/null; then
    cmd=(mpirun --allow-run-as-root --oversubscribe -n "$ranks" "$bin/train_gpt" $flags --record "$out/$name.gpu.json")
  else
    summary+=("$(printf '%-10s skipped (no mpirun)' "$name")"); continue
  fi
  t0=$(date +%s.%N)
  timeout "$limit" "${cmd[@]}" > "$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  secs=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
  if [[ $rc -ne 0 ]]; then
    failed=1
    summary+=("$(printf '%-10s FAILED (exit %d after %s s): %s' "$name" "$rc" "$secs" "$(grep -m1 -iE 'error|abort|fault|what\(\)' "$log" | cut -c1-160)")")
    [[ $rc -ge 128 && "$ranks" == 1 ]] && backtrace "$log" "${cmd[@]}"
    continue
  fi
  line=$(python3 - "$ref" "$out/$name.gpu.json" "$first_tol" "$tol" << 'PY'
import json, sys
ref = json.load(open(sys.argv[1]))["loss"]
got = json.load(open(sys.argv[2]))["loss"]
first_tol, tol = float(sys.argv[3]), float(sys.argv[4])
n = min(len(ref), len(got))
rel = [abs(g - r) / max(abs(r), 1e-30) for g, r in zip(got[:n], ref[:n])]
worst = max(range(n), key=lambda s: rel[s])
ok = n == len(ref) and rel[0] <= first_tol and all(x <= tol for x in rel)
print(("ok" if ok else "FAILED"),
      f"steps {n}: step 0 loss {got[0]:.7f} vs cpu {ref[0]:.7f} (rel {rel[0]:.2e});",
      f"worst step {worst} rel {rel[worst]:.2e}; last loss {got[n-1]:.5f} vs {ref[n-1]:.5f}")
PY
)
  [[ "$line" == ok* ]] || failed=1
  summary+=("$(printf '%-10s %s (%s s)' "$name" "$line" "$secs")")
done

if [[ -x "$bin/serve_gpt" ]]; then
  log="$out/serve.gpu.log"
  timeout "$limit" "$bin/serve_gpt" $serve_flags --record "$out/serve.gpu.json" > "$log" 2>&1
  rc=$?
  if [[ $rc -ne 0 ]]; then
    failed=1
    summary+=("$(printf '%-10s FAILED (exit %d): %s' serve "$rc" "$(grep -m1 -iE 'error|abort|fault|what\(\)' "$log" | cut -c1-160)")")
    [[ $rc -ge 128 ]] && backtrace "$log" "$bin/serve_gpt" $serve_flags
  elif [[ ! -f "$base/serve.cpu.json" ]]; then
    failed=1
    summary+=("$(printf '%-10s ran, but %s is missing: nothing to compare with' serve "$base/serve.cpu.json")")
  else
    line=$(python3 - "$base/serve.cpu.json" "$out/serve.gpu.json" << 'PY'
import json, sys
ref = json.load(open(sys.argv[1]))["outputs"]
got = json.load(open(sys.argv[2]))["outputs"]
same = sum(1 for a, b in zip(ref, got) if a == b)
tokens = sum(len(a) for a in ref)
print("ok" if same == len(ref) == len(got) else "FAILED",
      f"greedy tokens: {same} of {len(ref)} requests identical to the cpu's ({tokens} tokens)")
PY
)
    [[ "$line" == ok* ]] || failed=1
    summary+=("$(printf '%-10s %s' serve "$line")")
  fi
fi

for path in $tests; do
  t="$(basename "$path")"
  [[ -x "$path" ]] || { summary+=("$(printf '%-10s not built' "$t")"); continue; }
  log="$out/$t.log"
  timeout "$limit" "$path" > "$log" 2>&1
  rc=$?
  if [[ $rc -eq 0 ]]; then
    summary+=("$(printf '%-10s ok: %s' "$t" "$(grep -m1 -E '^\[doctest\] test cases' "$log")")")
  else
    failed=1
    summary+=("$(printf '%-10s FAILED (exit %d): %s' "$t" "$rc" "$(grep -m1 -E 'ERROR|FAILED|error|abort' "$log" | cut -c1-160)")")
    [[ $rc -ge 128 ]] && backtrace "$log" "$path"
  fi
done

echo "======================== gpu_check ========================"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit $failed
