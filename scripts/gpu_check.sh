#!/usr/bin/env bash
# The one command for the GPU machine, run from the source tree (the device tool runs it in the
# repository root): the GPU tests, then the benchmarks, then a table of every figure, last.
#
#   scripts/gpu_check.sh                 tests, K1, K1 windowed, W1, W3 (the short set)
#   scripts/gpu_check.sh tests k1 k1-sweep k1-w1 k1-fp8 k1-window w1 w1-profile w2 w3 hf w4 w4-thread w5 moe moe-sweep cuda
#       lora w1-lora w3-lora w1-fp8kv w3-fp8 w3-w4a16 w2-fp8 quant w3-spec w3-eagle w3-eagle-tp w1-spec verify-attn spec-editing
#       w3-variants
#       sanitize so sampler
#       tp (tp-tests, tp-bench) cp
#       determinism
#       dp
#       w6 w6-long w6-prefix w7 k1-mla
#
# Stages: tests (tests/gpu, and the decode kernel's own cache write against the two kernels it replaces), k1 (pagedllm bench kernels; k1-sweep: every launch too; k1-w1: the
# sweep at W1's decode shape; k1-fp8: the Triton decode over an FP8 cache; k1-window:
# the Triton decode with a 1024-token sliding window beside itself unwindowed), w1 / w2
# (bench throughput; w1-profile: W1 with 5 steps torch-profiled in each phase, its timing then
# includes the profiler), w3 (bench latency, profiled), hf (benchmarks/compare_hf.py: W1 through
# transformers too), w4 (bench serve against pagedllm serve; w4-thread: the server with its engine on a
# thread of its own process, --no-engine-process), w5 (bench throughput of the
# Qwen3-30B-A3B mixture of experts, against its floor), w6 (the hybrid linear-attention kernels'
# tests, then bench throughput of the Qwen3-Next-style hybrid; w6-long: 16 requests decoding to 32,768 tokens,
# the hybrid against its all-attention twin, the table gives the decode steps' ratio, target <= 0.5;
# w6-prefix: what prefix caching, off for the hybrid, is worth: W6's requests after a shared
# 2,048-token prefix on the hybrid, and on its all-attention twin with and without prefix caching), w7 (bench throughput of DeepSeek-V2-Lite's
# multi-head latent attention and shared experts, against its floor, KV bytes per token beside
# Llama-3.1-8B's), k1-mla (bench mla: the MLA decode kernel against FlashInfer's MLA decode), moe (bench moe: the fused MoE kernel against
# the per-expert torch reference; moe-sweep: every launch too), cuda (W1 on the cuda backend),
# sanitize (compute-sanitizer on the CUDA kernels), lora (bench lora: the BGMV and SGMV kernels against
# the masked torch product), w1-lora / w3-lora (W1 with 8 rank-16 LoRA adapters, W3 with one), w1-fp8kv
# (W1 with an FP8 KV cache), w3-fp8 (W3 with FP8 weights), w3-w4a16 (W3 with compressed-tensors W4A16
# weights, dummy), w2-fp8 (W2 with FP8 W8A8 weights), quant (bench quant: every quantized GEMM path at
# Llama-3.1-8B's layer shapes, decode to prefill, and the skinny kernels' launch sweep), w3-spec (W3
# with n-gram drafts at a synthetic acceptance rate), w3-eagle (W3 with an EAGLE-3 head at synthetic
# acceptance 1.0 and 0.7), w3-eagle-tp (two GPUs: W3 at TP=2 with the EAGLE-3 head and with n-gram
# drafts, both at synthetic acceptance 1.0, and without speculation), w1-spec (W1's prompts at
# batch 64 and 256 with n-gram drafts at synthetic acceptance 0.5, as configured by default and
# drafting at every batch size, and without; the table gives the ratios, target >= 0.95x at 64), verify-attn (benchmarks/verify_attention.py: a verify step's
# decode attention, k = 3, with and without query groups, beside a decode step, at Llama-3.1-8B's
# and Qwen3-0.6B's heads), spec-editing (the embedded GGUF, float32, n-gram on the editing
# workload against no speculation, looked up on the host and on the device, target >= 1.6x,
# identical greedy text), w3-variants (W3 under benchmarks/variants' leave-one-out variants beside the
# plain run: the decode's own cache write against the separate one, decode attention, and at TP=2
# the all-reduces; TP=2 where two GPUs are visible), tp (two GPUs: the tensor-parallel GPU tests,
# then all-reduce latency (benchmarks/all_reduce.py: NCCL against the one-shot kernel), W2 and W3
# at tensor_parallel_size 1 and 2, W2 at pipeline_parallel_size 2, W3 at TP=2 with NCCL alone;
# the table gives TP=2 and PP=2 over TP=1), so
# (benchmarks/structured_output.py: 32 json_schema requests against 32 unconstrained), sampler
# (benchmarks/sampler.py: the fused last sampling pass against the torch path), determinism (the
# batch-invariant GPU and kernel tests, its GEMM against cuBLAS at W1's and W3's layer
# shapes (benchmarks/batch_invariant_gemm.py), then W1 and W3 in the default mode and with
# --batch-invariant; the table gives the ratios, targets W1 >= 0.9x and W3 <= 1.05x), dp (two GPUs:
# W4 at 64 req/s against pagedllm serve with one engine, then with --data-parallel-size 2; the table
# gives DP=2's p99 TTFT over DP=1's, target <= 0.6x), cp (two GPUs: context parallelism's GPU tests,
# benchmarks/cp_attention.py, then a 65,536-token prompt at CP=1, CP=2 and TP=2; the table gives CP=2's
# prefill over CP=1's, target <= 0.6x, and its decode over TP=2's, target <= 1.0x). Results go
# to $OUT (the device tool's output folder) or /tmp/gpu_check.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests k1 k1-window w1 w3)
failed=()

