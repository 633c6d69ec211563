import json

import pytest
import yaml

from slime_rl.core.config import Config, ConfigError, load_config, parse_overrides


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"input": "1 + 1 =", "label": "2"}\n')
    return path


def write_config(tmp_path, tree, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(tree))
    return path


def refused(path=None, overrides=()):
    """The ConfigError load_config raises; every message is one line."""
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    assert "\n" not in str(info.value)
    return info.value


def test_defaults_follow_slime(prompts):
    cfg = load_config(None, [f"data.prompt_data={prompts}"])
    assert cfg.rollout.temperature == 1.0 and cfg.rollout.top_p == 1.0 and cfg.rollout.top_k == -1
    assert cfg.algorithm.advantage_estimator == "grpo"
    assert cfg.algorithm.eps_clip == 0.2 and cfg.eps_clip_high == 0.2  # eps_clip_high defaults to eps_clip
    assert cfg.global_batch_size == cfg.data.rollout_batch_size * cfg.data.n_samples_per_prompt
    assert cfg.over_sampling_batch_size == cfg.data.rollout_batch_size
    assert cfg.rollout_num_gpus == cfg.actor_num_gpus == 1  # colocated: the trainer's GPUs
    assert cfg.num_engines == 1 and cfg.data_parallel_size == 1


def test_yaml_then_overrides(tmp_path, prompts):
    path = write_config(tmp_path, {
        "data": {"prompt_data": str(prompts), "rollout_batch_size": 4, "n_samples_per_prompt": 2},
        "rollout": {"temperature": 0.9, "stop": ["</answer>"]},
        "algorithm": {"eps_clip_high": 0.28},
    })
    cfg = load_config(path, [
        "rollout.temperature=0.7", "rollout.top_k=20", "trainer.num_steps_per_rollout=2",
        "eval.prompt_data={math: " + str(prompts) + "}", "cluster.async_mode=off", "model.dtype=bfloat16",
    ])
    assert cfg.rollout.temperature == 0.7 and cfg.rollout.top_k == 20  # override wins, parsed as YAML
    assert cfg.rollout.stop == ["</answer>"]  # untouched keys survive
    assert cfg.eps_clip_high == 0.28
    assert cfg.global_batch_size == 4  # 4 * 2 samples over 2 optimizer steps
    assert cfg.eval.prompt_data == {"math": str(prompts)}
    assert cfg.model.dtype == "bfloat16"


def test_resolved_yaml_loads_back_to_the_same_config(tmp_path, prompts):
    cfg = load_config(None, [f"data.prompt_data={prompts}", "cluster.colocate=false", "cluster.async_mode=one_step",
                             "rollout.sandbox.env={LANG: C}"])
    dumped = cfg.to_yaml()
    assert "async_mode: one_step" in dumped
    again = load_config(write_config(tmp_path, yaml.safe_load(dumped), "resolved.yaml"))
    assert again == cfg


def test_relative_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "p.jsonl").write_text("{}\n")
    path = write_config(tmp_path / "conf", {"data": {"prompt_data": "data/p.jsonl"}})
    monkeypatch.chdir(tmp_path)  # not the config's folder
    cfg = load_config(path)
    assert cfg.data.prompt_data == str(tmp_path / "conf" / "data" / "p.jsonl")


def test_unknown_keys_suggest_the_nearest(tmp_path, prompts):
    err = refused(None, [f"data.prompt_data={prompts}", "rollout.temprature=0.5"])
    assert err.field == "rollout.temprature"
    assert "rollout.temperature" in str(err)
    err = refused(write_config(tmp_path, {"rolout": {"temperature": 0.5}}))
    assert err.field == "rolout" and "`rollout`" in str(err)
    err = refused(None, ["algorithm.eps_clip_hgih=0.3"])
    assert "algorithm.eps_clip_high" in str(err)
    err = refused(None, ["cluster.zzz=1"])  # nothing close: list what is valid
    assert "valid keys here" in str(err) and "colocate" in str(err)


def test_bad_values_name_the_field(prompts):
    err = refused(None, [f"data.prompt_data={prompts}", "data.rollout_batch_size=0"])
    assert err.field == "data.rollout_batch_size" and "(got 0)" in str(err)
    err = refused(None, [f"data.prompt_data={prompts}", "algorithm.advantage_estimator=grpoo"])
    assert err.field == "algorithm.advantage_estimator"
    err = refused(None, [f"data.prompt_data={prompts}", "rollout.top_p=1.5"])
    assert err.field == "rollout.top_p"
    err = refused(None, [f"data.prompt_data={prompts}", "rollout=3"])
    assert err.field == "rollout"


