"""GPU acceptance for SGLangEngine with a real SGLang 0.5.17 server (the H200 machine; see
../shared/gpu/README.md for the bundle). A tiny random Llama is made on the spot.

    python -m pytest packages/rollout-sglang/tests/test_sglang_gpu.py -m gpu -s

Items (issue 7): (a) token-in/token-out with log-probs through the router; (c) colocated
sync by CUDA IPC tensors, after which the engine's weights equal the trainer's and the
generations change; (d) NCCL sync across 2 GPUs; (e) release and resume memory with the
freed GiB reported; and disk sync. Each prints its figures (run with -s). Issue 14: the real
server refuses a weight update, a memory release and an abort without the run's keys, and
takes them with the keys.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from slime_rl.core.config import Config
from slime_rl.core.contracts import SamplingParams
from slime_rl.core.testing import save_model, stdlib_text, tiny_config, tiny_model, train_tokenizer
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.keys import bearer
from slime_rl.rollout_sglang.settings import SGLangSettings
from slime_rl.rollout_sglang.weights import ipc, server_api

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

VOCAB = 1024
# Quick functional runs (gpu/README.md): triton attention, pytorch sampling, no CUDA graphs, little memory.
# The KV pool is sized by max_total_tokens (mem_fraction_static only caps it): 2**20 tokens of the tiny
# Llama are 1 GiB, enough for (e) to see what release frees.
KV_TOKENS = 2**20
ENGINE_ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
               "cuda_graph_backend_decode": "disabled", "cuda_graph_backend_prefill": "disabled",
               "mem_fraction_static": 0.15, "max_total_tokens": KV_TOKENS}
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)


def make_tiny_llama(out: Path) -> Path:
    """A random 2-layer Llama (hidden 256, vocab 1024: more ids than its tokenizer has) and a byte-level
    BPE tokenizer trained offline on the Python standard library's sources."""
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    # line by line: the tokenizer of the recorded GPU runs was trained so
    lines = [line for text in stdlib_text(100) for line in text.splitlines(keepends=True)]
    tok = train_tokenizer(lines, vocab_size=VOCAB - 24, special_tokens=specials, bos_token=specials[0],
                          eos_token=specials[1], pad_token=specials[2])
    config = tiny_config("llama", vocab_size=VOCAB, hidden_size=256, num_layers=LAYERS, num_heads=4,
                         num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return save_model(out, tiny_model(config, seed=0), tok, dtype=torch.bfloat16)


def gpu_config(model: Path, work: Path, *, colocate: bool = True, engine_args: dict | None = None,
               **rollout) -> Config:
    """``rollout`` holds core's rollout keys and rollout.sglang's; ``engine_args`` its server_args."""
    sglang = {key: rollout.pop(key) for key in list(rollout) if key in SGLangSettings.model_fields}
    return Config.model_validate({
        "model": {"path": str(model)},
        "rollout": {"engine": "sglang", "max_concurrency": 64, **rollout,
                    "sglang": {"server_args": dict(engine_args or ENGINE_ARGS), **sglang}},
        "cluster": {"device": "cuda", "colocate": colocate, "actor_num_gpus_per_node": 1,
                    "rollout_num_gpus": 1, "rollout_num_gpus_per_engine": 1},
        "logging": {"dir": str(work)},
    })


def hf_weights(model: Path, device: str) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    weights = {}
    for file in sorted(model.glob("*.safetensors")):
        weights.update(load_file(str(file), device=device))
    return sorted(weights.items())


def engine_param(engine: SGLangEngine, name: str) -> torch.Tensor:
    target = engine.targets()[0]
    return torch.tensor(server_api.post(target, "/get_weights_by_name", {"name": name, "truncate_size": 100},
                                timeout=60, step="read back"))


def mean_log_prob(outs) -> float:
    values = [lp for out in outs for lp in out.log_probs]
    return sum(values) / len(values)


def generate_all(engine: SGLangEngine, prompts: list[list[int]], params: SamplingParams):
    async def run():
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    return asyncio.run(run())


PROMPTS = [[1, 17 + i, 230, 41 + 3 * i, 512, 9] for i in range(8)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    """One colocated engine on GPU 0 for (a), (c), (e) and disk sync, in that order."""
    engine = SGLangEngine.from_config(gpu_config(tiny_llama, tmp_path_factory.mktemp("run")))
    engine.verify_weights = True
    yield engine
    asyncio.run(engine.shutdown())


def test_a_token_in_token_out_with_log_probs_through_the_router(engine, tiny_llama):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0.8, max_new_tokens=32, ignore_eos=True)
    outs = generate_all(engine, PROMPTS, params)
    for out in outs:
        assert len(out.token_ids) == 32 and len(out.log_probs) == 32 and out.finish_reason == "length"
        assert all(math.isfinite(lp) and lp <= 0 for lp in out.log_probs)
        assert all(0 <= t < VOCAB for t in out.token_ids)
    greedy = generate_all(engine, PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in greedy] == [o.token_ids for o in generate_all(engine, PROMPTS[:2], GREEDY)]
    # The same log-probs from the HF model on the same tokens (temperature-scaled, bf16).
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).cuda()
    diffs = []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids], device="cuda")).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits.float() / 0.8, -1).gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])
        diffs.append((ref[:, 0].cpu() - torch.tensor(out.log_probs)).abs())
    diffs = torch.cat(diffs)
    print(f"\n(a) {len(outs)} requests x 32 tokens through the router; |SGLang - HF| log-prob: "
          f"mean {diffs.mean():.5f}, max {diffs.max():.5f}")
    assert diffs.mean() < 0.05
    stop_at = greedy[0].token_ids[5]
    # not ignore_eos: SGLang's ignore_eos switches off stop_token_ids as well
    stopped = asyncio.run(engine.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=16,
                                                                     stop_token_ids=[stop_at])))
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == stop_at


