#!/usr/bin/env bash
# The whole GPU check in one call on the device machine (see ../shared/GPU.md):
#   scripts/gpu_suite.sh [STAGES]   STAGES: comma list of tests,kernels,quant,reference,
#                                   latency,throughput,serve,serve_short,serve_prefix,
#                                   profile,quantized,breakdown,async_mix
#                                   (default: all)
# Writes everything under $OUT/suite (tarred to $OUT/suite.tgz at the end) and prints a summary.
# Run from the repository root; kiln is used from the tree (PYTHONPATH=.), nothing is installed.
# The packages the device lacks (xgrammar, pydantic, fastapi, openai ...): run
# scripts/device_site.sh here first and carry .whl with the call.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
if [ -f .whl/site.tar.xz ]; then  # the device has no network: what it lacks travels packed
  mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site  # (scripts/device_site.sh)
  for m in $(ls /tmp/site | grep -v -e dist-info -e '^_' | sed 's/\.py$//'); do
    python3 -c "import $m" 2>/dev/null && rm -rf "/tmp/site/$m" "/tmp/site/$m.py"  # the device's
  done
  export PYTHONPATH=.:/tmp/site
fi
export KILN_GIT_COMMIT=${KILN_GIT_COMMIT:-$(cat .git-commit 2>/dev/null || echo unknown)}
OUT=${OUT:-out/gpu}
R=$OUT/suite
mkdir -p "$R"
STAGES=",${1:-tests,kernels,quant,reference,latency,throughput,serve,serve_short,serve_prefix,profile,quantized,breakdown,async_mix},"
M="--model benchmarks/workloads/llama-3.1-8b --load-format dummy --max-model-len 4096"
K="python3 -m kiln.cli"
want() { [[ $STAGES == *",$1,"* ]]; }
stage() { echo "=== $1 $(date +%T)"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$R/device.txt"
python3 -c "import torch,triton,transformers;print('torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__)" | tee -a "$R/device.txt"

if want tests; then
  stage "pytest -m gpu"
  KILN_GPU_REPORT=$R/gpu_report.jsonl python3 -m pytest -m gpu -o addopts="" -q -p no:cacheprovider \
    tests 2>&1 | tee "$R/pytest_gpu.txt" | tail -5
fi
if want kernels; then
  stage kernels
  python3 benchmarks/gpu_kernels.py --out "$R/kernels.json" > "$R/kernels.txt" 2>&1; tail -16 "$R/kernels.txt"
fi
if want quant; then
  stage "quant kernels"
  python3 benchmarks/gpu_quant.py --out "$R/quant.json" --sweep none > "$R/quant.txt" 2>&1; tail -25 "$R/quant.txt"
  stage "decode-batch tile GEMM (bf16, FP8) against cuBLAS"
  python3 benchmarks/gemm_sweep.py --ms 16,64 --out "$R/gemm.json" > "$R/gemm.txt" 2>&1; tail -20 "$R/gemm.txt"
fi
if want reference; then
  stage "reference generator batch-1 decode"
  python3 benchmarks/reference_decode.py 2>&1 | grep -v "^INFO" | tee "$R/reference_decode.txt"
fi
if want latency; then
  stage "bench latency (batch 1, 8, 64; 128 in, 256 out; HF peer)"
  $K bench latency $M --gpu-memory-utilization 0.6 --batch-size 1,8,64 --input-len 128 --output-len 256 \
    --num-iters 2 --peer "${LATENCY_PEER:-hf}" --output-dir "$R/latency" > "$R/latency.log" 2>&1
  tail -12 "$R/latency.log"
fi
if want throughput; then
  stage "bench throughput 64 x 512/256 (HF peer), 512 x 512/256"
  $K bench throughput $M --gpu-memory-utilization 0.6 --workload benchmarks/workloads/throughput-64x512x256.json \
    --peer hf --output-dir "$R/throughput64" > "$R/throughput64.log" 2>&1; tail -8 "$R/throughput64.log"
  $K bench throughput $M --max-num-seqs 512 --workload benchmarks/workloads/throughput-512x512x256.json \
    --output-dir "$R/throughput512" > "$R/throughput512.log" 2>&1; tail -8 "$R/throughput512.log"
fi
# serve_bench NAME WORKLOAD RATES [kiln serve flags]: kiln serve in the background, kiln bench
# serve against it, results under $R/NAME
serve_bench() {
  local name=$1 workload=$2 rates=$3; shift 3
  PORT=$(python3 -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])")
  $K serve $M "$@" --port "$PORT" > "$R/$name.log" 2>&1 & S=$!
  $K bench serve --base-url "http://127.0.0.1:$PORT" --model benchmarks/workloads/llama-3.1-8b \
    --workload "$workload" --request-rate "$rates" --num-warmups 4 \
    --goodput ttft:500,tpot:50 --ready-check-timeout-sec 300 --output-dir "$R/$name" > "$R/bench_$name.log" 2>&1
  tail -12 "$R/bench_$name.log"; kill -TERM $S; wait $S; echo "kiln serve exit status $?"
}
if want serve; then
  stage "bench serve at 3 request rates against kiln serve"
  serve_bench serve benchmarks/workloads/serve-64x512x128.json 4,16,64 --no-enable-prefix-caching
fi
if want serve_short; then
  stage "bench serve, 128-token prompts"
  serve_bench serve_short benchmarks/workloads/serve-64x128x128.json 16,64 --no-enable-prefix-caching
fi
if want serve_prefix; then
  stage "bench serve, prompts sharing a 1024-token prefix (prefix caching on)"
  serve_bench serve_prefix benchmarks/workloads/serve-prefix-64x1024+256x128.json 4,16
fi
if want profile; then
  stage "profile"
  $K profile $M --batch-size 8 --input-len 128 --skip-steps 2 --num-steps 8 --output-dir "$R/profile" \
    > "$R/profile.log" 2>&1; tail -25 "$R/profile.log"
fi
if want quantized; then
  stage "quantized batch-1 decode"
  for q in int8 int4 fp8; do
    $K bench latency $M --quantization $q --batch-size 1 --input-len 128 --output-len 256 --num-iters 2 \
      --output-dir "$R/latency_$q" > "$R/latency_$q.log" 2>&1; tail -4 "$R/latency_$q.log"
  done
  $K bench latency $M --kv-cache-dtype fp8 --batch-size 1,64 --input-len 128 --output-len 256 \
    --num-iters 2 --output-dir "$R/latency_fp8kv" > "$R/latency_fp8kv.log" 2>&1; tail -5 "$R/latency_fp8kv.log"
  $K bench throughput $M --quantization fp8 --workload benchmarks/workloads/throughput-64x512x256.json \
    --output-dir "$R/throughput64_fp8" > "$R/throughput64_fp8.log" 2>&1; tail -6 "$R/throughput64_fp8.log"
fi
if want breakdown; then
  stage "512 x 512/256: steps against their floors, kernels summed"
  python3 benchmarks/run_breakdown.py $M --max-num-seqs 512 \
    --workload benchmarks/workloads/throughput-512x512x256.json --kernels --output-dir "$R/breakdown" \
    > "$R/breakdown.txt" 2>&1; head -16 "$R/breakdown.txt"
fi
if want async_mix; then
  stage "plain requests beside structured / penalized / logprobs ones, async on and off"
  python3 benchmarks/async_mix.py > "$R/async_mix.txt" 2>&1; tail -4 "$R/async_mix.txt"
fi
stage done
tar czf "$OUT/suite.tgz" --exclude='*trace*' -C "$R" . && ls -la "$OUT"
