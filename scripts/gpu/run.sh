#!/usr/bin/env bash
# The GPU runs recorded in docs/gpu-results.md. On the H200 machine, from the repo root:
#   bash scripts/gpu/run.sh STAGE...   (.gpu/ built here first by scripts/gpu/pack.sh)
# Stages: check, sglang (issue 7 a,c,d,e + disk), sglang-d (d alone), conformance (issue 22: the RolloutEngine
# conformance suite against real SGLang), megatron (issue 5 bf16 TP=2, parity),
# megatron-lora (issue 20: bf16 LoRA TP=2 vs TP=1, base frozen, resume; 2 GPUs),
# e2e (issue 7 b,f), e2e-offload (f with offload only), bench-trainer (like for like, with the
# 16k-token memory table), bench-trainer-packed (RL-like lengths), bench-trainer-short (the real-model run's
# micro-batch: 128 samples of ~40 tokens, SmolLM2-135M shape, with each side's top ops), bench-trainer-mix
# (issue 35: the long-tailed RL mix, 128 samples, responses 50-8k tokens, 1.5B shape, packed at 16k tokens against
# transformers sorted into 16k-token micro-batches; kernels per step, micro-batch balance; ~4 min), bench-rollout,
# bench-sync, bench-sync-7b (default buckets only), bench-sync-small, bench-sync-1.5b, bench-step, bench-step-nographs (issue 16), bench-moe (issue 19),
# bench-moe-ab (issue 35: bench-moe by the code of the 4342bcc record and by this tree in turns; first, here:
# scripts/gpu/build_moe_ab.sh, and carry .gpu/ab-4342bcc), profile-moe (one MoE update of bench-moe's batch:
# ops, kernels, host syncs by line, each MoE piece's time, top ops, for the RoPE and dispatcher variants),
# bench-attention (issue 35: one layer's packed attention by varlen, flex, padded and per-sequence kernels),
# trainer-varlen (issue 35: the trainer's packed varlen log-probs and GRPO step against the per-sequence path),
# long-logprobs (issue 36, item 3: the chunked log-prob head of a 1.5B model, with entropy and loss, forward and
# backward, at 16k-128k response tokens: peak memory against full logits; ~2 min),
# long-train (issue 36: the 1.5B shape, positions 64k, one step each on a 32k- and a 64k-token sample with full
# recompute: seconds, tokens/s, MFU, peak memory; ~2 min), long-loop (issue 36: 8k-token responses from SGLang
# trained through slime-cli, ~4 min),
# cp-varlen (issue 36: context parallelism's flash varlen chunks, 2 and 4 simulated CP ranks on one GPU, against
# one causal varlen call; ~1 min; on a 2-GPU machine also 3 bf16 GRPO steps at CP=2 against one GPU),
# sp-megatron019 (issue 36, item 2: TP=2 with sequence parallelism against TP=1, dense and MoE, over gloo on the
# CPU, by megatron-core 0.19.2's local spec (the CPU machine has 0.16.1); ~2 min),
# moe-replay (issue 19: SGLang vs Megatron log-prob gap on 1,024 sampled tokens, routing replay off and on),
# bench-deepseek (issue 37: one GRPO update of 16 x 1,024 tokens on deepseek-v3-reduced, 1 dense + 3 MoE layers of
# 64 experts with MLA, 1.95B parameters, ours against transformers' DeepseekV3ForCausalLM in the same process:
# tokens/s, MFU, top ops; ~4 min), deepseek-replay (issue 37: moe-replay's gap on deepseek-v3-reduced, SGLang with
# --enable-return-routed-experts; ~5 min),
# lora-smoke (issue 20: SGLang's LoRA kernels load and run), lora (issue 20: adapter syncs through
# SGLangEngine), bench-sync-lora, e2e-lora (issue 20: GRPO with LoRA through SGLang's adapters, tiny and
# 1.5B shapes; e2e-lora-1.5b: the 1.5B one), bench-async (off / one_step / fully on one shared GPU, issue 17),
# bench-async-x2 (the same, trainer and engine on two GPUs), bench-async-kill (fully, the SGLang server
# SIGKILLed mid-run), bench-affinity (issue 18: prefix-cache hit rate, affinity vs round robin, two
# servers on one GPU), sglang-pause (issue 17: a weight update while requests run, paused in place),
# restore-copy (the restore copy of CUDA buckets holds the pushed values; adapter folders keep dtypes),
# moe-sync (issue 19: Qwen3-MoE and Qwen2-MoE weights from the Megatron trainer into SGLang by IPC and disk; issue 37:
# GLM-4.5 too; ~8 min), moe-sync-deepseek (issue 37: the same for DeepSeek-V3 and a V2-Lite-style model, MLA's
# derived w_kc/w_vc and fused q/kv down-projection checked by log-probs before and after each sync; ~6 min),
# mla-varlen (issue 37: DeepSeek-V3's MLA tests and DeepSeek-V2's on megatron-core 0.19.2 and
# transformers 5.12.1, the GPU one on the flash varlen kernel with V padded to the q/k head dim).
# vlm (issue 41: Qwen2.5-VL and Qwen3-VL in the Megatron trainer: bf16 and fp32 log-probs of samples with images
# against transformers on CUDA, packed (flash varlen, compiled mRoPE) and padded; ~2 min), vlm-cpu019 (the CPU tests
# of both families on megatron-core 0.19.2 and transformers 5.12.1, TP=2/PP=2 over gloo included; up to ~9 min),
# bench-vlm (issue 41: one GRPO update of 32 samples x 2 images of 448 x 448 on the Qwen2.5-VL-3B shape with 12 LM layers, trainer vs transformers' Qwen2.5-VL: tokens/s,
# peak memory, the log-prob gap; ~3 min), vlm-sglang (issue 41: a tiny Qwen2.5-VL served by real SGLang with
# --mm-attention-backend sdpa: its prompt token count per request equals ours for 1 and 2 images of several sizes,
# pre-expanded pads fail, the log-prob gap to transformers printed; ~2 min), vlm-e2e (issue 41: the shapes task
# through SGLang and Megatron via slime-cli, bf16: held-out accuracy and the SGLang-Megatron log-prob gap per step; ~6 min).
# real-model (issue 16: SmolLM2-135M-Instruct learning addition and reasoning-gym chain_sum through slime-cli;
# pack it first with scripts/gpu/pack_smollm2.sh; ~11 min, more than one device call holds),
# real-model-addition, real-model-chain-sum (one task each, ~5.5 min on one H200).
# gateway-bench (issue 40: examples/react_agent's agent through the gateway in front of SGLang: added latency per
# call, median and p99, the gateway's share of the wall time, the prefix-cache hit rate; ~4 min), gateway-train
# (the same agent trained through slime-cli, decode CUDA graphs on: the gateway's share of each step; ~6 min).
# Issue 39: roles-sglang (a teacher's prefill log-probs, scalar reward models of the llama, qwen2 and qwen3
# families through --is-embedding and /classify, a judge's text, all against transformers; frozen: the role's
# key opens no admin endpoint), ppo-real-model (PPO with GAE and a critic on the real-model addition task;
# pack it first as for real-model; ~6 min), opd-teacher then opd-student (the addition run saved as the
# teacher, then the untrained model distilled from it with the teacher on SGLang beside the student's
# engine; the KL curve and the step's time split; one call each, same machine).
# Issue 42: elastic-delta-tensor and elastic-delta-disk (delta syncs into real SGLang through the custom weight
# loader, 20 versions by value or by disk with a restart and a late joiner, /weights_checker after each; ~5 min
# each), elastic-pool (an SGLang engine added and one removed while requests run, tokens/s before and after;
# ~5 min), bench-delta (the 3B shape, fp32 master + Adam on real next-token gradients, 10 steps at lr 1e-6 and
# 1e-5, indices + values: change fraction, bytes and disk seconds, full vs delta; ~8 min), bench-delta-xor (the
# same with zlib'd XOR too, 3 steps each: zlib is slow on a 6 GB sync).
# Issue 38 (docs/fp8.md): fp8 (FP8 syncs into real SGLang by CUDA IPC and disk: bytes and scales bit for bit, a
# log-prob probe against a fresh engine after each path; ~5 min), fp8-block64 (the same with SmolLM2's kind of
# partitions: 64x64 blocks through --fp8-gemm-backend triton, the path of fp8-real-model; ~5 min), fp8-moe (the Qwen3-MoE shape in FP8, routed
# experts still returned; ~4 min), bench-fp8-gemm (the --fp8-gemm-backend choices tried on the 7B projections;
# ~2 min), bench-fp8-rollout-bf16, -fp8, -fp8kv, -fp8channel (7B-shape rollout tokens/s, 256 in flight, 1k + 1k tokens,
# CUDA graphs on; one call each, ~4 min), bench-fp8-sync (the 7B sync, bf16 vs FP8 quantised at each sync;
# ~4 min), bench-fp8-table (the table and ratios over the bench-fp8 rows of this call; of several calls: run
# benchmarks/fp8_rollout.py table over their $OUT/bench-fp8-*.json, on any machine), fp8-real-model (the
# real-model addition run as bf16, FP8 + token TIS and FP8 + sequence-level MIS side by side on the one GPU, 256
# held-out prompts: pass@1 per eval, the FP8 runs within 0.1 of bf16 at steps 20 and 30, masked shares; pack the
# real-model data first; ~8 min; the PNG: benchmarks/fp8_real_model.py compare $OUT/fp8-real-model --png ...).
# Logs go to $OUT/<stage>.log (or /tmp/gpu-logs).
# GPU_STAGES_DRY=1: no setup and nothing run; each stage's command is printed (stage, a tab, the command
# shell-quoted), so that tests/unit/test_gpu_stages.py checks on the CPU what a device call would run.
[ -n "${GPU_STAGES_DRY:-}" ] || source "$(dirname "$0")/setup.sh"
# Without the router every SGLang stage fails minutes in; a .gpu/ not built by scripts/gpu/pack.sh fails here at once
if [ -z "${GPU_STAGES_DRY:-}" ] && ! python3 -c "import sglang_router" 2>/dev/null; then
  echo "run.sh: sglang_router is not importable: build .gpu/ with scripts/gpu/pack.sh (it carries its wheel)" >&2
  exit 2
