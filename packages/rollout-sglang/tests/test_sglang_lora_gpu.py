"""GPU checks of SGLang's LoRA path (issue 20) with a real SGLang 0.5.17 server and a tiny random Llama
made on the spot (the H200 machine; ``bash scripts/gpu/run.sh lora-smoke lora``).

- ``test_smoke_*`` (stage lora-smoke): the bundle's LoRA kernels load and run: a server started with the
  flags slime-rl gives it (`adapters.lora_engine_args`) takes an adapter from tensors (CUDA IPC), from a
  PEFT folder, and unloads it; generating with the adapter differs from the base; an adapter with B = 0
  gives the base's log-probs; the same adapter from tensors and from a folder gives the same tokens;
  SGLang's log-probs with the adapter match an HF forward of the merged weights (mean abs gap <= 0.02, bf16).
- ``test_engine_*`` (stage lora): the same through `SGLangEngine` and the router: adapter syncs per version,
  requests naming the current adapter, the old one unloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from slime_rl.core.algorithms.lora import LoraSpec, adapter_name, merged, peft_name
from slime_rl.core.contracts import SamplingParams
from slime_rl.rollout_sglang.client import build_payload, parse_response
from slime_rl.rollout_sglang.keys import EngineKeys, bearer
from slime_rl.rollout_sglang.server import start_server, wait_healthy
from slime_rl.rollout_sglang.weights import adapters
from slime_rl.rollout_sglang.weights.server_api import Target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

SPEC = LoraSpec(rank=8, alpha=16.0, dropout=0.0,
                target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
PROMPTS = [[1, 17 + i, 230, 41 + 3 * i, 512, 9] for i in range(8)]
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


def target_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The HF weights an adapter of `SPEC` sits beside: ``...q_proj.weight`` -> [out, in], on the GPU."""
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(file), device="cuda"))
    return {n: w for n, w in weights.items() if any(f".{m}.weight" in n for m in SPEC.target_modules)}


def random_adapter(weights: dict[str, torch.Tensor], *, seed: int, zero_b: bool = False) -> list[tuple[str, torch.Tensor]]:
    """PEFT-named A [rank, in] and B [out, rank] for every target weight, bf16 on the GPU; large enough
    (|scaling * B A| about the weights' own size) that the outputs change."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensors = []
    for name, w in sorted(weights.items()):
        out_dim, in_dim = w.shape
        a = torch.randn(SPEC.rank, in_dim, generator=gen, device="cuda") * 0.05
        b = torch.zeros(out_dim, SPEC.rank, device="cuda") if zero_b else \
            torch.randn(out_dim, SPEC.rank, generator=gen, device="cuda") * 0.05
        tensors += [(peft_name(name, "A"), a.to(torch.bfloat16)), (peft_name(name, "B"), b.to(torch.bfloat16))]
    return tensors


def generate(server_url: str, api_key: str, prompt: list[int], params: SamplingParams, lora: str | None):
    payload = build_payload(prompt, params, f"lora-smoke-{uuid.uuid4().hex}")
    if lora is not None:
        payload["lora_path"] = lora
    resp = httpx.post(f"{server_url}/generate", json=payload, headers=bearer(api_key), timeout=120)
    assert resp.status_code == 200, f"/generate with lora_path={lora}: HTTP {resp.status_code}: {resp.text[:500]}"
    return parse_response(resp.json(), default_version=0)


def reference_log_probs(model_dir: Path, adapter: list[tuple[str, torch.Tensor]] | None,
                        prompts: list[list[int]], outs) -> list[torch.Tensor]:
    """An HF forward (bf16) of the base with the adapter merged in (`slime_rl.core.algorithms.lora.merged`): the log-prob
    of each sampled token (temperature 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    if adapter is not None:
        pairs = dict(adapter)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, w in params.items():
                a_name = peft_name(name, "A") if name.endswith(".weight") else None
                if a_name in pairs:
                    w.copy_(merged(w, pairs[a_name], pairs[peft_name(name, "B")], SPEC.scaling))
    result = []
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids], device="cuda")).logits[0, len(prompt) - 1:-1]
        ids = torch.tensor(out.token_ids, device="cuda")[:, None]
        result.append(torch.log_softmax(logits.float(), -1).gather(1, ids)[:, 0].cpu())
    return result


@contextlib.contextmanager
def log_on_failure(server):
    """The server's log tail with any failure (what SGLang said is in there)."""
    try:
        yield
    except BaseException:
        print(f"\n{server.name} log tail:\n{server.process.log_tail(150)}")
        raise


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from test_sglang_gpu import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-lora"))


