#!/usr/bin/env bash
# The multi-GPU runs on one host, as recorded in docs/benchmarks.md.
#   bash scripts/bench_multi_gpu.sh OUT_DIR checks   # NCCL pass of the distributed tests + overlap profiles (~5 min)
#   bash scripts/bench_multi_gpu.sh OUT_DIR bench    # 1B / 8B step times on a 1-D mesh (~7 min on 4 GPUs)
#   bash scripts/bench_multi_gpu.sh OUT_DIR hsdp     # 8B HSDP 2 x N/2, replicate_async on and off (~4 min)
# Uses every visible GPU (2, 4 or 8); the HSDP parts need 4 or more.
set -u
OUT=${1:?usage: bash scripts/bench_multi_gpu.sh OUT_DIR checks|bench|hsdp}
WHAT=${2:?usage: bash scripts/bench_multi_gpu.sh OUT_DIR checks|bench|hsdp}
export PYTHONUNBUFFERED=1
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
FAST="--ns-backend auto --ns-coefficients polar_express"
TR="torchrun --standalone --nproc_per_node $N"
mkdir -p "$OUT"
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), $N, 'x', torch.cuda.get_device_name(0))"

if [ "$WHAT" = checks ]; then
  DMUON_TEST_DEVICE=cuda timeout 330 python3 -m pytest -q -rs -p no:cacheprovider tests/test_parity.py \
    tests/test_hsdp.py tests/test_checkpoint.py tests/test_prefetch.py tests/test_lifecycle.py \
    tests/test_accumulation.py tests/test_clip.py 2>&1 | tee "$OUT/nccl_tests.log" | tail -4
  for pf in "" --no-prefetch; do
    timeout 90 $TR scripts/gpu_profile.py --parts overlap $pf --out "$OUT" 2>&1 | grep "^rank"
  done
  [ "$N" -ge 4 ] && timeout 90 $TR scripts/gpu_profile.py --parts overlap --replicate 2 --out "$OUT" 2>&1 | grep "^rank"
  exit 0
fi

run() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  echo "== $name: $*"
  timeout "$limit" $TR -m dmuon.bench "$@" --out "$OUT/$name" 2>&1 | grep -A6 "^variant"
}
S="--seq 2048 --batch 4"
if [ "$WHAT" = bench ]; then
  run 1b_recipe 100 --preset 1b $S --steps 8 --warmup 3 --e2e-steps 4 --variants fsdp_adamw,naive_fsdp_muon,dmuon_z3,dmuon_z2
  run 1b_root_fast 80 --preset 1b $S --steps 8 --warmup 3 --e2e-steps 4 --variants fsdp_adamw,dmuon_z3,dmuon_z2 \
      --dmuon-wrap root $FAST
  run 8b_root_fast 190 --preset 8b $S --steps 4 --warmup 2 --e2e-steps 3 \
      --variants fsdp_adamw,naive_fsdp_muon,dmuon_z3,dmuon_z2 --dmuon-wrap root $FAST
fi
if [ "$WHAT" = hsdp ] && [ "$N" -ge 4 ]; then
  for a in on off; do
    run "8b_hsdp_async_$a" 110 --preset 8b $S --steps 4 --warmup 2 --e2e-steps 4 --variants fsdp_adamw,dmuon_z3 \
        --dmuon-wrap root $FAST --replicate 2 --replicate-async $a
  done
fi