def test_e_release_and_resume_memory(engine):
    before_tokens = [o.token_ids for o in generate_all(engine, PROMPTS[:2], GREEDY)]
    kv_pool = KV_TOKENS * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
    free_0, total = torch.cuda.mem_get_info(0)
    asyncio.run(engine.release_memory())
    free_1, _ = torch.cuda.mem_get_info(0)
    asyncio.run(engine.resume_memory())
    free_2, _ = torch.cuda.mem_get_info(0)
    freed, retaken = free_1 - free_0, free_1 - free_2
    print(f"\n(e) GPU 0 free: {free_0 / 2**30:.2f} GiB -> released {free_1 / 2**30:.2f} GiB "
          f"(freed {freed / 2**30:.2f} GiB of {total / 2**30:.0f}; the KV pool is {kv_pool / 2**30:.2f} GiB) "
          f"-> resumed {free_2 / 2**30:.2f} GiB")
    # Release gives back at least the KV pool (and the weights); resume takes it again.
    assert freed >= 0.95 * kv_pool
    assert retaken >= 0.95 * kv_pool
    # Released weights are restored before generating: the same greedy tokens as before.
    assert [o.token_ids for o in generate_all(engine, PROMPTS[:2], GREEDY)] == before_tokens


def test_c_colocated_sync_by_cuda_ipc(engine, tiny_llama):
    engine.transport = "tensor"
    trainer = hf_weights(tiny_llama, "cuda:0")  # the trainer's tensors, on the engine's GPU
    before = generate_all(engine, PROMPTS[:4], GREEDY)
    changed = [(n, torch.zeros_like(t) if n == "lm_head.weight" else t * 1.5) for n, t in trainer]
    buckets = [changed[: len(changed) // 2], changed[len(changed) // 2:]]
    version = engine.weight_version + 1
    for i, bucket in enumerate(buckets):  # verify_weights compares engine and trainer after the sync
        asyncio.run(engine.update_weights(bucket, version=version, last=i == len(buckets) - 1))
    after = generate_all(engine, PROMPTS[:4], GREEDY)
    lm_head = engine_param(engine, "lm_head.weight")
    print(f"\n(c) IPC sync v{version}: engine lm_head max |w| = {lm_head.abs().max():.3g}; mean log-prob "
          f"{mean_log_prob(before):.4f} -> {mean_log_prob(after):.4f} (uniform: {-math.log(VOCAB):.4f})")
    assert engine.weight_version == version and all(o.weight_version == version for o in after)
    assert torch.equal(lm_head, torch.zeros_like(lm_head))
    q = engine_param(engine, "model.layers.0.self_attn.q_proj.weight")
    assert torch.equal(q, dict(changed)["model.layers.0.self_attn.q_proj.weight"].float().cpu()[:100])
    assert abs(mean_log_prob(after) + math.log(VOCAB)) < 1e-3  # zero lm_head: every token equally likely
    # back to the original weights, by IPC again
    asyncio.run(engine.update_weights(trainer, version=version + 1, last=True))
    assert [o.token_ids for o in generate_all(engine, PROMPTS[:4], GREEDY)] == [o.token_ids for o in before]


def test_disk_sync(engine, tiny_llama):
    engine.transport = "disk"
    original = hf_weights(tiny_llama, "cpu")
    before = generate_all(engine, PROMPTS[:4], GREEDY)
    version = engine.weight_version + 1
    changed = [(n, torch.zeros_like(t) if n == "lm_head.weight" else t) for n, t in original]
    asyncio.run(engine.update_weights(changed, version=version, last=True))
    after = generate_all(engine, PROMPTS[:4], GREEDY)
    print(f"\n(disk) sync v{version} from {engine.work_dir / 'weights' / f'v{version}'}: mean log-prob "
          f"{mean_log_prob(before):.4f} -> {mean_log_prob(after):.4f}")
    assert all(o.weight_version == version for o in after)
    assert abs(mean_log_prob(after) + math.log(VOCAB)) < 1e-3
    asyncio.run(engine.update_weights(original, version=version + 1, last=True))
    assert [o.token_ids for o in generate_all(engine, PROMPTS[:4], GREEDY)] == [o.token_ids for o in before]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_d_nccl_sync_across_two_gpus(tiny_llama, tmp_path, monkeypatch):
    """Trainer tensors on GPU 0, the engine on GPU 1 (disaggregated placement)."""
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # both sides: a stuck rendezvous shows where in the log
    monkeypatch.setenv("NCCL_DEBUG_SUBSYS", "INIT,P2P,NET")
    # short timeouts: fail with the step's name (and the server log below) instead of waiting out the defaults
    engine = SGLangEngine.from_config(gpu_config(tiny_llama, tmp_path, colocate=False, update_weight_transport="nccl",
                                                 engine_startup_timeout=300, weight_sync_timeout=120))
    try:
        assert engine.servers[0].gpu_ids == [1]
        engine.verify_weights = True
        trainer = hf_weights(tiny_llama, "cuda:0")
        before = generate_all(engine, PROMPTS[:4], GREEDY)
        changed = [(n, torch.zeros_like(t) if n == "lm_head.weight" else t * 0.5) for n, t in trainer]
        buckets = [changed[i::3] for i in range(3)]
        for i, bucket in enumerate(buckets):
            asyncio.run(engine.update_weights(bucket, version=1, last=i == 2))
        after = generate_all(engine, PROMPTS[:4], GREEDY)
        print(f"\n(d) NCCL sync GPU 0 -> GPU 1 in 3 buckets: mean log-prob {mean_log_prob(before):.4f} -> "
              f"{mean_log_prob(after):.4f}")
        assert all(o.weight_version == 1 for o in after)
        assert abs(mean_log_prob(after) + math.log(VOCAB)) < 1e-3
        q = engine_param(engine, "model.layers.1.self_attn.q_proj.weight")
        assert torch.equal(q, dict(changed)["model.layers.1.self_attn.q_proj.weight"].float().cpu()[:100])
        asyncio.run(engine.update_weights(trainer, version=2, last=True))  # the group is reused
        assert [o.token_ids for o in generate_all(engine, PROMPTS[:4], GREEDY)] == [o.token_ids for o in before]
    except BaseException:
        print(f"\n(d) server log tail:\n{engine.servers[0].process.log_tail(120)}")
        raise
    finally:
        asyncio.run(engine.shutdown())


def test_keys_refuse_strangers_and_admit_the_engine(engine, tiny_llama):
    """Issue 14: weight update, memory release, abort and pause without the admin key are refused by
    the real server (HTTP 401, nothing changes); the engine, which holds the run's keys, does all
    of them. Also prints what the server's processes listen on (docs/multi-node.md)."""
    import httpx
    import psutil

    url, router = engine.engine_urls[0], engine.router.url
    before = generate_all(engine, PROMPTS[:2], GREEDY)
    zeros = [(n, torch.zeros_like(t)) for n, t in hf_weights(tiny_llama, "cpu")]
    stranger = {
        "/update_weights_from_disk": {"model_path": str(tiny_llama)},
        "/update_weights_from_tensor": {"serialized_named_tensors": [ipc.serialize_bucket(zeros)],
                                        "load_format": "flattened_bucket"},
        "/release_memory_occupation": {"tags": None},
        "/abort_request": {"abort_all": True},
        "/pause_generation": {"mode": "abort"},
    }
    refused = {}
    for path, body in stranger.items():
        for who, headers in {"no key": {}, "a guess": {"Authorization": "Bearer guess"},
                             "the api key": bearer(engine.keys.api_key)}.items():
            status = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60).status_code
            refused[f"{path} with {who}"] = status
    generate = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
    refused["server /generate without key"] = httpx.post(f"{url}/generate", json=generate, timeout=60).status_code
    refused["router /generate without key"] = httpx.post(f"{router}/generate", json=generate, timeout=60).status_code
    refused["router POST /workers without key"] = httpx.post(f"{router}/workers", json={"url": "http://127.0.0.1:9"},
                                                             timeout=60).status_code
    print("\n(keys) " + "; ".join(f"{k}: {v}" for k, v in refused.items()))
    assert set(refused.values()) == {401}, refused
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    # nothing changed: the same greedy tokens, then the engine does each of them with its keys
    assert [o.token_ids for o in generate_all(engine, PROMPTS[:2], GREEDY)] == [o.token_ids for o in before]
    asyncio.run(engine.release_memory())
    asyncio.run(engine.resume_memory())
    engine.transport = "disk"
    version = engine.weight_version + 1
    asyncio.run(engine.update_weights(hf_weights(tiny_llama, "cpu"), version=version, last=True))
    after = generate_all(engine, PROMPTS[:2], GREEDY)
    assert all(o.weight_version == version for o in after)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    # the keys are in no command line; the server's log (SGLang logs its arguments) is private
    secrets = [engine.keys.api_key, engine.keys.admin_key, engine.keys.router_key]
    server = psutil.Process(engine.servers[0].process.pid)
    procs = [server, *server.children(recursive=True), psutil.Process(engine.router.process.pid)]
    assert not any(k in " ".join(p.cmdline()) for p in procs for k in secrets)
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in (engine.work_dir / "logs").iterdir())
    listening = sorted({f"{p.name()}: {c.laddr.ip}:{c.laddr.port}" for p in procs
                        for c in p.net_connections("tcp") if c.status == "LISTEN"})
    print("(keys) listening: " + "; ".join(listening))


