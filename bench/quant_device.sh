#!/bin/bash
# The quantization issue's GPU measurements, stage by stage (run from the repo root on the
# device, after `source .carry/unpack.sh`; the vLLM stage after .vc3/stage.sh):
#
#   bash bench/quant_device.sh tests      GPU tests of the kernels and quantized models
#   bash bench/quant_device.sh kv         llama3-8b 16 x 7680/256 with a 16-bit and an fp8 KV cache
#   bash bench/quant_device.sh vllm       vLLM 0.25.1: QUANT=fp8 (latency, 1000 x 1024/128), QUANT=awq (latency)
#   bash bench/quant_device.sh kvray      kvray: fp8 (latency, 1000 x 1024/128), awq (latency)
#
# JSON lines go to stdout and $OUT/quant.jsonl.
set -u
out=${OUT:-device-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
lines() { tee -a "$out/full.log" | grep --line-buffered "^{" | tee -a "$out/quant.jsonl"; }
for stage in "$@"; do
  case $stage in
    tests)
      timeout 330 python -m pytest -m gpu -q -p no:cacheprovider tests/kernels tests/gpu \
        2>&1 | tail -25 ;;
    kv)
      for kv in auto fp8; do
        timeout 150 python -m bench.suite --model-shape llama3-8b --max-model-len 8192 \
          --only long_context --kv-cache-dtype $kv 2>&1 | lines
      done ;;
    vllm)
      for q in fp8 awq; do
        only=latency,throughput; [ $q = awq ] && only=latency
        PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 SHAPE=llama3-8b QUANT=$q ONLY=$only \
          timeout 200 python3 .vc3/bench.py 2>&1 | lines
      done ;;
    kvray)
      timeout 150 python -m bench.suite --model-shape llama3-8b --quantization fp8 \
        --only latency throughput 2>&1 | lines
      timeout 120 python -m bench.suite --model-shape llama3-8b --quantization awq \
        --dtype float16 --only latency 2>&1 | lines ;;
  esac
done