def test_override_syntax(prompts):
    assert parse_overrides(["a.b=1", "a.c=x y", "d=[1, 2]", "e="]) == {"a": {"b": 1, "c": "x y"}, "d": [1, 2], "e": ""}
    assert refused(None, ["rollout.temperature"]).field == "rollout.temperature"
    assert refused(None, ["rollout.temperature=0.5", "rollout.temperature.x=1"]).field == "rollout.temperature.x"


def test_config_file_problems(tmp_path):
    err = refused(tmp_path / "missing.yaml")
    assert err.field == "config" and "missing.yaml" in str(err)
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    err = refused(bad)
    assert "bad.yaml" in str(err) and "not valid YAML" in str(err)
    err = refused(write_config(tmp_path, [1, 2], "list.yaml"))
    assert "list.yaml" in str(err) and "expected a mapping" in str(err)


def test_batch_identity(prompts):
    base = [f"data.prompt_data={prompts}", "data.rollout_batch_size=8", "data.n_samples_per_prompt=4"]
    assert load_config(None, base + ["trainer.global_batch_size=16", "trainer.num_steps_per_rollout=2"])
    err = refused(None, base + ["trainer.global_batch_size=16"])
    assert err.field == "trainer.global_batch_size"
    assert "8 * 4 = 32" in str(err) and "set global_batch_size to 32" in str(err)
    err = refused(None, base + ["trainer.num_steps_per_rollout=64"])
    assert err.field == "trainer.num_steps_per_rollout" and "fewer than 1" in str(err)


def test_context_parallel_takes_its_share_of_the_gpus_and_needs_packing(prompts):
    base = [f"data.prompt_data={prompts}", "cluster.actor_num_gpus_per_node=8", "data.rollout_batch_size=4",
            "data.n_samples_per_prompt=4"]
    cfg = load_config(None, base + ["parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=2"])
    assert cfg.data_parallel_size == 2
    err = refused(None, base + ["parallel.context_parallel_size=3"])
    assert err.field == "parallel.tensor_model_parallel_size" and "TP * CP * PP = 1 * 3 * 1" in str(err)
    err = refused(None, base + ["parallel.context_parallel_size=2", "trainer.max_tokens_per_gpu=null",
                                "trainer.micro_batch_size=2"])
    assert err.field == "parallel.context_parallel_size" and "trainer.max_tokens_per_gpu" in str(err)