# What the GPU image lacks (the server's packages) travels as wheels in the ignored .whl/.
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn pydantic prometheus-client aiohttp 2>&1 | tail -1
    # Structured outputs (llguidance, an abi3 wheel).
    python3 -m pip install -q --no-index --find-links .whl 'llguidance>=1.9.1' 2>&1 | tail -1
    # compressed-tensors (and pydantic, which the image lacks), where their wheels travel: the GPU
    # tests that write compressed-tensors checkpoints with the library's own packing.
    ls .whl/compressed_tensors-*.whl >/dev/null 2>&1 &&
        python3 -m pip install -q --no-index --find-links .whl compressed-tensors 2>&1 | tail -1
    # pytest-xdist, where its wheels travel too: the w6 stage's tests on several workers.
    ls .whl/pytest_xdist-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --find-links .whl pytest-xdist 2>&1 | tail -1
    # A newer transformers, where its wheels travel: the HF references of the GPU tests' Mamba-2
    # hybrids (Granite 4.0-H, Bamba) over prompts of hundreds of tokens differ between the
    # image's 5.17 and 5.24, which the CPU tests (and pagedllm on the CPU and GPU) agree with.
    ls .whl/transformers-*.whl >/dev/null 2>&1 &&
        python3 -m pip install -q --no-index --no-deps --upgrade --find-links .whl transformers tokenizers 2>&1 | tail -1
