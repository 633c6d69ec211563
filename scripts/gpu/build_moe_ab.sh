#!/usr/bin/env bash
# Here, before the GPU call of stage bench-moe-ab: the code that an earlier bench-moe record ran, for the
# stage to run beside this tree. Writes .gpu/ab-COMMIT/ (git-ignored; name it in the call's carry):
# every package's src/ at COMMIT (the record's wheels held the same files) and that commit's
# benchmarks/trainer_throughput.py. COMMIT defaults to 4342bcc, the 73,352 tokens/s record of 2026-12-03.
#   bash scripts/gpu/build_moe_ab.sh [COMMIT]
set -euo pipefail
commit=${1:-4342bcc}
out=.gpu/ab-$commit
git rev-parse --verify -q "$commit^{commit}" > /dev/null || { echo "build_moe_ab: no commit $commit here"; exit 2; }
rm -rf "$out" && mkdir -p "$out"
paths=(benchmarks/trainer_throughput.py)
for src in $(git ls-tree -d --name-only "$commit" packages/); do paths+=("$src/src"); done
git archive "$commit" -- "${paths[@]}" | tar -x -C "$out"
git rev-parse "$commit" > "$out/COMMIT"
echo "build_moe_ab: $(du -sh "$out" | cut -f1) in $out ($(ls -d "$out"/packages/*/src | wc -l) packages at $commit)"