@pytest.fixture(scope="module")
def lora_server(tiny_llama, tmp_path_factory):
    """One SGLang server with the run's keys and slime-rl's LoRA flags."""
    from test_sglang_gpu import ENGINE_ARGS

    keys = EngineKeys.generate()
    args = {**ENGINE_ARGS, **adapters.lora_engine_args(SPEC)}
    server = start_server(0, str(tiny_llama), log_dir=tmp_path_factory.mktemp("lora-logs"), engine_args=args,
                          gpu_ids=[0], keys=keys)
    try:
        wait_healthy(server, 600)
    except BaseException:
        print(server.process.log_tail(120))
        server.process.stop()
        raise
    yield server, Target(server.name, server.url, 1, admin_key=keys.admin_key, api_key=keys.api_key)
    server.process.stop()


def test_smoke_lora_kernels_load_and_run(lora_server, tiny_llama, tmp_path):
    server, target = lora_server
    with log_on_failure(server):
        check_kernels(server, target, tiny_llama, tmp_path)


def check_kernels(server, target: Target, tiny_llama: Path, tmp_path: Path) -> None:
    key = server.keys.api_key
    weights = target_weights(tiny_llama)
    assert len(weights) == 7 * 2, sorted(weights)  # 7 projections x 2 layers
    adapter, zero = random_adapter(weights, seed=1), random_adapter(weights, seed=2, zero_b=True)
    adapters.load_adapter_from_tensors(target, "smoke-a", adapter, SPEC, base_model=str(tiny_llama),
                                       timeout=120, step="smoke")
    adapters.load_adapter_from_tensors(target, "smoke-zero", zero, SPEC, base_model=str(tiny_llama),
                                       timeout=120, step="smoke")
    folder = adapters.save_adapter_folder(adapter, tmp_path / "smoke-a", SPEC, str(tiny_llama))
    adapters.load_adapter_from_folder(target, "smoke-a-disk", folder, timeout=120, step="smoke")
    base = [generate(server.url, key, p, SAMPLED, None) for p in PROMPTS]
    zero_outs = [generate(server.url, key, p, GREEDY, "smoke-zero") for p in PROMPTS]
    base_greedy = [generate(server.url, key, p, GREEDY, None) for p in PROMPTS]
    with_a = [generate(server.url, key, p, SAMPLED, "smoke-a") for p in PROMPTS]
    greedy_a = [generate(server.url, key, p, GREEDY, "smoke-a").token_ids for p in PROMPTS]
    greedy_disk = [generate(server.url, key, p, GREEDY, "smoke-a-disk").token_ids for p in PROMPTS]
    greedy_base = [o.token_ids for o in base_greedy]

    # B = 0: the base's greedy tokens and log-probs (compared where the tokens agree: a near-uniform tiny
    # model may flip a near-tie, which the count shows)
    same = [(z, b) for z, b in zip(zero_outs, base_greedy, strict=True) if z.token_ids == b.token_ids]
    zero_gap = torch.cat([torch.tensor(z.log_probs) - torch.tensor(b.log_probs) for z, b in same]).abs() \
        if same else torch.tensor([math.inf])
    ref_base = reference_log_probs(tiny_llama, None, PROMPTS, base)
    ref_a = reference_log_probs(tiny_llama, adapter, PROMPTS, with_a)
    base_gap = torch.cat([r - torch.tensor(o.log_probs) for r, o in zip(ref_base, base, strict=True)]).abs()
    a_gap = torch.cat([r - torch.tensor(o.log_probs) for r, o in zip(ref_a, with_a, strict=True)]).abs()
    # what the adapter changes: SGLang's base log-probs of the adapter's tokens vs the adapter's own
    ref_base_on_a = reference_log_probs(tiny_llama, None, PROMPTS, with_a)
    shift = torch.cat([r - torch.tensor(o.log_probs) for r, o in zip(ref_base_on_a, with_a, strict=True)]).abs()
    print(f"\n(lora smoke) adapters loaded: smoke-a (IPC), smoke-zero (IPC), smoke-a-disk (folder); greedy tokens "
          f"differing from the base: {sum(a != b for a, b in zip(greedy_a, greedy_base, strict=True))}/8 prompts; "
          f"B=0 gives the base's tokens on {len(same)}/8 prompts, |log-prob| gap mean {zero_gap.mean():.2e} max {zero_gap.max():.2e}; SGLang vs HF merged "
          f"forward: with adapter mean {a_gap.mean():.4f} max {a_gap.max():.4f}, base mean {base_gap.mean():.4f}; "
          f"adapter vs base on the same tokens: mean {shift.mean():.4f}")
    assert greedy_a != greedy_base
    assert len(same) >= 6 and zero_gap.max() < 0.02
    assert greedy_disk == greedy_a  # the PEFT folder holds the same adapter
    assert a_gap.mean() <= 0.02 and shift.mean() > 5 * a_gap.mean()
    assert all(math.isfinite(lp) for o in with_a for lp in o.log_probs)

    for name in ("smoke-zero", "smoke-a-disk"):
        adapters.unload_adapter(target, name, timeout=60, step="smoke")
    info = httpx.get(f"{server.url}/v1/models", headers=bearer(key), timeout=30).json()
    served = {m["id"] for m in info.get("data", [])}
    print(f"(lora smoke) after unloading two: /v1/models lists {sorted(served)}")
    assert "smoke-a" in served and not {"smoke-zero", "smoke-a-disk"} & served