fi
# flash-linear-attention (the hybrids' varlen prefill on CUDA), pure-Python wheels in the ignored .whl-fla/.
if [ -d .whl-fla ]; then
    python3 -m pip install -q --no-index --no-deps .whl-fla/*.whl 2>&1 | tail -1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

run() {  # run NAME COMMAND...: log to $OUT/NAME.log, remember failures
    local name=$1
    shift
    echo "=== $name: $*"
    local start=$SECONDS
    if ! "$@" 2>&1 | tee "$OUT/$name.log"; then
        failed+=("$name")
    fi
    echo "=== $name took $((SECONDS - start)) s"
}

tp_tests() {  # every test that needs two GPUs in one process (marked two_gpus)
    run tp_tests python3 -m pytest -q -p no:cacheprovider tests/gpu -m two_gpus -ra
}

determinism() {  # batch_invariant=True: its tests, then its cost on W1 and W3 (same call, same GPU)
    run determinism_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_batch_invariant_gpu.py \
        tests/kernels/test_batch_invariant_matmul.py tests/kernels/test_batch_invariant_attention.py -ra
    run determinism_gemm python3 benchmarks/batch_invariant_gemm.py --output-json "$OUT/determinism_gemm.json"
    for mode in default batch_invariant; do
        flag=()
        [ "$mode" = batch_invariant ] && flag=(--batch-invariant)
        run "w1_$mode" python3 -m pagedllm bench throughput --workload W1 "${flag[@]}" \
            --output-json "$OUT/determinism_w1_$mode.json"
        run "w3_$mode" python3 -m pagedllm bench latency --skip-eager "${flag[@]}" \
            --output-json "$OUT/determinism_w3_$mode.json"
    done
}

tp_bench() {  # W2 and W3 at tensor_parallel_size 1 and 2, in the same call; all-reduce latency
    run all_reduce python3 benchmarks/all_reduce.py --output-json "$OUT/all_reduce.json"
    for size in 1 2; do
        run "w2_tp$size" python3 -m pagedllm bench throughput --workload W2 --tensor-parallel-size "$size" \
            --output-json "$OUT/w2_tp$size.json"
        # With each rank's device time per step and its wait for the host (CUDA events, after the timing).
        run "w3_tp$size" python3 -m pagedllm bench latency --skip-eager --tensor-parallel-size "$size" \
            --profile-steps 40 --profile-mode events --output-json "$OUT/w3_tp$size.json"
    done
    # W2 over two pipeline stages (two micro-batches in flight), against TP=1 above.
    run w2_pp2 python3 -m pagedllm bench throughput --workload W2 --pipeline-parallel-size 2 \
        --output-json "$OUT/w2_pp2.json"
    # W3 at TP=2 with NCCL doing every all-reduce: what the one-shot kernel buys.
    run w3_tp2_nccl python3 -m pagedllm bench latency --skip-eager --tensor-parallel-size 2 \
        --disable-custom-all-reduce --output-json "$OUT/w3_tp2_nccl.json"
}

for stage in "${stages[@]}"; do
    case $stage in
    tests)
        # Several GPUs: one pytest-xdist worker per GPU (tests/conftest.py pins each to its own),
        # then the tests that need two GPUs, which no such worker sees.
        num_gpus=$(nvidia-smi -L | wc -l)
        if [ "$num_gpus" -gt 1 ]; then
            PAGEDLLM_TEST_NUM_GPUS=$num_gpus run tests python3 -m pytest -q -p no:cacheprovider tests/gpu \
                tests/kernels/test_decode_append.py -ra \
                -n "$num_gpus" --dist loadfile --durations=15 -m "not two_gpus"
            tp_tests
        else
            run tests python3 -m pytest -q -p no:cacheprovider tests/gpu tests/kernels/test_decode_append.py -ra \
                --durations=15
        fi
        ;;
    k1) run k1 python3 -m pagedllm bench kernels --output-json "$OUT/k1.json" --output-png "$OUT/k1.png" ;;
    k1-sweep)
        run k1 python3 -m pagedllm bench kernels --sweep --output-json "$OUT/k1.json" --output-png "$OUT/k1.png"
        ;;
    k1-w1)  # W1's decode step: 256 sequences of 100-1280 tokens, Qwen3-0.6B's 16 query / 8 KV heads
        run k1_w1 python3 -m pagedllm bench kernels --implementations triton --sweep --contexts 100-1280 \
            --batch-size 256 --num-heads 16 --num-kv-heads 8 --output-json "$OUT/k1_w1.json"
        ;;
    k1-fp8)  # the Triton decode over an FP8 cache; the FP8 KV cache's target: >= 85% of copy at 4,096 and 16,384
        run k1_fp8 python3 -m pagedllm bench kernels --implementations triton --kv-cache-dtype fp8 \
            --output-json "$OUT/k1_fp8.json"
        ;;
    k1-window)
        run k1_window python3 -m pagedllm bench kernels --implementations triton --sliding-window 1024 \
            --output-json "$OUT/k1_window.json"
        ;;
    w1) run w1 python3 -m pagedllm bench throughput --workload W1 --output-json "$OUT/w1.json" --output-png "$OUT/w1.png" ;;
    w1-profile)
        run w1_profile python3 -m pagedllm bench throughput --workload W1 --profile-steps 5 \
            --output-json "$OUT/w1_profile.json"
        ;;
    w2) run w2 python3 -m pagedllm bench throughput --workload W2 --output-json "$OUT/w2.json" --output-png "$OUT/w2.png" ;;
    w3)
        run w3 python3 -m pagedllm bench latency --output-json "$OUT/w3.json" --output-png "$OUT/w3.png" \
            --profile-steps 20
        ;;
    w5) run w5 python3 -m pagedllm bench throughput --workload W5 --output-json "$OUT/w5.json" --output-png "$OUT/w5.png" ;;
    w6)  # the hybrids' kernels (the fused MoE, its router and combine, the attention's gate and partial
        # rotary, Mamba-2's decode step too) against their torch paths, then W6
        # With pytest-xdist, on 8 workers, a file to a worker: the end-to-end tests, which each take
        # 30% of the GPU's memory, stay one at a time (the stage takes about 4 minutes, not 8).
        parallel=()
        python3 -c "import xdist" 2>/dev/null && parallel=(-n 8 --dist loadfile)
        run w6_tests python3 -m pytest -q -p no:cacheprovider "${parallel[@]}" tests/gpu/test_linear_attention_gpu.py \
            tests/gpu/test_moe_routing_gpu.py tests/gpu/test_fused_moe_gpu.py tests/kernels/test_fused_moe.py \
            tests/kernels/test_gated_deltanet_paths.py \
            tests/kernels/test_causal_conv1d.py tests/kernels/test_linear_attention_kernels.py \
            tests/kernels/test_state_rows.py tests/kernels/test_ssd_kernels.py tests/gpu/test_fused_gpu.py \
            -k "not hugging_face" -ra
        run w6 python3 -m pagedllm bench throughput --workload W6 --output-json "$OUT/w6.json" --output-png "$OUT/w6.png"
        ;;
    w6-long)  # W6's long-context bar: its decode step at 32,768 tokens at most 0.5x its all-attention twin's
        for model in qwen3-next-2b qwen3-next-2b-attention; do
            run "w6_long_$model" python3 -m pagedllm bench throughput --workload W6 --num-prompts 16 \
                --input-len 32704 --output-len 64 --model "benchmarks/configs/$model" \
                --output-json "$OUT/w6_long_$model.json"
        done
        ;;
    w6-prefix)  # the cost of the hybrid's prefix caching being off: the twin with and without it beside
        run w6_prefix_hybrid python3 -m pagedllm bench throughput --workload W6 --prefix-len 2048 \
            --enable-prefix-caching --output-json "$OUT/w6_prefix_hybrid.json"
        for caching in enable no-enable; do
            run "w6_prefix_twin_$caching" python3 -m pagedllm bench throughput --workload W6 --prefix-len 2048 \
                --model benchmarks/configs/qwen3-next-2b-attention "--$caching-prefix-caching" \
                --output-json "$OUT/w6_prefix_twin_$caching.json"
        done
        ;;
    w7) run w7 python3 -m pagedllm bench throughput --workload W7 --output-json "$OUT/w7.json" --output-png "$OUT/w7.png" ;;
    k1-mla)  # MLA's target: >= 1.0x FlashInfer's MLA decode at every context (FlashInfer's time / ours)
        run k1_mla python3 -m pagedllm bench mla --output-json "$OUT/k1_mla.json"
        ;;
    sampler) run sampler python3 benchmarks/sampler.py --output-json "$OUT/sampler.json" ;;
    moe) run moe python3 -m pagedllm bench moe --output-json "$OUT/moe.json" ;;
    lora) run lora python3 -m pagedllm bench lora --output-json "$OUT/lora.json" ;;
    w1-lora)  # LoRA's target: >= 0.8x W1's output tok/s (run w1 in the same call)
        run w1_lora python3 -m pagedllm bench throughput --workload W1 --num-loras 8 --lora-rank 16 \
            --output-json "$OUT/w1_lora.json"
        ;;
    w3-lora)  # LoRA's target: <= 1.1x W3's ms/token (run w3 in the same call)
        run w3_lora python3 -m pagedllm bench latency --lora-rank 16 --skip-eager --output-json "$OUT/w3_lora.json"
        ;;
    w1-fp8kv)  # the FP8 KV cache's target: >= 1.25x W1's output tok/s with a bf16 cache (run w1 in the same call)
        run w1_fp8kv python3 -m pagedllm bench throughput --workload W1 --kv-cache-dtype fp8 \
            --output-json "$OUT/w1_fp8kv.json"
        ;;
    w3-fp8)  # W3 with its weights quantized to FP8 at load (online fp8), against its floor at the bytes kept
        run w3_fp8 python3 -m pagedllm bench latency --quantization fp8 --skip-eager --output-json "$OUT/w3_fp8.json"
        ;;
    w3-w4a16)  # W4A16's target: <= 1.35x its own floor (benchmarks/configs/llama-3.1-8b-w4a16: groups of 128)
        run w3_w4a16 python3 -m pagedllm bench latency --model benchmarks/configs/llama-3.1-8b-w4a16 --skip-eager \
            --output-json "$OUT/w3_w4a16.json"
        ;;
    w2-fp8)  # FP8 W8A8's target: >= 1.4x W2's output tok/s in bf16 (run w2 in the same call)
        run w2_fp8 python3 -m pagedllm bench throughput --workload W2 --quantization fp8 --output-json "$OUT/w2_fp8.json"
        ;;
    quant) run quant python3 -m pagedllm bench quant --sweep --output-json "$OUT/quant.json" ;;
    w3-spec)  # W3 with n-gram drafts of 3 tokens accepted at a synthetic rate (SPEC_ACCEPTANCE, default 1.0)
        run w3_spec python3 -m pagedllm bench latency --skip-eager \
            --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' \
            --synthetic-acceptance-rate "${SPEC_ACCEPTANCE:-1.0}" --output-json "$OUT/w3_spec.json"
        ;;
    w3-eagle)  # EAGLE-3's targets, k=3, 8B-shaped head: acceptance 1.0 at most 0.33x W3, 0.7 at most 0.55x (run w3 too)
        for rate in 1.0 0.7; do
            run "w3_eagle_$rate" python3 -m pagedllm bench latency --skip-eager \
                --speculative-config '{"method": "eagle3", "model": "benchmarks/configs/llama-3.1-8b-eagle3", "num_speculative_tokens": 3}' \
                --synthetic-acceptance-rate "$rate" --output-json "$OUT/w3_eagle_$rate.json"
        done
        ;;
    w3-eagle-tp)  # TP=2, k=3, acceptance 1.0: EAGLE-3 within 10% of n-gram (the verify-only cost: no drafting)
        run w3_tp2 python3 -m pagedllm bench latency --skip-eager --tensor-parallel-size 2 \
            --output-json "$OUT/w3_tp2.json"
        run w3_tp2_ngram python3 -m pagedllm bench latency --skip-eager --tensor-parallel-size 2 \
            --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' \
            --synthetic-acceptance-rate 1.0 --output-json "$OUT/w3_tp2_ngram.json"
        run w3_tp2_eagle python3 -m pagedllm bench latency --skip-eager --tensor-parallel-size 2 \
            --speculative-config '{"method": "eagle3", "model": "benchmarks/configs/llama-3.1-8b-eagle3", "num_speculative_tokens": 3}' \
            --synthetic-acceptance-rate 1.0 --output-json "$OUT/w3_tp2_eagle.json"
        ;;
    w3-variants)  # W3 under benchmarks/variants' timing variants beside the plain run, TP=1 (and TP=2 on two GPUs)
        sizes=(1)
        [ "$(nvidia-smi -L | wc -l)" -gt 1 ] && sizes=(1 2)
        for size in "${sizes[@]}"; do
            variants=(base separate-cache-write no-decode-attention)
            [ "$size" -gt 1 ] && variants+=(no-all-reduce)
            for variant in "${variants[@]}"; do
                bench_variant=$variant
                [ "$variant" = base ] && bench_variant=
                run "w3v_${variant}_tp$size" env PAGEDLLM_BENCH_VARIANT="$bench_variant" \
                    PYTHONPATH="$PWD/benchmarks/variants:$PWD" python3 -m pagedllm bench latency --skip-eager \
                    --num-iters 5 --tensor-parallel-size "$size" --output-json "$OUT/w3v_${variant}_tp$size.json"
            done
        done
        ;;
    verify-attn)  # a verify step's decode attention (k=3), with and without query groups, beside a decode step
        run verify_attn python3 benchmarks/verify_attention.py --output-json "$OUT/verify_attn.json"
        run verify_attn_qwen python3 benchmarks/verify_attention.py --num-heads 16 --num-kv-heads 8 \
            --output-json "$OUT/verify_attn_qwen.json"
        ;;
    w1-spec)  # W1's prompts at batch 64 and 256 (SPEC_BATCHES), n-gram k=3 at synthetic acceptance 0.5 beside none
        # CUDAGRAPH_MODE=FULL_AND_PIECEWISE: steps with prompt tokens replay graphs too, in both runs.
        # n-gram as configured by default (no drafts from 2 running requests on a GPU), then
        # drafting at every batch size ("disable_by_batch_size": null).
        mode=(--cudagraph-mode "${CUDAGRAPH_MODE:-FULL_DECODE_ONLY}")
        for batch in ${SPEC_BATCHES:-64 256}; do
            run "w1_b$batch" python3 -m pagedllm bench throughput --workload W1 --max-num-seqs "$batch" \
                "${mode[@]}" --output-json "$OUT/w1_b$batch.json"
            for limit in default always; do
                spec='{"method": "ngram", "num_speculative_tokens": 3}'
                [ $limit = always ] && spec='{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": null}'
                name=w1_spec_b$batch
                [ $limit = always ] && name=w1_spec_always_b$batch
                run "$name" python3 -m pagedllm bench throughput --workload W1 --max-num-seqs "$batch" \
                    "${mode[@]}" --speculative-config "$spec" \
                    --synthetic-acceptance-rate "${SPEC_ACCEPTANCE:-0.5}" --output-json "$OUT/$name.json"
            done
        done
        ;;
    spec-editing)  # real weights: the embedded GGUF's n-gram speedup on the editing workload, float32 (target >= 1.6x)
        # The GPU image lacks the embedded model's package: its GGUF file travels as .models/ (ignored).
        gguf=()
        [ -f .models/SmolLM2-135M-Instruct.Q4_1.gguf ] && gguf=(--model .models/SmolLM2-135M-Instruct.Q4_1.gguf)
        ls .whl/gguf-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --find-links .whl gguf 2>&1 | tail -1
        for lookup in host device; do
            run "spec_editing_$lookup" python3 benchmarks/spec_decode_editing.py --device cuda --dtype float32 \
                --max-tokens 192 --lookup "$lookup" "${gguf[@]}" --output-json "$OUT/spec_editing_$lookup.json"
        done
        ;;
    moe-sweep) run moe python3 -m pagedllm bench moe --sweep --output-json "$OUT/moe.json" ;;
    hf) run hf python3 benchmarks/compare_hf.py --output-json "$OUT/hf.json" ;;
    cuda)
        run w1_cuda python3 -m pagedllm bench throughput --workload W1 --attention-backend cuda \
            --output-json "$OUT/w1_cuda.json"
        ;;
    sanitize)
        run cuda_build python3 -c "from pagedllm.kernels.cuda.build import load; load()"
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python3 scripts/cuda_sanitize.py
        run racecheck compute-sanitizer --tool racecheck --error-exitcode 1 python3 scripts/cuda_sanitize.py
        ;;
    w4) run w4 scripts/serve_bench.sh "$OUT" ;;
    peers)  # vLLM 0.26 beside pagedllm, W1 and W3 (PEER_WORKLOADS); install it first: benchmarks/README.md
        run peers python3 benchmarks/peers/vllm_peer.py --vllm-site /tmp/vllm-site \
            --workloads ${PEER_WORKLOADS:-W1 W3} --output-json "$OUT/vllm_peer.json" ;;
    w4-thread) W4_NAME=w4_thread run w4_thread scripts/serve_bench.sh "$OUT" --no-engine-process ;;
    dp)  # W4 at 64 req/s (DP_RATES), one engine against two replicas on two GPUs, in one call
        RATES=${DP_RATES:-64} W4_NAME=w4_dp1 run w4_dp1 scripts/serve_bench.sh "$OUT"
        RATES=${DP_RATES:-64} W4_NAME=w4_dp2 run w4_dp2 scripts/serve_bench.sh "$OUT" --data-parallel-size 2
        ;;
    tp)
        tp_tests
        tp_bench
        ;;
    tp-tests) tp_tests ;;
    cp)  # two GPUs: context parallelism's GPU tests, its kernels' split, and a 65,536-token prompt
        run cp_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_context_parallel_gpu.py \
            tests/gpu/test_context_parallel_engine_gpu.py -ra
        run cp_attention python3 benchmarks/cp_attention.py
        # The prefill (first token) and decode of Llama-3.1-8B's shape at that context: CP=1, CP=2, TP=2.
        for layout in "cp1" "cp2 --context-parallel-size 2" "tp2 --tensor-parallel-size 2"; do
            read -r name flags <<<"$layout"
            # shellcheck disable=SC2086
            run "long_$name" python3 -m pagedllm bench latency --skip-eager --num-iters 1 --input-len 65536 \
                $flags --output-json "$OUT/long_$name.json"
        done
        ;;
    determinism) determinism ;;
    tp-bench) tp_bench ;;
    so)
        # The GPU image lacks the embedded model's package: with .models/smollm2-135m (its config
        # and tokenizer, saved by transformers from the GGUF: AutoConfig/AutoTokenizer
        # .from_pretrained(dir, gguf_file=name).save_pretrained), the same vocabulary and random weights.
        so_model=()
        [ -d .models/smollm2-135m ] && so_model=(--model .models/smollm2-135m --load-format dummy)
        run so python3 benchmarks/structured_output.py --device cuda "${so_model[@]}" --output-json "$OUT/so.json"
        # The same grammars beside an 8B model's step (Llama-3.1-8B's shape, SmolLM2's vocabulary).
        [ -d .models/smollm2-135m ] && run so-8b python3 benchmarks/structured_output.py --device cuda \
            --model .models/smollm2-135m --shape benchmarks/configs/llama-3.1-8b --repeats 3 \
            --output-json "$OUT/so_8b.json"
        ;;
    *) echo "unknown stage $stage" && failed+=("$stage") ;;
    esac
done

python3 scripts/gpu_summary.py "$OUT"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
