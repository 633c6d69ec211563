"""Issue 38's real-model comparison (`bash scripts/gpu/run.sh fp8-real-model`, benchmarks/fp8_real_model.py), its
CPU side: the 256 held-out prompts, each variant's config as the stage runs it passing `slime-cli plan`, the three
runs started side by side and interrupted at the deadline, and the verdicts read from what runs write."""

from __future__ import annotations

import json
import stat
import tarfile
from pathlib import Path

import pytest
from script_imports import import_script
from typer.testing import CliRunner

from slime_rl.cli.app import app

ROOT = Path(__file__).parents[2]


fp8_real_model = import_script(ROOT / "benchmarks", "fp8_real_model")


@pytest.fixture(scope="module")
def smol_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smol-data")
    import_script(ROOT / "scripts" / "gpu", "make_smollm2_data").write_task_data(out)
    return out


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_addition256_holds_out_256_prompts_the_runs_never_train_on(smol_data):
    train, held_out = rows_of(smol_data / "addition256_train.jsonl"), rows_of(smol_data / "addition256_eval.jsonl")
    assert len(held_out) == 256 and len(train) == 2500 - 256
    assert not {r["input"] for r in train} & {r["input"] for r in held_out}


@pytest.mark.parametrize("variant", sorted(fp8_real_model.VARIANTS))
def test_each_variant_as_the_stage_runs_it_passes_plan(variant, smol_data, tmp_path):
    """FP8 on SmolLM2 plans (its 576/192/192 partitions take 64 x 64 blocks), the corrections are known names, and
    the overrides land where the stage means them to."""
    overrides = fp8_real_model.overrides(variant, tmp_path / variant, smol_data)
    result = CliRunner().invoke(app, ["plan", str(fp8_real_model.CONFIG), *overrides])
    assert result.exit_code == 0, result.output
    fp8 = variant.startswith("fp8")
    assert ("precision: fp8" in result.stdout) == fp8
    correction = {"bf16": "null", "fp8-tis": "tis", "fp8-seq-mis": "seq-mask-tis"}[variant]
    assert f"rollout_correction: {correction}" in result.stdout
    assert f"mem_fraction_static: {fp8_real_model.MEM_FRACTION}" in result.stdout
    # the config's own eval set, its 64 prompts replaced by the 256 (a second set would be scored at every eval)
    assert f"addition: {smol_data / 'addition256_eval.jsonl'}" in result.stdout
    assert "addition_eval.jsonl" not in result.stdout


# ------------------------------------------------------------------ run: side by side, interrupted at the deadline


FAKE_TRAIN = """#!/usr/bin/env python3
# Stands in for `python -m slime_rl.cli.app train CONFIG KEY=VALUE...`: writes a metrics.jsonl into logging.dir,
# or, for the fp8-tis run, waits for the interrupt and exits 130 on it, as slime-cli does.
import json, signal, sys, time
from pathlib import Path
run = Path(next(a for a in sys.argv if a.startswith("logging.dir=")).split("=", 1)[1])
started = Path(run.parent / "started")
with started.open("a") as f:
    f.write(run.name + "\\n")
if run.name == "fp8-tis":
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
    time.sleep(600)
rows = [{"step": s, "train/train_rollout_logprob_abs_diff": 0.01} for s in range(1, 31)]
rows += [{"step": s, "eval/addition/pass@1": 0.1 + s / 60, "eval/addition/prompts": 256} for s in (0, 10, 20, 30)]
(run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in rows))
"""


def test_run_starts_every_variant_and_interrupts_what_outlives_the_deadline(smol_data, tmp_path, capsys):
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_TRAIN)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    logs = tmp_path / "fp8-real-model"
    # 8 s: on the loaded CI machine fp8-tis once missed a 3 s deadline's SIGINT and slept on through the 30 s grace
    # ("all done in 33 s"); most likely the signal came before the fake's exec, where it is lost
    code = fp8_real_model.run_all(logs, data=smol_data, stagger_s=0.1, deadline_s=8.0, python=str(fake))
    out = capsys.readouterr().out
    assert code == 1
    assert sorted((logs / "started").read_text().split()) == sorted(fp8_real_model.VARIANTS)
    assert "[fp8-real-model] fp8-tis: exit 130" in out  # interrupted, and said so
    assert "[fp8-real-model] bf16: exit 0" in out and (logs / "bf16" / "metrics.jsonl").is_file()
    # what a device call brings back (at most 8 files): the metrics compare reads and one archive of the logs
    kept = fp8_real_model.keep(logs, tmp_path / "out")
    assert sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*") if p.is_file()) == \
        sorted(str(p.relative_to(tmp_path / "out")) for p in kept) == ["bf16/metrics.jsonl", "fp8-seq-mis/metrics.jsonl",
                                                                      "logs.tgz"]
    with tarfile.open(tmp_path / "out" / "logs.tgz") as archive:
        assert sorted(archive.getnames()) == sorted(f"{v}.log" for v in fp8_real_model.VARIANTS)


