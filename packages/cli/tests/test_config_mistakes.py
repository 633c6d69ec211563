"""Every config mistake ends `slime-cli plan` and `slime-cli train` the same way, before anything starts:
exit 2 and one stderr line ``error: <field>: <what is wrong and the fix>`` (issue 13, items 7-9).

Each case is a working config with one mistake in it. `train` must refuse it before its loop (which
starts Ray) is entered; `test_train_refuses_before_ray_in_a_fresh_process` checks that end to end."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import yaml
from typer.testing import CliRunner

from slime_rl.cli.app import app

runner = CliRunner()
MODULE = "cfg_mistake_user_code"  # a user's module, written next to the config (see `workspace`)
USER_CODE = {
    MODULE: "NOT_CALLABLE = 3\n\ndef sync_generate(sample, params, engine):\n    return sample\n",
    "cfg_mistake_syntax": "def reward(sample):\n    return 1 +\n",
    "cfg_mistake_name": "import math\nkeep = undefined_filter\n",
    "cfg_mistake_raises": "raise RuntimeError('needs MY_API_KEY')\n",
    "cfg_mistake_import": "import no_such_package_for_slime_tests\n",
}
BOMB = "[" + ", ".join(f"&{n} [" + ", ".join([f"*{p}" if p else "lol"] * 9) + "]"
                       for n, p in zip("abcdefg", ["", *"abcdef"], strict=True)) + "]"  # 9**7 values, ~300 bytes


def base_tree(tmp_path):
    return {
        "model": {"path": "builtin:smollm2-135m-instruct"},
        "data": {"prompt_data": str(tmp_path / "prompts.jsonl"), "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "rollout": {"engine": "hf", "reward": "math", "max_response_len": 8},
        "trainer": {"backend": "megatron", "lr": 1.0e-5},
        "cluster": {"device": "cpu"},
        "checkpoint": {"save_dir": str(tmp_path / "ckpt")},
        "logging": {"dir": str(tmp_path / "logs")},
    }


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """tmp_path with a prompt file and the user modules (importable, as a user's own code is)."""
    (tmp_path / "prompts.jsonl").write_text('{"input": "1 + 1 =", "label": "2"}\n')
    for name, source in USER_CODE.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in USER_CODE:
        sys.modules.pop(name, None)


def write_config(tmp_path, changes):
    """The base config with ``changes`` ({"section.key": value}) applied; "{tmp}" in a value is tmp_path."""
    tree = base_tree(tmp_path)
    for dotted, value in changes.items():
        section, key = dotted.split(".", 1)
        if isinstance(value, dict):
            value = {k: v.replace("{tmp}", str(tmp_path)) for k, v in value.items()}
        tree.setdefault(section, {})[key] = value.replace("{tmp}", str(tmp_path)) if isinstance(value, str) else value
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def raw_config(text: bytes | str):
    def make(tmp_path):
        path = tmp_path / "run.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path
    return make


def config_dir(tmp_path):
    (tmp_path / "configs").mkdir()
    return tmp_path / "configs"


def with_model_json(text, model_path="model"):
    def make(tmp_path):
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text(text)
        return write_config(tmp_path, {"model.path": "{tmp}/" + model_path})
    return make


def with_file_as_logging_dir(tmp_path):
    (tmp_path / "logs.txt").write_text("not a folder")
    return write_config(tmp_path, {"logging.dir": "{tmp}/logs.txt"})


def with_prompt_dir(tmp_path):
    (tmp_path / "prompts").mkdir()
    return write_config(tmp_path, {"data.prompt_data": "{tmp}/prompts"})


# (case, mistake: {dotted: value} or a function of tmp_path returning the config, overrides, field, words)
# "{config}" and "{tmp}" in field and words stand for the config file and tmp_path.
MISTAKES = [
    # item 7: names that resolve to nothing, user code that cannot run as the run calls it
    ("reward typo", {"rollout.reward": "mathh"}, [], "rollout.reward", "did you mean 'math'?"),
    ("reward not callable", {"rollout.reward": f"{MODULE}:NOT_CALLABLE"}, [], "rollout.reward", "not a callable"),
    ("reward attribute missing", {"rollout.reward": f"{MODULE}:nope"}, [], "rollout.reward", "no attribute 'nope'"),
    ("reward module missing", {"rollout.reward": "no_such_module_x:reward"}, [], "rollout.reward",
     "cannot import module 'no_such_module_x'"),
    ("remote without url", {"rollout.reward": "remote"}, [], "rollout.reward_url", "set rollout.reward_url=http"),
    ("reward url not http", {"rollout.reward": "remote", "rollout.reward_url": "localhost:8000"}, [],
     "rollout.reward_url", "give http://"),
    ("builtin as group reward", {"rollout.reward": "f1", "rollout.group_reward": True}, [], "rollout.group_reward",
     "set rollout.group_reward=false"),
    ("filter typo", {"rollout.dynamic_sampling_filter": "nonzero"}, [], "rollout.dynamic_sampling_filter",
     "did you mean 'nonzero_std'?"),
    ("buffer filter typo", {"rollout.buffer_filter": "freshest"}, [], "rollout.buffer_filter",
     "did you mean 'freshest_first'?"),
    ("generate_fn not async", {"rollout.generate_fn": f"{MODULE}:sync_generate"}, [], "rollout.generate_fn",
     "not an `async def`"),
    ("generate_fn typo", {"rollout.generate_fn": "multi_trun"}, [], "rollout.generate_fn",
     "did you mean 'multi_turn'?"),
    ("tool attribute missing", {"rollout.generate_fn": "multi_turn", "rollout.tools": [f"{MODULE}:nope"]}, [],
     "rollout.tools[0]", "no attribute 'nope'"),
    ("tool not callable", {"rollout.generate_fn": "multi_turn", "rollout.tools": [f"{MODULE}:NOT_CALLABLE"]}, [],
     "rollout.tools[0]", "not a callable"),
    ("tools without multi_turn", {"rollout.tools": [f"{MODULE}:sync_generate"]}, [], "rollout.tools",
     "set rollout.generate_fn=multi_turn"),
    ("SyntaxError in the user's module", {"rollout.reward": "cfg_mistake_syntax:reward"}, [], "rollout.reward",
     "{tmp}/cfg_mistake_syntax.py:2: SyntaxError"),
    ("NameError in the user's module", {"rollout.dynamic_sampling_filter": "cfg_mistake_name:keep"}, [],
     "rollout.dynamic_sampling_filter", "{tmp}/cfg_mistake_name.py:2: NameError"),
    ("user's module raises", {"rollout.generate_fn": "cfg_mistake_raises:generate"}, [], "rollout.generate_fn",
     "{tmp}/cfg_mistake_raises.py:1: RuntimeError: needs MY_API_KEY"),
    ("user's module imports a missing package", {"rollout.reward": "cfg_mistake_import:reward"}, [],
     "rollout.reward", "{tmp}/cfg_mistake_import.py:1: ModuleNotFoundError"),
    ("engine typo", {"rollout.engine": "hff"}, [], "rollout.engine", "did you mean 'hf'?"),
    ("buffer typo", {"data.buffer": "defualt"}, [], "data.buffer", "did you mean 'default'?"),
    ("eval source typo", {"eval.source": "jsonll"}, [], "eval.source", "did you mean 'jsonl'?"),
    ("eval source module missing", {"eval.source": "no_such_module_x:Source"}, [], "eval.source",
     "cannot import module 'no_such_module_x'"),
    ("trainer typo", {"trainer.backend": "megatorn"}, [], "trainer.backend", "did you mean 'megatron'?"),
    ("data source typo", {"data.source": "jsonll"}, [], "data.source", "did you mean 'jsonl'?"),
    ("engine module broken", {"rollout.engine": "cfg_mistake_syntax:Engine"}, [], "rollout.engine",
     "cfg_mistake_syntax.py:2: SyntaxError"),
    # item 8: values of the right shape that make no sense
    ("batch size true", {"data.rollout_batch_size": True}, [], "data.rollout_batch_size",
     "must be a whole number (got true, a boolean)"),
    ("batch size 2.5", {"trainer.micro_batch_size": 2.5}, [], "trainer.micro_batch_size", "whole number"),
    ("batch size as a string", {"data.n_samples_per_prompt": "8"}, [], "data.n_samples_per_prompt", "whole number"),
    ("lr .inf", {"trainer.lr": math.inf}, [], "trainer.lr", "finite number"),
    ("lr 0", {"trainer.lr": 0.0}, [], "trainer.lr", "greater than 0"),
    ("lr true", {"trainer.lr": True}, [], "trainer.lr", "must be a number (got true, a boolean)"),
    ("min_lr above lr", {"trainer.min_lr": 1.0e-3}, [], "trainer.min_lr", "at most lr"),
    ("top_k 0", {"rollout.top_k": 0}, [], "rollout.top_k", "-1 (off) or a value >= 1"),
    ("top_p 0", {"rollout.top_p": 0.0}, [], "rollout.top_p", "greater than 0"),
    ("temperature a word", {"rollout.temperature": "hot"}, [], "rollout.temperature", "must be a number"),
    ("clip_grad -1", {"trainer.clip_grad": -1}, [], "trainer.clip_grad", "greater than or equal to 0"),
    ("adam_beta1 2", {"trainer.adam_beta1": 2}, [], "trainer.adam_beta1", "less than 1"),
    ("adam_beta2 1", {"trainer.adam_beta2": 1.0}, [], "trainer.adam_beta2", "less than 1"),
    ("adam_eps 0", {"trainer.adam_eps": 0}, [], "trainer.adam_eps", "greater than 0"),
    ("weight_decay -1", {"trainer.weight_decay": -1}, [], "trainer.weight_decay", "greater than or equal to 0"),
    ("seed -1", {"trainer.seed": -1}, [], "trainer.seed", "greater than or equal to 0"),
    ("critic_lr 0", {"trainer.critic_lr": 0}, [], "trainer.critic_lr", "greater than 0"),
    ("gamma nan", {"algorithm.gamma": math.nan}, [], "algorithm.gamma", "finite number"),
    ("lambd 1.5", {"algorithm.lambd": 1.5}, [], "algorithm.lambd", "less than or equal to 1"),
    ("kl_loss_coef -0.1", {"algorithm.kl_loss_coef": -0.1}, [], "algorithm.kl_loss_coef",
     "greater than or equal to 0"),
    ("eps_clip_high -0.2", {"algorithm.eps_clip_high": -0.2}, [], "algorithm.eps_clip_high", "greater than 0"),
    ("eval.temperature -1", {"eval.temperature": -1}, [], "eval.temperature", "greater than or equal to 0"),
    ("eval.max_response_len 0", {"eval.max_response_len": 0}, [], "eval.max_response_len", "greater than or equal"),
    ("num_cpus -1", {"cluster.num_cpus": -1}, [], "cluster.num_cpus", "greater than or equal to 1"),
    ("reward_timeout .inf", {"rollout.reward_timeout": math.inf}, [], "rollout.reward_timeout", "finite"),
    ("stop token id -1", {"rollout.stop_token_ids": [2, -1]}, [], "rollout.stop_token_ids.1", "greater than or equal"),
    ("a boolean as a string", {"data.shuffle": "yes"}, [], "data.shuffle", "must be true or false (got 'yes')"),
    ("a boolean as 1", {"cluster.colocate": 1}, [], "cluster.colocate", "must be true or false"),
    ("a path as a number", {"logging.dir": 3}, [], "logging.dir", "must be a string"),
    ("bad override value", {}, ["trainer.lr=.inf"], "trainer.lr", "finite number"),
    # item 9: files that cannot be read as a config or a model
    ("config not UTF-8", raw_config(b"data:\n  input_key: caf\xe9\n"), [], "{config}:2", "not UTF-8"),
    ("config is a directory", config_dir, [], "config", "is a directory"),
    ("YAML alias bomb", raw_config(f"data:\n  input_key: {BOMB}\n"), [], "{config}", "alias"),
    ("YAML alias bomb in an override", {}, [f"rollout.engine_args={{x: {BOMB}}}"], "rollout.engine_args", "alias"),
    ("recursive YAML alias", raw_config("rollout:\n  engine_args: &a {x: *a}\n"), [], "{config}", "refers to itself"),
    ("deep YAML nesting", raw_config("rollout:\n  stop: " + "[" * 100_000 + "\n"), [], "{config}:2", "deeper"),
    ("config too big", raw_config("# padding\n" * 200_000), [], "{config}", "is it the right file?"),
    ("invalid YAML", raw_config("data:\n  input_key: [unclosed\n"), [], "{config}:3", "not valid YAML"),
    ("model config.json not JSON", with_model_json("{num_attention_heads: 9,"), [], "model.path",
     "{tmp}/model/config.json:1: not valid JSON"),
    ("model config.json not a mapping", with_model_json("[1, 2]"), [], "model.path", "not an HF config mapping"),
    ("model heads not a number", with_model_json('{"num_attention_heads": "nine"}'), [], "model.path",
     "num_attention_heads is 'nine'"),
    ("model path is a file", with_model_json("{}", "model/config.json"), [], "model.path", "is a file"),
    ("eval data is a directory", {"eval.prompt_data": {"math": "{tmp}"}}, [], "eval.prompt_data.math",
     "is a directory"),
    ("tokenizer folder missing", {"model.tokenizer_path": "{tmp}/no-tokenizer"}, [], "model.tokenizer_path",
     "does not exist"),
    ("prompt data is a directory", with_prompt_dir, [], "data.prompt_data", "is a directory"),
    ("logging.dir is a file", with_file_as_logging_dir, [], "logging.dir", "give a directory"),
    # a backend's own keys (rollout.sglang, SGLangSettings): the same one line, naming the full field
    ("engine url not a URL", {"rollout.engine": "sglang"}, ["rollout.sglang.engine_urls=[10.0.0.1:30000]"],
     "rollout.sglang.engine_urls", "http://"),
    ("engine_python missing", {"rollout.engine": "sglang", "rollout.sglang": {"engine_python": "{tmp}/venv/bin/python"}},
     [], "rollout.sglang.engine_python", "not an executable interpreter"),
    ("backend key mistyped", {"rollout.engine": "sglang"}, ["rollout.sglang.chunk_prefill_size=512"],
     "rollout.sglang.chunk_prefill_size", "did you mean `rollout.sglang.chunked_prefill_size`?"),
    ("chunked prefill size 0", {"rollout.engine": "sglang"}, ["rollout.sglang.chunked_prefill_size=0"],
     "rollout.sglang.chunked_prefill_size", "or -1 to turn chunked prefill off (got 0)"),

]


def assert_one_line_error(result, field, words):
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {field}: "), lines[0]
    assert words in lines[0], lines[0]
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("mistake,overrides,field,words", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_plan_and_train_refuse_in_one_line(workspace, loop_never_entered, mistake, overrides, field, words):
    config = mistake(workspace) if callable(mistake) else write_config(workspace, mistake)
    field, words = (s.replace("{config}", str(config)).replace("{tmp}", str(workspace)) for s in (field, words))
    for command in ("plan", "train"):
        began = time.perf_counter()
        result = runner.invoke(app, [command, str(config), *overrides])
        assert_one_line_error(result, field, words)
        assert time.perf_counter() - began < 10, f"{command} took {time.perf_counter() - began:.1f} s to refuse"
    assert loop_never_entered.calls == []


def test_the_base_config_plans(workspace):
    """The mistakes above are the only thing wrong with their configs."""
    result = runner.invoke(app, ["plan", str(write_config(workspace, {}))])
    assert result.exit_code == 0, result.output
    memory_line = result.stdout.splitlines()[-1]  # the estimate per trainer rank, against this machine's RAM
    assert memory_line.startswith("memory per trainer rank: about ") and "GiB of RAM available" in memory_line
    result = runner.invoke(app, ["plan", str(write_config(workspace, {
        "rollout.reward": "remote", "rollout.reward_url": "http://127.0.0.1:9/score", "rollout.top_k": 20,
        "rollout.dynamic_sampling_filter": "nonzero_std", "rollout.buffer_filter": "freshest_first",
        "trainer.lr": 1, "trainer.clip_grad": 0, "algorithm.gamma": 0.99, "data.shuffle": True,
        "rollout.generate_fn": "multi_turn", "rollout.tools": [f"{MODULE}:sync_generate"]}))])
    assert result.exit_code == 0, result.output


LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}


def test_a_model_that_clearly_cannot_fit_is_refused_with_the_estimate(workspace, loop_never_entered, monkeypatch):
    """A 70B full fine-tune on a 23 GB CPU machine: refused before anything starts (issue 34)."""
    from slime_rl.core.config import memory

    monkeypatch.setattr(memory, "available_ram_bytes", lambda: 23 * 10**9)
    folder = workspace / "llama70b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_70B))  # the shape alone, no weights
    config = write_config(workspace, {"model.path": str(folder)})
    for command in ("plan", "train"):
        result = runner.invoke(app, [command, str(config)])
        assert_one_line_error(result, "model.path", f"{folder} does not fit: about ")
        assert "GiB of RAM available on this machine gives 21.4 GiB a rank" in result.stderr
    assert loop_never_entered.calls == []


def test_an_old_key_name_plans_with_a_one_line_notice(workspace):
    """A key that moved into a backend's section still works for a release; one stderr line names the new key."""
    result = runner.invoke(app, ["plan", str(write_config(workspace, {})), "rollout.engine_args={max_batch_size: 4}",
                                 "trainer.recompute=true"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "notice: rollout.engine_args is now rollout.hf; the old name works until the next release",
        "notice: trainer.recompute is now trainer.megatron.recompute; the old name works until the next release"]
    assert "  hf:\n    max_batch_size: 4\n" in result.stdout and "  megatron:\n    recompute: true\n" in result.stdout


# slime-cli, then (on stdout) how many of Ray's modules it imported
CLI_THEN_COUNT_RAY = """
import sys
from slime_rl.cli.app import main
sys.argv[0] = "slime-cli"
try:
    main()
finally:
    print("ray modules imported:", sum(name == "ray" or name.startswith("ray.") for name in sys.modules))
"""


def test_train_refuses_before_ray_in_a_fresh_process(workspace):
    """The real `slime-cli train` (no stand-in loop): exit 2, one line, quickly, Ray not even imported."""
    for changes, field in [({"rollout.reward": "mathh"}, "rollout.reward"),
                           ({"data.rollout_batch_size": True}, "data.rollout_batch_size"),
                           ({"rollout.reward": "cfg_mistake_syntax:reward"}, "rollout.reward")]:
        config = write_config(workspace, changes)
        began = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", CLI_THEN_COUNT_RAY, "train", str(config)], capture_output=True,
                              text=True, timeout=120, cwd=workspace,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(workspace), *sys.path])})
        elapsed = time.perf_counter() - began
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"error: {field}: "), proc.stderr
        assert proc.stdout == "ray modules imported: 0\n"
        assert not (workspace / "logs").exists() and not (workspace / "ckpt").exists()
        assert elapsed < 60, elapsed  # the interpreter and torch import; Ray's start alone takes longer here
