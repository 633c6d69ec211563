"""rollout.sglang (settings.py): checked when the config loads with core's one-line errors, found by the
loader without importing the engine, and turned into the servers' flags."""

import subprocess
import sys
import warnings

import pytest

from slime_rl.core.config import ConfigError, RenamedKeyWarning, load_config
from slime_rl.rollout_sglang import launch as fleet
from slime_rl.rollout_sglang.engine import SGLangEngine
from slime_rl.rollout_sglang.settings import SGLangSettings


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "1 + 1 =", "label": "2"}\n')
    return path


def load(prompts, *overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # new key names: no notice
        return load_config(None, [f"data.prompt_data={prompts}", "rollout.engine=sglang", "cluster.device=cpu",
                                  *overrides])


def refused(prompts, *overrides) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(prompts, *overrides)
    assert "\n" not in str(info.value)
    return info.value


def test_the_engine_declares_the_model_the_entry_point_names():
    from importlib.metadata import entry_points

    (settings,) = [ep for ep in entry_points(group="slime_rl.rollout_engines.settings") if ep.name == "sglang"]
    assert SGLangEngine.settings is settings.load() is SGLangSettings


def test_loading_a_config_does_not_import_the_engine(prompts, tmp_path):
    code = ("import sys; from slime_rl.core.config import load_config; "
            f"cfg = load_config(None, ['data.prompt_data={prompts}', 'rollout.engine=sglang', 'cluster.device=cpu',"
            " 'rollout.sglang.chunked_prefill_size=4096']); "
            "assert cfg.rollout.sglang.chunked_prefill_size == 4096; "
            "print(sorted(m for m in ('torch', 'slime_rl.rollout_sglang.engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "[]"


def test_chunked_prefill_size_becomes_the_server_flag(prompts):
    cfg = load(prompts, "rollout.sglang.chunked_prefill_size=8192")
    assert fleet.engine_args(cfg)["chunked_prefill_size"] == 8192
    assert load(prompts, "rollout.sglang.chunked_prefill_size=-1").rollout.sglang.chunked_prefill_size == -1
    assert "chunked_prefill_size" not in fleet.engine_args(load(prompts))  # unset: SGLang's own choice


def test_a_bad_chunked_prefill_size_is_refused_naming_the_field_and_the_fix(prompts):
    for bad in ("0", "-2"):
        err = refused(prompts, f"rollout.sglang.chunked_prefill_size={bad}")
        assert str(err) == (f"rollout.sglang.chunked_prefill_size: give a number of tokens >= 1, or -1 to turn chunked"
                            f" prefill off (got {bad})")
    assert refused(prompts, "rollout.sglang.chunked_prefill_size=1.5").field == "rollout.sglang.chunked_prefill_size"
    err = refused(prompts, "rollout.sglang.chunked_prefill_size=512", "rollout.sglang.engine_urls=[http://h:1]")
    assert err.field == "rollout.sglang.chunked_prefill_size" and "--chunked-prefill-size" in str(err)


def test_a_mistyped_key_gets_the_nearest_one(prompts):
    err = refused(prompts, "rollout.sglang.chunk_prefill_size=512")
    assert str(err) == "rollout.sglang.chunk_prefill_size: unknown key; did you mean `rollout.sglang.chunked_prefill_size`?"


def test_core_no_longer_holds_sglangs_keys_and_their_checks_moved_here(prompts, tmp_path):
    err = refused(prompts, "rollout.sglang.engine_urls=[10.0.0.1:30000]")
    assert err.field == "rollout.sglang.engine_urls" and "http://" in str(err)
    err = refused(prompts, f"rollout.sglang.engine_python={tmp_path}/venv/bin/python")
    assert err.field == "rollout.sglang.engine_python" and "not an executable interpreter" in str(err)
    err = refused(prompts, "rollout.sglang.server_args={port: 1}")
    assert err.field == "rollout.sglang.server_args" and "sets --port itself" in str(err)


@pytest.mark.parametrize("server_args, says", [
    ("{quantization: fp8}", "quantization: SGLang quantises the checkpoint online after loading and does not"
                            " re-quantise an update"),
    ("{torchao_config: int4wo-128}", "torchao_config: torchao quantises the weights once after loading"),
    ("{dcp_size: 2}", "dcp_size: with --dcp-size > 1 SGLang gathers each MLA layer's q_b_proj and w_kc"),
    ("{dcp_size: 2, dcp_replicate_q_proj: true}", "dcp_replicate_q_proj: with --dcp-size > 1"),
])
def test_flags_whose_copies_a_sync_would_leave_stale_are_refused_with_the_fix(prompts, server_args, says):
    """SGLang builds these copies of the weights once after loading; every sync would leave the engine serving the
    first weights, so the config stops before a run starts."""
    err = refused(prompts, f"rollout.sglang.server_args={server_args}")
    assert err.field == "rollout.sglang.server_args" and says in str(err)
    assert ("rollout.precision: fp8" in str(err)) == ("quantization" in server_args)


def test_the_safe_forms_of_those_flags_pass(prompts):
    for server_args in ("{quantization: null}", "{dcp_size: 2, dcp_replicate_q_proj: false}", "{dcp_size: 1}"):
        load(prompts, f"rollout.sglang.server_args={server_args}")


def test_old_key_names_still_work_with_a_notice(prompts):
    with pytest.warns(RenamedKeyWarning) as notices:
        cfg = load_config(None, [f"data.prompt_data={prompts}", "rollout.engine=sglang", "cluster.device=cpu",
                                 "rollout.weight_sync_timeout=5", "rollout.engine_args={mem_fraction_static: 0.5,"
                                 " chunked_prefill_size: 2048}"])
    assert sorted(str(n.message).split(";")[0] for n in notices) == [
        "rollout.engine_args is now rollout.sglang.server_args", "rollout.weight_sync_timeout is now"
        " rollout.sglang.weight_sync_timeout"]
    settings = cfg.rollout.sglang
    assert (settings.weight_sync_timeout, settings.server_args, settings.chunked_prefill_size) == (
        5.0, {"mem_fraction_static": 0.5}, 2048)  # the typed flag in the old engine_args is checked as itself
    with pytest.warns(RenamedKeyWarning), pytest.raises(ConfigError, match="^rollout.sglang.chunked_prefill_size"):
        load_config(None, [f"data.prompt_data={prompts}", "rollout.engine=sglang", "cluster.device=cpu",
                           "rollout.engine_args={chunked_prefill_size: 0}"])


def test_engine_keys_are_secrets_for_attached_servers_only(prompts):
    assert str(refused(prompts, "rollout.sglang.api_key=sk-somekey123")).startswith(
        "rollout.sglang.api_key: is for servers you run (rollout.sglang.engine_urls); the servers slime-rl"
        " launches get fresh keys: remove it")
    cfg = load(prompts, "rollout.sglang.engine_urls=[http://127.0.0.1:1]", "rollout.sglang.api_key=sk-somekey123")
    assert cfg.rollout.settings.api_key.reveal() == "sk-somekey123"
    assert "sk-somekey123" not in cfg.to_yaml()


def test_the_context_length_is_the_longest_sample_the_config_allows(prompts, tmp_path, monkeypatch):
    import json

    model = tmp_path / "model"
    model.mkdir()
    hf = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256,
          "max_position_embeddings": 32768}
    (model / "config.json").write_text(json.dumps(hf))
    bounded = load(prompts, f"model.path={model}", "rollout.max_prompt_len=2048", "rollout.max_response_len=16384")
    assert fleet.engine_args(bounded)["context_length"] == 18432  # input + max_new_tokens may reach it, not pass it
    assert "context_length" not in fleet.engine_args(load(prompts, f"model.path={model}"))  # unbounded prompts
    user = load(prompts, f"model.path={model}", "rollout.max_prompt_len=2048",
                "rollout.sglang.server_args={context_length: 20000}")
    assert fleet.engine_args(user)["context_length"] == 20000  # the user's wins

    # Qwen's YaRN recipe: SGLang counts max_position_embeddings only, so the reach is given and allowed
    (model / "config.json").write_text(json.dumps({**hf, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}))
    assert fleet.engine_args(load(prompts, f"model.path={model}"))["context_length"] == 131072
    captured = {}

    def fake_start(name, cmd, log_path, env):
        captured.update(env)
        raise RuntimeError("not started")

    from slime_rl.rollout_sglang import server

    monkeypatch.setattr(server, "start_process", fake_start)
    for context, allowed in ((131072, "1"), (16384, None)):
        captured.clear()
        with pytest.raises(RuntimeError, match="not started"):
            server.start_server(0, str(model), log_dir=tmp_path, engine_args={"context_length": context}, env={})
        assert captured.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN") == allowed