fi
logs=${OUT:-/tmp/gpu-logs}; mkdir -p "$logs"
status=0
for stage in "$@"; do
  echo "=== $stage $(date -u +%FT%TZ)"
  case $stage in
    check) cmd=(bash -c 'nvidia-smi --query-gpu=name,memory.total --format=csv; python3 -c "import torch, sglang, megatron.core, sglang_router, transformers; from importlib.metadata import version; print(torch.__version__, torch.cuda.device_count(), sglang.__version__, megatron.core.__version__, version(\"ray\"), transformers.__version__)"') ;;
    sglang) cmd=(python3 -m pytest -x -q -s -m gpu packages/rollout-sglang/tests/test_sglang_gpu.py -p no:cacheprovider) ;;
    # one call each: an SGLang server takes ~90 s to start on the H100 machine, the delta test starts four
    elastic-delta-tensor|elastic-delta-disk|elastic-pool)
      case $stage in elastic-delta-tensor) k=tensor ;; elastic-delta-disk) k=disk ;; *) k=joins ;; esac
      cmd=(timeout 580 python3 -m pytest -x -q -s -m gpu packages/rollout-sglang/tests/test_sglang_gpu_elastic.py
           -k "$k" -p no:cacheprovider) ;;
    bench-delta) cmd=(timeout 580 python3 benchmarks/delta_sync.py --model qwen2.5-3b --device cuda --steps 10
                      --lrs 1e-6 1e-5 --encodings full sparse --disk "${TMPDIR:-/tmp}/delta-sync-bench" --threads 8) ;;
    bench-delta-xor) cmd=(timeout 580 python3 benchmarks/delta_sync.py --model qwen2.5-3b --device cuda --steps 3
                          --lrs 1e-6 1e-5 --disk "${TMPDIR:-/tmp}/delta-sync-bench" --threads 8) ;;
    fp8|fp8-block64)  # one call each: each starts two servers (~90 s apiece on the H100 machine)
      [ "$stage" = fp8 ] && k="not moe and block128" || k="not moe and block64"
      cmd=(timeout 580 python3 -m pytest -x -q -s -m gpu packages/rollout-sglang/tests/test_sglang_fp8_gpu.py
           -k "$k" -p no:cacheprovider) ;;
    fp8-moe) cmd=(timeout 580 python3 -m pytest -x -q -s -m gpu packages/rollout-sglang/tests/test_sglang_fp8_gpu.py
                  -k moe -p no:cacheprovider) ;;
    # one call each fits the 10 minutes; each writes $OUT/<stage>.json, and the table of them all is made anywhere:
    # python3 benchmarks/fp8_rollout.py table bench-fp8-*.json (bench-fp8-table: of those of this call)
    bench-fp8-gemm) cmd=(timeout 300 python3 benchmarks/fp8_rollout.py gemm --json "$logs/$stage.json") ;;
    bench-fp8-rollout-bf16|bench-fp8-rollout-fp8|bench-fp8-rollout-fp8kv|bench-fp8-rollout-fp8channel)
      v=${stage#bench-fp8-rollout-}; [ "$v" = fp8kv ] && v=fp8-kv; [ "$v" = fp8channel ] && v=fp8-channel
      # FP8_ENGINE_ARGS='{"fp8_gemm_backend": "..."}': a backend bench-fp8-gemm found faster than auto's (every variant)
      cmd=(timeout 580 python3 benchmarks/fp8_rollout.py rollout --variants "$v" --json "$logs/$stage.json"
           --engine-args "${FP8_ENGINE_ARGS:-null}") ;;
    bench-fp8-sync) cmd=(timeout 580 python3 benchmarks/fp8_rollout.py sync --json "$logs/$stage.json") ;;
    bench-fp8-table) cmd=(bash -c 'python3 benchmarks/fp8_rollout.py table "$0"/bench-fp8-*.json' "$logs") ;;
    gateway-bench) cmd=(timeout 580 python3 -m pytest -q -s -m gpu tests/e2e/test_gpu_gateway.py -k test_a
                        -p no:cacheprovider) ;;
    gateway-train) cmd=(timeout 580 python3 -m pytest -q -s -m gpu tests/e2e/test_gpu_gateway.py -k test_b
                        -p no:cacheprovider) ;;
    lora-smoke) cmd=(python3 -m pytest -x -q -s -m gpu packages/rollout-sglang/tests/test_sglang_lora_gpu.py -k smoke
                     -p no:cacheprovider) ;;
    lora) cmd=(python3 -m pytest -x -q -s -m gpu packages/rollout-sglang/tests/test_sglang_lora_gpu.py -p no:cacheprovider) ;;
    megatron) cmd=(python3 -m pytest -x -q -s -m gpu packages/trainer-megatron/tests/test_megatron_gpu.py -p no:cacheprovider) ;;
    megatron-lora) cmd=(python3 -m pytest -x -q -s -m gpu packages/trainer-megatron/tests/test_megatron_gpu.py -k lora -p no:cacheprovider) ;;
    e2e) cmd=(python3 -m pytest -x -q -s -m gpu tests/e2e/test_gpu_e2e.py -p no:cacheprovider) ;;
    conformance) cmd=(python3 -m pytest -x -q -s -m gpu packages/rollout-sglang/tests/test_sglang_gpu_conformance.py -p no:cacheprovider) ;;
    # ~2.6 min a family (an SGLang server each): the MLA families get a call of their own
    moe-sync) cmd=(python3 -m pytest -x -q -s -m gpu tests/e2e/test_gpu_moe_sync.py -k "not deepseek" -p no:cacheprovider) ;;
    moe-sync-deepseek) cmd=(python3 -m pytest -x -q -s -m gpu tests/e2e/test_gpu_moe_sync.py -k deepseek
                            -p no:cacheprovider) ;;
    mla-varlen) cmd=(python3 -m pytest -x -q -s -p no:cacheprovider packages/trainer-megatron/tests/test_megatron_mla.py
                     packages/trainer-megatron/tests/test_megatron_deepseek_v2.py) ;;
    # The CUDA parity alone, then the CPU tests on the bundle's megatron-core and transformers in a call of their
    # own with the GPU hidden, as on the CPU machine (2026-12-05: the two together ran past a 450 s call with one
    # failure unread). SIGINT at the limit: pytest still prints the failures it has.
    vlm) cmd=(timeout --signal=INT 400 python3 -m pytest -q -s -rf -p no:cacheprovider
              packages/trainer-megatron/tests/test_megatron_vlm_gpu.py) ;;
    vlm-cpu019) cmd=(env CUDA_VISIBLE_DEVICES= timeout --signal=INT 560 python3 -m pytest -q -rf --durations=15
                     -p no:cacheprovider packages/trainer-megatron/tests/test_megatron_vlm.py
                     packages/trainer-megatron/tests/test_megatron_qwen3_vl.py) ;;
    bench-vlm) cmd=(timeout 500 python3 benchmarks/vlm_trainer_throughput.py --device cuda --shape qwen2.5-vl-3b-reduced
                    --samples 32 --images 2 --grid 32 32 --response-len 256 --max-tokens-per-gpu 8192
                    --baseline-micro-batch-size 4) ;;
    restore-copy) cmd=(python3 -m pytest -x -q -s -m gpu packages/rollout-sglang/tests/test_restore_copy.py
                       packages/rollout-sglang/tests/test_adapter_folders.py -p no:cacheprovider) ;;
    sglang-pause) cmd=(python3 -m pytest -x -q -s -m gpu packages/rollout-sglang/tests/test_sglang_gpu_pause.py -p no:cacheprovider) ;;
    sglang-d) cmd=(python3 -m pytest -x -q -s -m gpu packages/rollout-sglang/tests/test_sglang_gpu.py -k test_d -p no:cacheprovider) ;;
    e2e-lora) cmd=(python3 -m pytest -x -q -s -m gpu tests/e2e/test_gpu_e2e.py -k test_g_lora -p no:cacheprovider) ;;
    e2e-lora-1.5b) cmd=(python3 -m pytest -x -q -s -m gpu tests/e2e/test_gpu_e2e.py -k "test_g_lora and 1.5b" -p no:cacheprovider) ;;
    e2e-offload) cmd=(python3 -m pytest -x -q -s -m gpu "tests/e2e/test_gpu_e2e.py::test_f_colocated_grpo_through_slime_cli[offload]" -p no:cacheprovider) ;;
    bench-trainer) cmd=(python3 benchmarks/trainer_throughput.py --device cuda --shape qwen2.5-1.5b --samples 16
                        --prompt-len 512 --response-len 512 --jitter 0 --micro-batch-size 16 --max-tokens-per-gpu 16384
                        --memory-tokens 16384 --profile 25) ;;
    bench-attention) cmd=(python3 benchmarks/packed_attention.py --device cuda --repeats 20) ;;
    trainer-varlen) cmd=(python3 -m pytest -x -q -s -m gpu packages/trainer-megatron/tests/test_megatron_gpu.py
                         -k "varlen or log_probs_match" -p no:cacheprovider) ;;
    cp-varlen) cmd=(python3 -m pytest -x -q -s -m gpu packages/trainer-megatron/tests/test_megatron_gpu.py
                    -k context_parallel -p no:cacheprovider) ;;
    # CPU tests (gloo) on the bundle's megatron-core: the GPU hidden as on the CPU machine, SIGINT at the limit
    sp-megatron019) cmd=(env CUDA_VISIBLE_DEVICES= timeout --signal=INT 560 python3 -m pytest -q -rf --durations=10
                         -m "slow or not slow" -p no:cacheprovider
                         packages/trainer-megatron/tests/test_megatron_sequence_parallel.py) ;;
    bench-trainer-short) cmd=(python3 benchmarks/trainer_throughput.py --device cuda --shape smollm2-135m --samples 128
                              --prompt-len 34 --response-len 6 --jitter 4 --max-tokens-per-gpu 8192
                              --baseline-micro-batch-size 128 --skip-memory --peak-tflops 989 --profile 15) ;;
    bench-trainer-packed) cmd=(python3 benchmarks/trainer_throughput.py --device cuda --shape qwen2.5-1.5b
                               --samples 32 --prompt-len 256 --response-len 512 --jitter 240
                               --max-tokens-per-gpu 16384 --baseline-micro-batch-size 16 --skip-memory) ;;
    bench-trainer-mix) cmd=(timeout 570 python3 benchmarks/trainer_throughput.py --device cuda --shape qwen2.5-1.5b --mix
                            --samples 128 --max-tokens-per-gpu 16384 --skip-memory --peak-tflops 989 --profile 15) ;;
    long-train) cmd=(timeout 400 python3 benchmarks/long_sample_train.py --device cuda --shape qwen2.5-1.5b
                     --lengths 32768 65536 --prompt-len 1024 --steps 2) ;;
    long-loop) cmd=(timeout 560 python3 -m pytest -x -q -s -m gpu tests/e2e/test_gpu_e2e.py -k test_h_long -p no:cacheprovider) ;;
    long-logprobs) cmd=(timeout 570 python3 benchmarks/long_logprobs_memory.py --device cuda --hidden 1536 --dtype bfloat16
                        --lengths 16384,32768,65536,131072) ;;
    bench-moe) cmd=(python3 benchmarks/trainer_throughput.py --device cuda --shape qwen3-30b-a3b-reduced --samples 16
                    --prompt-len 512 --response-len 512 --jitter 0 --micro-batch-size 8 --peak-tflops 989 --skip-memory) ;;
    bench-moe-ab) cmd=(bash scripts/gpu/moe_ab.sh "$logs") ;;
    profile-moe) cmd=(timeout 300 python3 benchmarks/moe_step_profile.py --device cuda --shape qwen3-30b-a3b-reduced
                      --samples 16 --prompt-len 512 --response-len 512 --micro-batch-size 8 --top 25
                      --variants as-is megatron-dispatch) ;;
    moe-replay) cmd=(timeout 400 python3 benchmarks/moe_replay_gap.py --shape qwen3-30b-a3b-reduced --prompts 16
                     --new-tokens 64 --work-dir /tmp/moe-replay) ;;
    # 32.7 GiB of weights, gradients and Adam states for each contender, held one at a time (deepseek_shapes.py):
    # micro-batches of 4 x 1,024 tokens keep the activations within the rest of an 80 GB card
    bench-deepseek) cmd=(timeout 500 python3 benchmarks/trainer_throughput.py --device cuda --shape deepseek-v3-reduced
                         --samples 16 --prompt-len 512 --response-len 512 --jitter 0 --micro-batch-size 4
                         --peak-tflops 989 --skip-memory --profile 15) ;;
    deepseek-replay) cmd=(timeout 500 python3 benchmarks/moe_replay_gap.py --shape deepseek-v3-reduced --prompts 16
                          --new-tokens 64 --work-dir /tmp/deepseek-replay) ;;
    bench-sync-1.5b) cmd=(timeout 200 python3 benchmarks/weight_sync.py --shape qwen2.5-1.5b --bucket-mb 2048
                          --mem-fraction 0.1 --json "$logs/bench-sync-1.5b.json") ;;
    bench-sync) cmd=(timeout 330 python3 benchmarks/weight_sync.py --shape qwen2.5-7b --bucket-mb 512 2048 4096
                     --json "$logs/bench-sync.json") ;;
    bench-sync-7b) cmd=(timeout 250 python3 benchmarks/weight_sync.py --shape qwen2.5-7b --bucket-mb 2048
                        --json "$logs/bench-sync-7b.json") ;;
    bench-sync-small) cmd=(timeout 250 python3 benchmarks/weight_sync.py --shape qwen2-tiny qwen3-tiny llama-tiny
                           qwen2.5-1.5b --bucket-mb 512 2048 --mem-fraction 0.1 --json "$logs/bench-sync-small.json") ;;
    bench-sync-lora) cmd=(timeout 400 python3 benchmarks/weight_sync.py --shape qwen2.5-1.5b --bucket-mb 2048
                          --paths direct trainer adapter adapter-engine disk adapter-disk --lora-rank 16 --mem-fraction 0.3
                          --json "$logs/bench-sync-lora.json") ;;
    bench-step) cmd=(python3 benchmarks/colocated_step.py --prompts 32 --samples 8 --prompt-len 1024 --response-len 512
                     --timeout 400 --json "$logs/bench-step.json") ;;
    bench-step-nographs) cmd=(python3 benchmarks/colocated_step.py --prompts 32 --samples 8 --prompt-len 1024
                              --response-len 512 --cuda-graphs off --timeout 300 --json "$logs/bench-step-nographs.json") ;;
    bench-affinity) cmd=(timeout 420 python3 benchmarks/agent_affinity.py --gpus 0 0) ;;
    bench-async) cmd=(timeout 570 python3 benchmarks/async_speedup.py --json "$logs/bench-async.json") ;;
    bench-async-x2) cmd=(timeout 570 python3 benchmarks/async_speedup.py --gpus 2 --json "$logs/bench-async-x2.json") ;;
    bench-async-kill) cmd=(timeout 300 python3 benchmarks/async_speedup.py --modes fully --groups 64 --kill-engine-after 15
                           --json "$logs/bench-async-kill.json") ;;
    bench-rollout) cmd=(python3 benchmarks/rollout_throughput.py --logs-to "$logs/rollout-logs") ;;
    bench-rollout-one-wave) cmd=(python3 benchmarks/rollout_throughput.py --requests 256 --rounds 3 --logs-to "$logs/rollout-logs") ;;
    real-model) cmd=(bash scripts/gpu/real_model.sh "$logs" addition chain_sum) ;;
    real-model-addition) cmd=(bash scripts/gpu/real_model.sh "$logs" addition) ;;
    real-model-chain-sum) cmd=(bash scripts/gpu/real_model.sh "$logs" chain_sum) ;;
    vlm-e2e) cmd=(timeout 580 python3 -m pytest -x -q -s -m gpu tests/e2e/test_gpu_vlm_e2e.py -p no:cacheprovider) ;;
    vlm-sglang) cmd=(timeout 500 python3 -m pytest -x -q -s -m gpu packages/rollout-sglang/tests/test_sglang_vision_gpu.py
                     -p no:cacheprovider) ;;
    roles-sglang) cmd=(python3 -m pytest -x -q -s -m gpu packages/rollout-sglang/tests/test_sglang_roles_gpu.py
                  -p no:cacheprovider) ;;
    ppo-real-model) cmd=(bash scripts/gpu/multi_model.sh "$logs" ppo) ;;
    # the model made ready first (real_model.sh with no task) in the cache the runs' builtin: path resolves in;
    # FP8_REAL_MODEL_DEADLINE_S: when the runs are stopped
    fp8-real-model) cmd=(bash -c 'export SLIME_RL_CACHE=${SLIME_RL_CACHE:-/tmp/slime-rl-cache}
                         bash scripts/gpu/real_model.sh "$0" && python3 benchmarks/fp8_real_model.py run \
                         --logs "$0" --deadline "${FP8_REAL_MODEL_DEADLINE_S:-480}"' "$logs") ;;
    opd-teacher) cmd=(bash scripts/gpu/multi_model.sh "$logs" teacher) ;;
    opd-student) cmd=(bash scripts/gpu/multi_model.sh "$logs" student) ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  if [ -n "${GPU_STAGES_DRY:-}" ]; then printf '%s\t' "$stage"; printf '%q ' "${cmd[@]}"; echo; continue; fi
  stamp=$(mktemp); "${cmd[@]}" > "$logs/$stage.log" 2>&1; rc=$?
  grep -E "PASS|FAIL|Error|error|\[|passed|failed|\|" "$logs/$stage.log" | tail -n 60
  # the SGLang servers' own logs of this stage (timestamped: where a server's ~90 s start goes), at most 40
  find /tmp -name 'sglang-engine-*.log' -newer "$stamp" 2>/dev/null | head -n 40 |
    tar -czf "$logs/$stage-sglang-logs.tgz" -T - 2>/dev/null || true
  rm -f "$stamp"
  echo "=== $stage exit $rc"; [ $rc = 0 ] || status=1
done
exit $status
