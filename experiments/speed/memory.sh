#!/usr/bin/env bash
# Issue 6 on ONE H200, one device call (~9.5 min): the memory switches' first GPU run and the
# side-by-side table with the ALST-style peer.
#   run(kind="nvidia-h200", carry=[".whl"], timeout_s=600, command="bash experiments/speed/memory.sh")
# $OUT: cuda_tests.txt (offload streams + tiles with the compiled kernels vs the plain path),
# mem_32k_128k.md/.json (megablu modes), peer.md (ALST-style peer, same method), long.md/.json
# (256k and 512k, frugal modes, one step each). Each part has its own time guard.
set -u
cd "$(dirname "$0")/../.."
source dev/device_env.sh
OUT=${OUT:-/tmp/h200_mem}; mkdir -p "$OUT"
t0=$SECONDS
left() { echo $(( ${TOTAL_S:-570} - (SECONDS - t0) )); }
# 1. correctness first: streams, pinned memory, compiled kernels inside tiles (builds the ops)
timeout 150 python -m pytest -q -p no:cacheprovider tests/model/test_memory_switches.py -k cuda \
  > "$OUT/cuda_tests.txt" 2>&1
echo "exit $? after $((SECONDS - t0)) s" >> "$OUT/cuda_tests.txt"
# 2. the table at the issue's two target windows
timeout 200 python bench/train_bench.py --T 32768,131072 --iters 2 --ops cuda --loss-chunk 4096 \
  --modes selective,selective+offload,full+tiles,full+tiles+offload --json mem_32k_128k.json \
  > "$OUT/mem_32k_128k.md" 2>> "$OUT/cuda_tests.txt"
echo "exit $? after $((SECONDS - t0)) s" >> "$OUT/mem_32k_128k.md"
# 3. the peer, measured the same way in the same call
l=$(left); [ "$l" -gt 140 ] && l=140
timeout "$l" python bench/alst_peer.py --T 32768,131072 --iters 2 > "$OUT/peer.md" 2>> "$OUT/cuda_tests.txt"
echo "exit $? after $((SECONDS - t0)) s" >> "$OUT/peer.md"
# 4. long windows, the most frugal modes, one step each (the 1M step takes ~10 min alone)
l=$(( $(left) - 5 ))
[ "$l" -gt 30 ] && timeout "$l" python bench/train_bench.py --T 262144,524288 --iters 1 --no-warmup --ops cuda \
  --loss-chunk 4096 --modes full+tiles+offload --json long.json > "$OUT/long.md" 2>> "$OUT/cuda_tests.txt"
echo "exit $? after $((SECONDS - t0)) s" >> "$OUT/long.md"