def test_parallel_sizes_divide_the_gpus(prompts):
    base = [f"data.prompt_data={prompts}", "cluster.actor_num_gpus_per_node=4", "data.rollout_batch_size=4",
            "data.n_samples_per_prompt=4"]
    cfg = load_config(None, base + ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"])
    assert cfg.data_parallel_size == 1
    assert refused(None, base + ["parallel.tensor_model_parallel_size=3"]).field == "parallel.tensor_model_parallel_size"
    # data parallel 4 cannot split a global batch of 6
    err = refused(None, base + ["data.rollout_batch_size=3", "data.n_samples_per_prompt=2"])
    assert err.field == "trainer.global_batch_size" and "data-parallel size 4" in str(err)


def test_engine_size_divides_the_rollout_gpus(prompts):
    base = [f"data.prompt_data={prompts}", "cluster.actor_num_gpus_per_node=4", "data.n_samples_per_prompt=4"]
    assert load_config(None, base + ["cluster.rollout_num_gpus_per_engine=2"]).num_engines == 2
    err = refused(None, base + ["cluster.rollout_num_gpus_per_engine=3"])
    assert err.field == "cluster.rollout_num_gpus_per_engine" and "divide" in str(err)


def test_colocated_and_disaggregated_gpu_counts(prompts):
    base = [f"data.prompt_data={prompts}", "cluster.actor_num_gpus_per_node=2"]
    err = refused(None, base + ["cluster.rollout_num_gpus=4"])
    assert err.field == "cluster.rollout_num_gpus" and "colocate=false" in str(err)
    cfg = load_config(None, base + ["cluster.rollout_num_gpus=4", "cluster.colocate=false"])
    assert cfg.num_engines == 4
    cfg = load_config(None, base + ["cluster.colocate=false", "cluster.rollout_num_gpus_per_engine=2"])
    assert cfg.rollout_num_gpus == 2  # disaggregated default: one engine


def test_async_needs_disaggregation(prompts):
    err = refused(None, [f"data.prompt_data={prompts}", "cluster.async_mode=one_step"])
    assert err.field == "cluster.async_mode" and "colocate=false" in str(err)
    assert load_config(None, [f"data.prompt_data={prompts}", "cluster.async_mode=one_step", "cluster.colocate=false"])
    # colocated without offload: both stay resident on the shared GPUs, so the steps can overlap
    for mode in ("one_step", "fully"):
        cfg = load_config(None, [f"data.prompt_data={prompts}", f"cluster.async_mode={mode}", "cluster.offload=false",
                                 "cluster.device=cuda"])
        assert cfg.cluster.colocate and not cfg.offload
    err = refused(None, [f"data.prompt_data={prompts}", "cluster.async_mode=fully", "cluster.device=cuda"])
    assert err.field == "cluster.async_mode" and "offload=false" in str(err)


def test_over_sampling_batch_at_least_the_rollout_batch(prompts):
    base = [f"data.prompt_data={prompts}", "data.rollout_batch_size=8", "data.n_samples_per_prompt=1"]
    assert load_config(None, base + ["rollout.over_sampling_batch_size=12"]).over_sampling_batch_size == 12
    assert refused(None, base + ["rollout.over_sampling_batch_size=4"]).field == "rollout.over_sampling_batch_size"


def test_files_exist(tmp_path, prompts):
    err = refused(None, [f"data.prompt_data={tmp_path / 'nope.jsonl'}"])
    assert err.field == "data.prompt_data" and "nope.jsonl" in str(err)
    assert refused(None, []).field == "data.prompt_data"  # the JSONL source needs a file
    err = refused(None, [f"data.prompt_data={prompts}", f"eval.prompt_data={{aime: {tmp_path / 'aime.jsonl'}}}"])
    assert err.field == "eval.prompt_data.aime"
    err = refused(None, [f"data.prompt_data={prompts}", f"model.path={tmp_path / 'no-model'}"])
    assert err.field == "model.path"
    # a user's own data source decides what it reads, and so does a user's own eval source
    assert load_config(None, ["data.source=my_pkg.data:Source"]).data.prompt_data is None
    cfg = load_config(None, [f"data.prompt_data={prompts}", "eval.source=my_pkg.data:EvalSource",
                             "eval.prompt_data={aime: aime-2024}"])
    assert cfg.eval.source == "my_pkg.data:EvalSource" and cfg.data.buffer == "default"


def test_model_shape_checks(tmp_path, prompts):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2}))
    base = [f"data.prompt_data={prompts}", f"model.path={model}", "cluster.actor_num_gpus_per_node=8",
            "data.n_samples_per_prompt=8"]
    assert load_config(None, base + ["parallel.tensor_model_parallel_size=4", "parallel.pipeline_model_parallel_size=2"])
    err = refused(None, base + ["parallel.pipeline_model_parallel_size=4"])
    assert err.field == "parallel.pipeline_model_parallel_size" and "6 layers" in str(err)
    # megatron-core replicates KV heads when TP exceeds them, so 8 heads, 2 KV heads and TP 8 is fine
    assert load_config(None, base + ["parallel.tensor_model_parallel_size=8"])
    (model / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 6, "num_attention_heads": 12, "num_key_value_heads": 4}))
    err = refused(None, base + ["cluster.actor_num_gpus_per_node=6", "data.n_samples_per_prompt=6",
                                "parallel.tensor_model_parallel_size=6"])
    assert err.field == "parallel.tensor_model_parallel_size" and "4 KV heads" in str(err)
    err = refused(None, base + ["parallel.tensor_model_parallel_size=8"])
    assert err.field == "parallel.tensor_model_parallel_size" and "12 attention heads" in str(err)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "num_attention_heads": 6}))
    err = refused(None, base + ["cluster.rollout_num_gpus_per_engine=4"])
    assert err.field == "cluster.rollout_num_gpus_per_engine" and "6 heads" in str(err)


def test_algorithm_checks(prompts):
    base = [f"data.prompt_data={prompts}"]
    assert refused(None, base + ["algorithm.eps_clip_c=0.5"]).field == "algorithm.eps_clip_c"
    assert load_config(None, base + ["algorithm.eps_clip_c=3"]).algorithm.eps_clip_c == 3


