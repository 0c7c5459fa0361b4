#!/usr/bin/env bash
# The one-GPU measurements, as recorded in docs/benchmarks.md. Usage: bash scripts/bench_one_gpu.sh OUT_DIR
set -u
OUT=${1:?usage: bash scripts/bench_one_gpu.sh OUT_DIR}
export PYTHONUNBUFFERED=1
FAST="--ns-backend auto --ns-coefficients polar_express"
B="python3 -m dmuon.bench --preset 1b --steps 20 --warmup 5"
run() { local name=$1; shift; echo "== $name: $*"; timeout 200 "$@" --out "$OUT/$name" 2>&1 | grep -A7 "^variant"; }
python3 scripts/gpu_parity.py 2>&1 | grep -E "bitwise|torch "
run recipe_default $B                                   # every variant, the recipe's per-layer FSDP2
run root_default   $B --variants fsdp_adamw,torch_muon,dmuon_z3,dmuon_z2 --dmuon-wrap root
run root_fast      $B --variants fsdp_adamw,torch_muon,dmuon_z3,dmuon_z2 --dmuon-wrap root $FAST
run root_fast_fp32 $B --variants torch_muon,dmuon_z3 --dmuon-wrap root $FAST --master-dtype fp32
run long_seq       python3 -m dmuon.bench --preset 1b --steps 10 --warmup 3 --batch 4 --seq 4096 \
                   --variants fsdp_adamw,torch_muon,dmuon_z3 --dmuon-wrap root $FAST
for p in 8b 1b; do
  for ns in "" "$FAST"; do
    timeout 120 python3 -m dmuon.bench --preset $p --simulate-world-size 8 --steps 5 $ns --out "$OUT/sim_${p}_${ns:+fast}" 2>&1 | tail -1
  done
done