def test_standin_key_rules_match_this_sglang():
    """The CPU tests' stand-in enforces keys with a copy of SGLang's rules: the same decision as
    ``sglang.srt.utils.auth.decide_request_auth`` and the same admin endpoints as this SGLang's
    http_server.py, so a new SGLang that changes them shows here."""
    import importlib.util
    import itertools
    import re

    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    from slime_rl.rollout_sglang.testing import server as standin_sglang

    source = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    text = (source / "srt" / "entrypoints" / "http_server.py").read_text()
    admin = set()
    for block in re.split(r"\n(?=@app\.)", text):
        if "AuthLevel.ADMIN_OPTIONAL" in block.split("def ", 1)[0]:
            admin |= {p for p in re.findall(r'"(/[^"]*)"', block.split("def ", 1)[0]) if "{" not in p}
    assert admin == {p for p in standin_sglang.ADMIN_OPTIONAL}, admin ^ standin_sglang.ADMIN_OPTIONAL
    keys = [None, "k-api", "k-admin"]
    for path, header, api, adm in itertools.product(["/generate", "/update_weights_from_disk", "/health",
                                                     "/metrics", "/server_info", "/abort_request"],
                                                    [None, "Bearer k-api", "Bearer k-admin", "Bearer x", "k-api"],
                                                    keys, keys):
        level = AuthLevel.ADMIN_OPTIONAL if path in admin else AuthLevel.NORMAL
        real = decide_request_auth(method="POST", path=path, authorization_header=header, api_key=api,
                                   admin_api_key=adm, auth_level=level)
        ours = standin_sglang.auth_decision("POST", path, header, api, adm)
        assert (ours is None) == real.allowed and (ours is None or ours == real.error_status_code), \
            (path, header, api, adm)