def test_checkpoints_default_to_the_log_dir(tmp_path, prompts):
    cfg = load_config(None, [f"data.prompt_data={prompts}", "checkpoint.resume=true", f"logging.dir={tmp_path}"])
    assert cfg.checkpoint_dir == tmp_path / "checkpoints"
    cfg = load_config(None, [f"data.prompt_data={prompts}", f"checkpoint.save_dir={tmp_path / 'ck'}"])
    assert cfg.checkpoint_dir == tmp_path / "ck"


def test_engines_must_not_straddle_nodes(prompts):
    # 3 trainer GPUs, then 2-GPU engines on 4-GPU nodes: the second engine would take GPU 3 of node 0 and GPU 0 of node 1
    base = [f"data.prompt_data={prompts}", "cluster.actor_num_gpus_per_node=3", "cluster.num_gpus_per_node=4",
            "cluster.colocate=false", "cluster.rollout_num_gpus_per_engine=2", "data.n_samples_per_prompt=3"]
    err = refused(None, base + ["cluster.rollout_num_gpus=4"])
    assert err.field == "cluster.rollout_num_gpus_per_engine" and "across nodes" in str(err)
    assert load_config(None, base + ["cluster.rollout_num_gpus_per_engine=1", "cluster.rollout_num_gpus=4"])
    err = refused(None, base + ["cluster.num_gpus_per_node=2"])
    assert err.field == "cluster.actor_num_gpus_per_node"


def test_check_false_skips_cross_field_checks():
    cfg = load_config(None, ["trainer.global_batch_size=3"], check=False)
    assert isinstance(cfg, Config) and cfg.trainer.global_batch_size == 3


def test_colocated_runs_offload_unless_told_not_to(prompts):
    """slime's --colocate turns on --offload; cluster.offload=false keeps both on the GPU."""
    base = [f"data.prompt_data={prompts}"]
    assert load_config(None, base).offload is True
    assert load_config(None, [*base, "cluster.offload=false"]).offload is False
    disaggregated = load_config(None, [*base, "cluster.colocate=false", "cluster.offload=true"])
    assert disaggregated.offload is False


# ------------------------------------------------------------------ strict values, bounded YAML (issue 13, 8-9)


def numeric_fields():
    """(dotted field, int or float) for every number in the config tree, fields added later included."""
    out = []
    for section, info in Config.model_fields.items():
        if not hasattr(info.annotation, "model_fields"):  # roles: a dict of sections (test_roles.py checks them)
            continue
        for name, field in info.annotation.model_fields.items():
            kinds = {t for t in (int, float) if t in (field.annotation, *getattr(field.annotation, "__args__", ()))}
            kinds |= {t for t in (int, float) if getattr(field.annotation, "__origin__", None) is t}  # Annotated
            out += [(f"{section}.{field.alias or name}", kind) for kind in kinds]
    return out


def test_every_numeric_field_refuses_booleans_and_non_finite_values(prompts):
    fields = numeric_fields()
    assert ("data.rollout_batch_size", int) in fields and ("trainer.lr", float) in fields
    assert ("rollout.top_k", int) in fields and len(fields) > 40
    base = [f"data.prompt_data={prompts}"]
    for dotted, kind in fields:
        err = refused(None, base + [f"{dotted}=true"])
        assert err.field == dotted and "(got true, a boolean)" in str(err), str(err)
        if kind is float:
            for value in (".inf", "-.inf", ".nan"):
                err = refused(None, base + [f"{dotted}={value}"])
                assert err.field == dotted and "finite number" in str(err), str(err)
        else:
            err = refused(None, base + [f"{dotted}=2.5"])
            assert err.field == dotted and "whole number" in str(err), str(err)


def test_numbers_as_yaml_users_write_them(tmp_path, prompts):
    path = tmp_path / "cfg.yaml"
    path.write_text(f"data: {{prompt_data: {prompts}}}\ntrainer: {{lr: 1e-5, adam_eps: 1E-8, weight_decay: 0}}\n"
                    "rollout: {temperature: 1, top_k: -1}\n")
    cfg = load_config(path, ["trainer.min_lr=1e-7"])
    assert cfg.trainer.lr == 1e-5 and cfg.trainer.adam_eps == 1e-8 and cfg.trainer.min_lr == 1e-7  # YAML 1.2 floats
    assert isinstance(cfg.rollout.temperature, float) and cfg.trainer.weight_decay == 0.0  # an int is a float
    assert load_config(None, [f"data.prompt_data={prompts}", "data.input_key='1e-6'"]).data.input_key == "1e-6"


