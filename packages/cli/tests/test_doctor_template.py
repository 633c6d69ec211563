"""`slime-cli doctor --model PATH`: the chat-template parity check, its first differing position with both
decodings, and the exit code."""

from __future__ import annotations

from typer.testing import CliRunner

from slime_rl.cli.app import app
from slime_rl.core.testing import chat_tokenizer

runner = CliRunner()


def test_doctor_model_reports_match_and_drift(tmp_path):
    good = tmp_path / "good"
    chat_tokenizer().save_pretrained(good)
    result = runner.invoke(app, ["doctor", "--model", str(good)])
    lines = result.stdout.split("multi-turn parity", 1)[1].splitlines()
    assert [line.split()[-1] for line in lines[1:5]] == ["match"] * 4, result.stdout

    # History rendered with an extra newline after the assistant header that the generation prompt lacks:
    # the model samples "\n" + content as pieces of its own, the template tokenises them with the header's.
    drift = chat_tokenizer()
    drift.chat_template = drift.chat_template.replace("'<|im_start|>assistant\\n' + content",
                                                      "'<|im_start|>assistant\\n\\n' + content")
    bad = tmp_path / "bad"
    drift.save_pretrained(bad)
    result = runner.invoke(app, ["doctor", "--model", str(bad)])
    assert result.exit_code == 1
    report = result.stdout.split("multi-turn parity", 1)[1]
    assert "differs at token" in report
    assert "turn by turn: " in report and "template:     " in report
    turn_by_turn = next(line for line in report.splitlines() if "turn by turn:" in line)
    template = next(line for line in report.splitlines() if "template:" in line)
    assert turn_by_turn.split(":", 1)[1] != template.split(":", 1)[1]


def test_doctor_model_that_does_not_load_is_one_line(tmp_path):
    result = runner.invoke(app, ["doctor", "--model", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert "error: --model: " in result.output and "not a model folder" in result.output