def test_run_refuses_to_start_without_the_data(tmp_path, capsys):
    assert fp8_real_model.run_all(tmp_path / "logs", data=tmp_path, stagger_s=0, deadline_s=1) == 2
    assert "addition256_train.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


# ------------------------------------------------------------------ compare: the acceptance read from metrics


def write_run(folder: Path, variant: str, evals: dict[int, float], *, masked: float | None = None,
              prompts: int = 256) -> None:
    rows = []
    for step in range(1, 31):
        row = {"step": step, "train/train_rollout_logprob_abs_diff": 0.02 + 0.001 * step}
        if masked is not None:
            row |= {"train/rollout_corr_masked_frac": masked, "train/rollout_corr_masked_seq_frac": 2 * masked}
        rows.append(row)
    rows += [{"step": s, "eval/addition/pass@1": v, "eval/addition/prompts": prompts} for s, v in evals.items()]
    (folder / variant).mkdir(parents=True, exist_ok=True)
    (folder / variant / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


BF16 = {0: 0.02, 10: 0.3, 20: 0.6, 30: 0.7}


def test_compare_passes_fp8_runs_within_the_tolerance_and_reports_masking(tmp_path, capsys):
    write_run(tmp_path, "bf16", BF16)
    write_run(tmp_path, "fp8-tis", {0: 0.02, 10: 0.3, 20: 0.55, 30: 0.66})
    write_run(tmp_path, "fp8-seq-mis", {0: 0.02, 10: 0.2, 20: 0.6, 30: 0.8}, masked=0.015)
    assert fp8_real_model.compare(tmp_path, tolerance=0.1, png=None) == 0
    out = capsys.readouterr().out
    assert "PASS fp8-tis: mean held-out pass@1 at steps 20 and 30 0.605 against bf16's 0.650 (-0.045" in out
    assert "PASS fp8-seq-mis" in out and "FAIL" not in out
    seq = next(line for line in out.splitlines() if line.startswith("| fp8-seq-mis |"))
    assert "| 256 |" in seq and "| +0.050 |" in seq and "1.50%" in seq and "3.00%" in seq


@pytest.mark.parametrize("fp8_seq_mis, prompts, bf16, expected", [
    ({0: 0.02, 20: 0.4, 30: 0.5}, 256, BF16, "fp8-seq-mis: -0.200 from bf16, beyond +-0.1"),
    ({0: 0.02, 20: 0.6, 30: 0.7}, 64, BF16, "fp8-seq-mis: its evals scored 64 held-out prompts, fewer than 256"),
    ({0: 0.02, 20: 0.6, 30: 0.7}, 256, {0: 0.3, 20: 0.3, 30: 0.3}, "bf16: did not learn"),
    ({0: 0.02, 10: 0.3}, 256, BF16, "fp8-seq-mis: no held-out evals at steps 20 and 30"),
])
def test_compare_fails_what_the_acceptance_does_not_hold(fp8_seq_mis, prompts, bf16, expected, tmp_path, capsys):
    write_run(tmp_path, "bf16", bf16)
    write_run(tmp_path, "fp8-tis", bf16)
    write_run(tmp_path, "fp8-seq-mis", fp8_seq_mis, prompts=prompts)
    assert fp8_real_model.compare(tmp_path, tolerance=0.1, png=None) == 1
    assert f"[fp8-real-model] FAIL {expected}" in capsys.readouterr().out


def test_compare_names_a_run_that_wrote_nothing(tmp_path, capsys):
    write_run(tmp_path, "bf16", BF16)
    write_run(tmp_path, "fp8-tis", BF16)
    assert fp8_real_model.compare(tmp_path, tolerance=0.1, png=None) == 1
    missing = tmp_path / "fp8-seq-mis" / "metrics.jsonl"
    assert f"FAIL fp8-seq-mis: {missing} is missing (its console log: fp8-seq-mis.log in {tmp_path / 'logs.tgz'})" \
        in capsys.readouterr().out
