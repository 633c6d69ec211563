#!/usr/bin/env bash
# Stage bench-moe-ab of run.sh (issue 35, item 4): bench-moe run by the code of an earlier record and by this
# tree, in turns in one call, so that the two figures share the machine, the GPU and the hour. The earlier
# code is .gpu/ab-COMMIT/ (scripts/gpu/build_moe_ab.sh, run before the call; carry it): its packages' sources
# go ahead of /tmp/site on PYTHONPATH (slime_rl is a namespace package, so its modules shadow the tree's
# wheels) and its own benchmark script runs them. megatron-core, torch and transformers are the machine's.
#   bash scripts/gpu/moe_ab.sh LOGDIR        (AB_COMMIT=4342bcc, AB_ROUNDS=1; AB_ARGS replaces bench-moe's
#                                             arguments, e.g. "--device cpu --shape tiny-moe" for a dry run)
# Each side is one bench-moe run (the first also writes the random model to /tmp, which the others reuse),
# at most 240 s each; with profile-moe after it a call may reach its 600 s: then run the two stages in two
# calls, the second within 30 s of the first (the machine and /tmp stay).
set -u
logs=${1:-/tmp/gpu-logs}; commit=${AB_COMMIT:-4342bcc}; rounds=${AB_ROUNDS:-1}; old=.gpu/ab-$commit
if [ ! -d "$old/packages" ]; then
  echo "moe_ab: no $old; run 'bash scripts/gpu/build_moe_ab.sh $commit' before the call and carry $old"; exit 2
fi
old_path=$(ls -d "$PWD/$old"/packages/*/src | tr '\n' ':')
read -r -a args <<< "${AB_ARGS:---device cuda --shape qwen3-30b-a3b-reduced --samples 16 --prompt-len 512 --response-len 512 --jitter 0 --micro-batch-size 8 --peak-tflops 989 --skip-memory}"
where=$(PYTHONPATH="$old_path${PYTHONPATH:-}" python3 -c "import slime_rl.trainer_megatron.moe as m; print(m.__file__)")
case $where in "$PWD/$old"/*) echo "moe_ab: $commit's code from $old" ;; *) echo "moe_ab: $old does not shadow $where"; exit 2 ;; esac
status=0
for round in $(seq "$rounds"); do
  for side in "$commit" tree; do
    echo "## round $round: $side ($(date -u +%TZ)); load $(cut -d' ' -f1-3 /proc/loadavg); busiest processes:"
    # what else holds this machine's CPUs or GPU: a leftover server slows a launch-bound trainer, not a GPU-bound one
    top -b -n 1 -o %CPU 2>/dev/null | sed -n '7,10p'
    nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu,memory.used --format=csv,noheader 2>/dev/null
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null
    if [ "$side" = tree ]; then
      timeout 240 python3 benchmarks/trainer_throughput.py "${args[@]}" > "$logs/bench-moe-ab-$side-$round.log" 2>&1
    else
      PYTHONPATH="$old_path${PYTHONPATH:-}" timeout 240 python3 "$old/benchmarks/trainer_throughput.py" "${args[@]}" \
        > "$logs/bench-moe-ab-$side-$round.log" 2>&1
    fi
    rc=$?; [ $rc = 0 ] || { echo "moe_ab: $side exit $rc"; status=1; }
    grep -E "^\| |MoE experts|megatron / transformers|Error" "$logs/bench-moe-ab-$side-$round.log"
  done
done
exit $status
