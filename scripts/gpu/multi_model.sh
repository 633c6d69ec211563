#!/usr/bin/env bash
# Issue 39 on one H200, more than one model in a run (stages ppo-real-model, opd-teacher, opd-student of
# scripts/gpu/run.sh; each under 10 minutes, one device call each; pack the real-model data first):
#   bash scripts/gpu/multi_model.sh LOGDIR ppo       # PPO (GAE, a critic beside the actor) on the addition task
#   bash scripts/gpu/multi_model.sh LOGDIR teacher   # the real-model addition run (GRPO), its last step saved as HF
#   bash scripts/gpu/multi_model.sh LOGDIR student   # the untrained SmolLM2 distilled from it: opd, teacher on SGLang
# The teacher's folder stays in /tmp/opd-teacher for the next call (the machine stays warm between calls; a
# fresh machine needs opd-teacher again). The student's run starts the teacher's server after its own engine is
# healthy, colocated on the same GPU (mem_fraction_static 0.15 + 0.10), and prints the KL curve and the step's
# time split (teacher prefill, rollout, train: benchmarks/opd_curve.py).
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: multi_model.sh LOGDIR ppo|teacher|student" >&2; exit 2; }
logs=$1; what=$2
teacher=${OPD_TEACHER_DIR:-/tmp/opd-teacher}
export SLIME_RL_CACHE=${SLIME_RL_CACHE:-/tmp/slime-rl-cache}
case $what in
  ppo)  # the critic starts from the policy; its value loss and the held-out pass@1 are in the run's metrics.jsonl
    REAL_MODEL_OVERRIDES="algorithm.advantage_estimator=ppo algorithm.normalize_advantages=true algorithm.lambd=0.95
      trainer.critic_lr=1e-4" bash scripts/gpu/real_model.sh "$logs/ppo" addition
    rc=$?
    # printed too (real_model.sh copies the metrics to $logs/ppo/real-model-addition-metrics.jsonl)
    python3 -c "import json, sys; v = [r['critic/value_loss'] for r in map(json.loads, open(sys.argv[1])) if 'critic/value_loss' in r]; print('[ppo] critic value loss per step:', ' '.join(f'{x:.4f}' for x in v))" \
      "$logs/ppo/real-model/addition/metrics.jsonl" || rc=1
    exit $rc ;;
  teacher)
    rm -rf "$teacher/checkpoints"  # a rerun on the same machine: the run refuses a folder of an earlier run's
    REAL_MODEL_OVERRIDES="checkpoint.save_hf=true checkpoint.save_dir=$teacher/checkpoints" \
      bash scripts/gpu/real_model.sh "$logs/opd-teacher" addition
    rc=$?
    # $OUT is new in every call: the teacher's evals stay with its folder for the student's call
    cp "$logs/opd-teacher/real-model/addition/metrics.jsonl" "$teacher/teacher_metrics.jsonl" 2>/dev/null
    exit $rc ;;
  student)
    hf=$(ls -d "$teacher"/checkpoints/step_*/hf 2>/dev/null | sort | tail -1)
    [ -n "$hf" ] || { echo "error: no teacher in $teacher: run the opd-teacher stage first (same machine)" >&2; exit 2; }
    run=$logs/opd/student
    role="{teacher: {kind: teacher, path: $hf, engine: sglang, colocate: true, engine_args: {attention_backend: triton,"
    role+=" sampling_backend: pytorch, grammar_backend: none, cuda_graph_backend_decode: disabled,"
    role+=" cuda_graph_backend_prefill: disabled, mem_fraction_static: 0.1, max_total_tokens: 65536}}}"
    timeout -s INT -k 30 "${OPD_TIMEOUT_S:-540}" python3 -m slime_rl.cli.app train examples/smollm2_gpu_addition.yaml \
      "logging.dir=$run" algorithm.advantage_estimator=opd "roles=$role" ${OPD_OVERRIDES:-}
    rc=$?
    cp "$run/metrics.jsonl" "$logs/opd-student-metrics.jsonl" 2>/dev/null  # the run's folder is too deep to come back
    teacher_eval=$(python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print([v for x in r for k,v in x.items() if k.endswith('pass@1')][-1])" \
      "$teacher/teacher_metrics.jsonl" 2>/dev/null || echo "")
    python3 benchmarks/opd_curve.py "$run/metrics.jsonl" ${teacher_eval:+--teacher-eval "$teacher_eval"} || rc=1
    exit $rc ;;
  *) echo "usage: multi_model.sh LOGDIR ppo|teacher|student" >&2; exit 2 ;;
esac