BOMB = "[" + ", ".join(f"&{n} [" + ", ".join([f"*{p}" if p else "lol"] * 9) + "]"
                       for n, p in zip("abcdefghi", ["", *"abcdefgh"], strict=True)) + "]"  # 9**9 values


@pytest.mark.parametrize("where", ["file", "override"])
def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, where):
    import time
    import tracemalloc

    path = tmp_path / "bomb.yaml"
    path.write_text(f"rollout:\n  engine_args: {{x: {BOMB}}}\n")
    assert len(BOMB) < 400
    tracemalloc.start()
    began = time.perf_counter()
    err = refused(path) if where == "file" else refused(None, [f"rollout.engine_args={{x: {BOMB}}}"])
    elapsed = time.perf_counter() - began
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert err.field == (str(path) if where == "file" else "rollout.engine_args") and "alias" in str(err)
    # ~0.05 s and a few MB when refused at once; expanding the 9**9 values would take minutes and GBs,
    # so a bound this loose still tells the two apart on a machine busy with other tests.
    assert elapsed < 10.0 and peak < 50 * 2**20, (elapsed, peak)


def test_files_that_are_no_config(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"data:\n  input_key: \xe9\n")
    err = refused(latin1)
    assert err.field == f"{latin1}:2" and "not UTF-8" in str(err)
    assert refused(tmp_path).field == "config" and "is a directory" in str(refused(tmp_path))
    deep = tmp_path / "deep.yaml"
    deep.write_text("x: " + "[" * 500_000)
    assert "deeper than" in str(refused(deep))
    cyclic = tmp_path / "cyclic.yaml"
    cyclic.write_text("rollout: {engine_args: &a {x: *a}}\n")
    assert "refers to itself" in str(refused(cyclic))


def test_a_malformed_model_config_json_names_the_file(tmp_path, prompts):
    model = tmp_path / "model"
    model.mkdir()
    for text, words in [('{"num_hidden_layers": 2,\n', "config.json:2: not valid JSON"),
                        ('{"num_attention_heads": true}', "num_attention_heads is True"),
                        ("{\"a\": \"\xe9\"}", "cannot be read as JSON")]:
        (model / "config.json").write_bytes(text.encode("latin-1"))
        err = refused(None, [f"data.prompt_data={prompts}", f"model.path={model}"])
        assert err.field == "model.path" and words in str(err), str(err)


def test_micro_batches_by_token_budget_unless_the_user_asks_for_a_count():
    """Issue 16: one sample per micro-batch (the old default) left a 3B model's train phase at ~1% MFU."""
    from slime_rl.core.config.schema import DEFAULT_MAX_TOKENS_PER_GPU

    def trainer(**fields):
        return Config.model_validate({"trainer": fields}).trainer

    assert trainer().max_tokens_per_gpu == DEFAULT_MAX_TOKENS_PER_GPU
    assert (trainer(micro_batch_size=4).micro_batch_size, trainer(micro_batch_size=4).max_tokens_per_gpu) == (4, None)
    assert trainer(micro_batch_size=4, max_tokens_per_gpu=1000).max_tokens_per_gpu == 1000
    assert trainer(max_tokens_per_gpu=None).max_tokens_per_gpu is None
    # through the overrides a user types, and through a dump of the resolved config
    assert load_config(None, ["trainer.micro_batch_size=4"], check=False).trainer.max_tokens_per_gpu is None
    dumped = Config.model_validate({"trainer": {"micro_batch_size": 4}}).model_dump()
    assert Config.model_validate(dumped).trainer.max_tokens_per_gpu is None


def test_expert_parallel_sizes(prompts):
    base = [f"data.prompt_data={prompts}", "cluster.actor_num_gpus_per_node=4", "data.rollout_batch_size=4",
            "data.n_samples_per_prompt=4"]
    cfg = load_config(None, base + ["parallel.expert_model_parallel_size=2", "parallel.expert_tensor_parallel_size=2",
                                    "algorithm.routing_replay=rollout"])
    assert (cfg.data_parallel_size, cfg.algorithm.routing_replay) == (4, "rollout")
    assert refused(None, base + ["parallel.expert_model_parallel_size=3"]).field == "parallel.expert_model_parallel_size"
    err = refused(None, base + ["parallel.expert_tensor_parallel_size=2"])
    assert err.field == "parallel.expert_tensor_parallel_size" and "expert_model_parallel_size > 1" in str(err)
    assert refused(None, base + ["algorithm.routing_replay=always"]).field == "algorithm.routing_replay"
