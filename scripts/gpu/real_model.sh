#!/usr/bin/env bash
# Issue 16's real-model run on the GPU machine: the `real-model` stages of scripts/gpu/run.sh.
#   bash scripts/gpu/real_model.sh LOGDIR TASK...       (TASK: addition, chain_sum)
#   bash scripts/gpu/real_model.sh LOGDIR               (no task: only make the model ready, for fp8-real-model)
# Joins the SmolLM2-135M-Instruct GGUF from the pieces carried by earlier calls (/tmp/smol-pieces, or .gpu/smol-N
# in this one) and checks its sha256 against .gpu/smol-data/smollm2.manifest.json (scripts/gpu/pack_smollm2.sh
# wrote both), converts it the way the CPU default does (builtin_models.install_from_gguf, into the cache that
# `builtin:smollm2-135m-instruct` resolves to), then trains each TASK through `slime-cli train` with
# examples/smollm2_gpu_TASK.yaml: SGLang and Megatron colocated on one GPU, held-out pass@1 before, every 10 steps
# and after, the train/rollout log-prob gap at every step. Each run's logs and metrics.jsonl go to
# LOGDIR/real-model/TASK, the metrics copied to LOGDIR/real-model-TASK-metrics.jsonl; last,
# benchmarks/plot_logprob_gap.py prints every step's gap, its trend and the evals.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: real_model.sh LOGDIR [TASK...] (TASK: addition, chain_sum)" >&2; exit 2; }
logs=$1; shift
manifest=.gpu/smol-data/smollm2.manifest.json
[ -f "$manifest" ] || { echo "error: $manifest is missing: carry .gpu/smol-data (bash scripts/gpu/pack_smollm2.sh)" >&2; exit 2; }
export SLIME_RL_CACHE=${SLIME_RL_CACHE:-/tmp/slime-rl-cache}  # survives to the next call, like /tmp/site
model=$SLIME_RL_CACHE/models/smollm2-135m-instruct
began=$(date +%s)
if [ ! -f "$model/config.json" ]; then
  gguf=$SLIME_RL_CACHE/gguf/$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['file'])" "$manifest")
  # shellcheck disable=SC2046  # the pieces carried in this call, if any
  python3 scripts/gpu/smol_pieces.py join "$manifest" --search "${SMOL_PIECES_DIR:-/tmp/smol-pieces}" \
    $(ls -d .gpu/smol-[0-9]* 2>/dev/null) \
    --to "$gguf" || exit 1
  python3 -c "import sys; from slime_rl.core.config.builtin_models import install_from_gguf as i; print('[real-model] converted:', i('smollm2-135m-instruct', sys.argv[1]))" \
    "$gguf" || exit 1
fi
echo "[real-model] model ready in $(( $(date +%s) - began )) s: $model"
status=0
runs=()
for task in "$@"; do
  config=examples/smollm2_gpu_$task.yaml
  [ -f "$config" ] || { echo "error: no $config (tasks: addition, chain_sum)" >&2; exit 2; }
  run=$logs/real-model/$task
  start=$(date +%s)
  # SIGINT at the time limit: slime-cli shuts its run down on an interrupt (with SIGTERM, Ray's workers and the
  # servers were left behind, holding the GPU from the next task)
  # shellcheck disable=SC2086  # REAL_MODEL_OVERRIDES: extra key=value overrides, e.g. data.num_rollout=20
  timeout -s INT -k 30 "${REAL_MODEL_TASK_TIMEOUT_S:-540}" python3 -m slime_rl.cli.app train "$config" "logging.dir=$run" \
    ${REAL_MODEL_OVERRIDES:-}
  rc=$?
  echo "[real-model] $task: exit $rc after $(( $(date +%s) - start )) s (slime-cli train, startup included)"
  [ $rc = 0 ] || status=1
  # a copy one level up: a device call brings back only files at most two folders below $OUT
  if [ -f "$run/metrics.jsonl" ]; then
    runs+=("$run/metrics.jsonl")
    cp "$run/metrics.jsonl" "$logs/real-model-$task-metrics.jsonl"
  fi
done
[ ${#runs[@]} = 0 ] || python3 benchmarks/plot_logprob_gap.py --no-plot "${runs[@]}" || status=1
echo "[real-model] total $(( $(date +%s) - began )) s"
exit $status