def test_smoke_failed_load_names_server_and_adapter(lora_server, tiny_llama):
    """A rank above --max-lora-rank is refused by SGLang; the error names the server and the adapter."""
    from slime_rl.rollout_sglang.weights.server_api import WeightSyncError

    _, target = lora_server
    big = LoraSpec(rank=2 * SPEC.rank, alpha=16.0, dropout=0.0, target_modules=SPEC.target_modules)
    weights = target_weights(tiny_llama)
    tensors = [(n, torch.cat([t, t], dim=0 if ".lora_A." in n else 1)) for n, t in random_adapter(weights, seed=3)]
    with pytest.raises(WeightSyncError) as err:
        adapters.load_adapter_from_tensors(target, adapter_name(99), tensors, big, base_model=str(tiny_llama),
                                           timeout=120, step="smoke")
    print(f"\n(lora smoke) refused: {err.value}")
    assert target.name in str(err.value) and adapter_name(99) in str(err.value)


def test_engine_adapter_sync_through_the_router(tiny_llama, tmp_path):
    """`SGLangEngine` with trainer.lora: two adapter syncs by CUDA IPC; requests name the current
    adapter and report its version; the first adapter is unloaded after the second loads."""
    from test_sglang_gpu import ENGINE_ARGS

    from slime_rl.core.config import Config
    from slime_rl.rollout_sglang.engine import SGLangEngine

    cfg = Config.model_validate({
        "model": {"path": str(tiny_llama)},
        "rollout": {"engine": "sglang", "max_concurrency": 64, "sglang": {"server_args": dict(ENGINE_ARGS)}},
        "trainer": {"lora": {"rank": SPEC.rank, "alpha": SPEC.alpha}},
        "cluster": {"device": "cuda", "colocate": True, "actor_num_gpus_per_node": 1, "rollout_num_gpus": 1,
                    "rollout_num_gpus_per_engine": 1},
        "logging": {"dir": str(tmp_path)},
    })
    engine = SGLangEngine.from_config(cfg)
    try:
        weights = target_weights(tiny_llama)

        async def run(prompts, params):
            return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

        base = asyncio.run(run(PROMPTS, GREEDY))
        for version, seed in ((1, 11), (2, 12)):
            adapter = random_adapter(weights, seed=seed)
            half = len(adapter) // 2
            asyncio.run(engine.update_weights(adapter[:half], version=version, last=False))
            asyncio.run(engine.update_weights(adapter[half:], version=version, last=True))
            outs = asyncio.run(run(PROMPTS, GREEDY))
            assert all(o.weight_version == version for o in outs)
            assert [o.token_ids for o in outs] != [o.token_ids for o in base]
        served = {m["id"] for m in httpx.get(f"{engine.engine_urls[0]}/v1/models",
                                             headers=bearer(engine.keys.api_key), timeout=30).json()["data"]}
        print(f"\n(lora engine) after v2: {sorted(served)}")
        assert adapter_name(2) in served and adapter_name(1) not in served
    finally:
        asyncio.run(engine.shutdown())


def test_smoke_client_and_standin_lora_shapes_match_this_sglang():
    """What the client sends and the CPU tests' stand-in (testing/lora.py) answers are this SGLang's LoRA
    request and response fields (managers/io_struct.py), flags (server_args.py) and modules (utils/common.py)."""
    import dataclasses

    import msgspec
    from sglang.srt.managers import io_struct
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.common import SUPPORTED_LORA_TARGET_MODULES

    def fields(cls) -> tuple[set[str], set[str]]:
        infos = msgspec.structs.fields(cls)
        return {f.name for f in infos}, {f.name for f in infos if f.required}

    sent = {  # the bodies adapters.py posts
        io_struct.LoadLoRAAdapterFromTensorsReqInput: {"lora_name", "config_dict", "serialized_named_tensors",
                                                       "load_format"},
        io_struct.LoadLoRAAdapterReqInput: {"lora_name", "lora_path"},
        io_struct.UnloadLoRAAdapterReqInput: {"lora_name"},
    }
    for cls, keys in sent.items():
        known, required = fields(cls)
        assert keys <= known and required <= keys, (cls.__name__, keys - known, required - keys)
    assert {"success", "error_message", "loaded_adapters"} <= fields(io_struct.LoRAUpdateOutput)[0]  # what we read
    assert "lora_path" in {f.name for f in dataclasses.fields(io_struct.GenerateReqInput)}
    flags = {f.name for f in dataclasses.fields(ServerArgs)}
    assert set(adapters.lora_engine_args(SPEC)) <= flags
    assert set(adapters.SGLANG_LORA_MODULES) <= set(SUPPORTED_LORA_TARGET_MODULES)
