#!/bin/bash
# The performance issue's GPU measurements, stage by stage (run from the repo root on the
# device, after `source .carry/unpack.sh`; the vLLM stage after .vc3/stage.sh):
#
#   bash bench/perf_device.sh tests      GPU tests of the sampler and the kernels it uses
#   bash bench/perf_device.sh sampler    bench.sampler: the candidate sampler against the reference
#   bash bench/perf_device.sh kvray      bench.suite's sampled workload, llama3-8b and qwen2.5-7b
#   bash bench/perf_device.sh vllm       vLLM 0.25.1 on the same sampled workload and shapes
#
# JSON lines go to stdout and $OUT/perf.jsonl; everything to $OUT/full.log.
set -u
out=${OUT:-device-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
lines() { tee -a "$out/full.log" | grep --line-buffered "^{" | tee -a "$out/perf.jsonl"; }
for stage in "$@"; do
  case $stage in
    tests)
      timeout 240 python -m pytest -m gpu -q -p no:cacheprovider tests/engine/test_sampler.py \
        tests/engine/test_sampling_candidates.py 2>&1 | tail -15 ;;
    sampler)
      timeout 240 python -m bench.sampler 2>&1 | lines ;;
    kvray)
      for shape in llama3-8b qwen2.5-7b; do
        timeout 200 python -m bench.suite --model-shape $shape --only sampled 2>&1 | lines
      done ;;
    vllm)
      for shape in llama3-8b qwen2.5-7b; do
        PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 SHAPE=$shape ONLY=sampled \
          timeout 240 python3 bench/vllm_anchor_bench.py 2>&1 | lines
      done ;;
  esac
done
