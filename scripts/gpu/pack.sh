#!/usr/bin/env bash
# Build .gpu/ for the GPU machine (docs/gpu-results.md says how the two calls carry it): .gpu/sgl holds the SGLang
# bundle, unpacked by a first call; .gpu/rest holds Ray, megatron-core 0.19.2, the sglang-router 0.3.2 wheel
# (SGLangEngine starts the router from it) and slime-rl's own wheels of this tree, rebuilt on every run so a GPU
# run never tests an older commit. Run from anywhere:  bash scripts/gpu/pack.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
bundles=${SLIME_RL_GPU_BUNDLES:-$(cd .. && pwd)/shared/gpu}
router=sglang-router==0.3.2

exclude="$(git rev-parse --git-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")" .gpu/sgl .gpu/rest/wheels
grep -qx "/.gpu/" "$exclude" 2>/dev/null || echo "/.gpu/" >> "$exclude"  # never committed

cp -n "$bundles"/sglang-*-site.tar.xz .gpu/sgl/
cp -n "$bundles"/ray-*-site.tar.xz "$bundles"/megatron_core-*.whl .gpu/rest/
if ! ls .gpu/rest/wheels/sglang_router-*.whl >/dev/null 2>&1; then
  # The GPU machine has no package index: the router's wheel travels (manylinux, abi3, ~30 MB)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 -d .gpu/rest/wheels "$router"
fi
rm -f .gpu/rest/wheels/slime_rl_*.whl
python3 -m pip wheel -q --no-deps -w .gpu/rest/wheels packages/*

tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
for part in sgl rest; do
  size=$(du -sb ".gpu/$part" | cut -f1)
  echo ".gpu/$part: $((size >> 20)) MiB; with the tree ($((tree >> 20)) MiB): $(((size + tree) >> 20)) of 64 MiB a call"
done
echo "wheels of $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' + uncommitted changes')"
