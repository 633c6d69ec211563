#!/usr/bin/env bash
# Source this on the GPU machine (see docs/gpu-results.md): unpacks the bundles carried in .gpu/
# into /tmp/site, installs the megatron-core wheel and slime-rl's own wheels there, and sets the
# environment (Ray on loopback, NVLink multicast off).
set -e
mkdir -p /tmp/site
for f in .gpu/*/*.tar.xz; do
  [ -e "$f" ] || continue
  stamp="/tmp/site/.unpacked-$(basename "$f")"
  [ -e "$stamp" ] || { python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall('/tmp/site')" "$f" && touch "$stamp"; }
done
wheels=$(ls .gpu/*/*.whl .gpu/*/wheels/*.whl 2>/dev/null || true)
[ -z "$wheels" ] || python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site $wheels
export PYTHONPATH=/tmp/site RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0  # Ray on loopback; slime_rl.core sets its token (docs/config.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=/tmp/jitcache/triton TVM_FFI_CACHE_DIR=/tmp/jitcache/tvm FLASHINFER_WORKSPACE_BASE=/tmp/jitcache/fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
set +e
