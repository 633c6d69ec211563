"""A resume never silently changes or ignores the user's intent (issue 34): before Ray starts, every
config change since the checkpoint is honoured (one line says so) or refused (one line names it and
the fix), and the data it resumes on is the checkpoint's by content, not by name and size."""

from __future__ import annotations

import io
import json

import pytest

from slime_rl.core.config import Config, ConfigError, load_config
from slime_rl.core.run import checkpoint, loop
from slime_rl.core.run.resume_check import check_resume, data_identity, leaves, rule_for

MODEL = "/models/policy-a"


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input": f"{i} + 1 =", "label": str(i + 1)}) + "\n" for i in range(20)))
    return path


def config(tmp_path, prompts, *overrides: str) -> Config:
    return load_config(None, [f"model.path={MODEL}", f"data.prompt_data={prompts}", "cluster.device=cpu",
                              "model.dtype=float32", f"logging.dir={tmp_path / 'run'}", "trainer.lr=2e-5",
                              *overrides], check=False)


def save_checkpoint(cfg: Config, step: int = 3) -> dict:
    """What loop._save writes into meta.json, beside the trainer's folders."""
    meta = {"rollout_state": {}, "run_id": "run-a", "model_dtype": cfg.model.dtype, "config": cfg.to_dict(),
            "data": data_identity(cfg)}
    checkpoint.prepare(cfg.checkpoint_dir, step, "run-a")
    checkpoint.commit(cfg.checkpoint_dir, step, meta)
    return checkpoint.resume_point(cfg.checkpoint_dir)[1]


def test_every_key_of_the_config_has_a_resume_rule():
    """The table (resume_check.RESUME_RULES) covers every key, the sections of the backends installed
    included (core's own tests also run in a venv with core alone: tests/e2e/test_packaging.py)."""
    from importlib.metadata import entry_points

    with_sglang = "sglang" in {ep.name for ep in entry_points(group="slime_rl.rollout_engines")}
    with_megatron = "megatron" in {ep.name for ep in entry_points(group="slime_rl.trainers")}
    cfg = Config.model_validate({"rollout": {"engine": "sglang", "sglang": {}} if with_sglang else {},
                                 "trainer": {"megatron": {}} if with_megatron else {}})
    keys = leaves(cfg.to_dict())
    assert "trainer.lora.rank" in keys
    assert ("rollout.sglang.router_policy" in keys) == with_sglang
    assert ("trainer.megatron.recompute" in keys) == with_megatron
    assert [k for k in keys if rule_for(k) is None] == []


def test_a_new_learning_rate_is_honoured_and_said(tmp_path, prompts):
    meta = save_checkpoint(config(tmp_path, prompts))
    out = io.StringIO()
    notes = check_resume(config(tmp_path, prompts, "trainer.lr=0.001", "rollout.temperature=0.7",
                                "checkpoint.resume=true"), meta, out=out)
    assert notes == [
        "resume: rollout.temperature: 1.0 -> 0.7: honoured from step 4 (the rollout uses it from the next step)",
        "resume: trainer.lr: 2e-05 -> 0.001: honoured from step 4 (the schedule continues at the checkpoint's"
        " step with the new value)"]
    assert out.getvalue().splitlines() == [f"slime-rl: {n}" for n in notes]


def test_what_cannot_change_is_refused_one_line_per_key_with_the_fix(tmp_path, prompts):
    meta = save_checkpoint(config(tmp_path, prompts))
    out = io.StringIO()
    changed = config(tmp_path, prompts, "model.path=/models/policy-b", "model.dtype=bfloat16",
                     "algorithm.advantage_estimator=reinforce_plus_plus", "trainer.lora.rank=8", "trainer.lr=0.001")
    with pytest.raises(ConfigError) as refused:
        check_resume(changed, meta, out=out)
    lines = [line.removeprefix("slime-rl: resume refused: ") for line in out.getvalue().splitlines()
             if "refused" in line]
    assert [line.split(":")[0] for line in lines] == ["algorithm.advantage_estimator", "model.dtype", "model.path",
                                                      "trainer.lora.rank"]
    assert lines[2] == ("model.path: /models/policy-a -> /models/policy-b cannot change on a resume (the"
                        " checkpoint's weights and Adam moments are that model's); set it back to /models/policy-a,"
                        " or start a fresh run (checkpoint.resume=false, another checkpoint.save_dir)")
    message = str(refused.value)
    assert message.startswith("checkpoint.resume: 4 change(s) cannot be honoured on a resume: ")
    assert all(line in message for line in lines) and "\n" not in message
    assert "trainer.lr" not in message  # honoured, not refused


def test_other_data_under_the_same_name_and_size_is_refused(tmp_path, prompts):
    meta = save_checkpoint(config(tmp_path, prompts))
    text = prompts.read_text()
    prompts.write_text(text.replace('"label": "3"', '"label": "4"'))  # same name, same size, other data
    assert len(prompts.read_text()) == len(text)
    with pytest.raises(ConfigError, match=r"data.prompt_data: .*prompts.jsonl is not the data the checkpoint was"
                                          r" trained on \(sha256 \w{12}, \d+ bytes at the checkpoint; \w{12}, \d+"
                                          r" bytes now\); resume with that data, or start a fresh run"):
        check_resume(config(tmp_path, prompts), meta, out=io.StringIO())


def test_the_same_data_at_another_path_is_honoured_and_said(tmp_path, prompts):
    meta = save_checkpoint(config(tmp_path, prompts))
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(prompts.read_bytes())
    notes = check_resume(config(tmp_path, moved, f"eval.prompt_data={{held_out: {prompts}}}"), meta,
                         out=io.StringIO())
    assert notes == ["resume: eval.prompt_data.held_out: added: honoured (evaluation uses it from now on)",
                     f"resume: data.prompt_data: {prompts} -> {moved}: honoured (the same content, sha256"
                     f" {data_identity(config(tmp_path, moved))['data.prompt_data']['sha256'][:12]})"]


def test_a_large_file_is_identified_by_a_sample_and_its_size(tmp_path, monkeypatch):
    monkeypatch.setattr("slime_rl.core.run.resume_check.FULL_HASH_BYTES", 1 << 16)
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"x" * (1 << 20))
    cfg = load_config(None, [f"data.prompt_data={big}"], check=False)
    first = data_identity(cfg)["data.prompt_data"]
    with big.open("r+b") as f:  # the first block changes: sampled, so seen
        f.write(b"y")
    second = data_identity(cfg)["data.prompt_data"]
    assert first["sampled"] and first["bytes"] == second["bytes"] and first["sha256"] != second["sha256"]


def test_train_refuses_a_changed_model_before_ray_starts(tmp_path, prompts, monkeypatch, capfd):
    save_checkpoint(config(tmp_path, prompts))

    def no_ray(cfg):
        raise AssertionError("Ray started before the resume was checked")

    monkeypatch.setattr(loop, "local_ray", no_ray)
    with pytest.raises(ConfigError, match="^checkpoint.resume: 1 change.* model.path: /models/policy-a ->"):
        loop.train(config(tmp_path, prompts, "checkpoint.resume=true", "model.path=/models/policy-b"))
    assert "slime-rl: resume refused: model.path: /models/policy-a -> /models/policy-b" in capfd.readouterr().err
