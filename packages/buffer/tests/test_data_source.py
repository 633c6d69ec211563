"""PromptDataSource: groups, epochs and shuffles, keys, chat templates, Parquet, bad input, resume."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from buffer_testdata import arithmetic_rows, write_jsonl

from slime_rl.buffer import DataError, PromptDataSource, SampleBuffer
from slime_rl.core.config import Config
from slime_rl.core.sample import SampleStatus


def prompts_of(groups):
    return [g[0].prompt for g in groups]


def read_all(source, batch=3):
    out = []
    while not source.exhausted:
        out += source.get_groups(batch)
    return out


# ---------------------------------------------------------------- groups and order


def test_groups_hold_n_pending_copies_with_global_indices(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", arithmetic_rows(6))
    source = PromptDataSource(path, n_samples_per_prompt=3, seed=1)
    groups = source.get_groups(4)
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    assert [s.index for g in groups for s in g] == list(range(12))
    assert [g[0].group_index for g in groups] == [0, 1, 2, 3]
    for g in groups:
        assert all(s.status == SampleStatus.PENDING and s.group_index == g[0].group_index for s in g)
        assert len({s.prompt for s in g}) == 1 and len({s.label for s in g}) == 1
        row = g[0].metadata["row"]
        assert g[0].prompt == f"what is {row} + {row % 7} ?" and g[0].label == str(row + row % 7)
    # copies, not aliases: a generate function may edit one sample's metadata
    groups[0][0].metadata["row"] = -1
    assert groups[0][1].metadata["row"] != -1
    # the next call continues the indices
    assert source.get_groups(1)[0][0].index == 12


def test_each_epoch_is_a_fresh_shuffle_of_every_prompt(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", arithmetic_rows(7))
    source = PromptDataSource(path, n_samples_per_prompt=1, seed=3, num_epoch=3)
    groups = read_all(source, batch=3)
    assert len(groups) == 21 and source.exhausted and source.get_groups(5) == []
    epochs = [prompts_of(groups[i * 7:(i + 1) * 7]) for i in range(3)]
    for order in epochs:
        assert sorted(order) == sorted(r["input"] for r in arithmetic_rows(7))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    # same seed, same orders; another seed, another order
    again = read_all(PromptDataSource(path, seed=3, num_epoch=3), batch=5)
    assert prompts_of(again) == prompts_of(groups)
    assert prompts_of(PromptDataSource(path, seed=4).get_groups(7)) != epochs[0]


def test_no_shuffle_reads_in_file_order_and_num_epoch_none_cycles(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", arithmetic_rows(4))
    ordered = PromptDataSource(path, shuffle=False, num_epoch=None)
    groups = ordered.get_groups(10)  # one call crosses two epoch boundaries
    assert [g[0].metadata["row"] for g in groups] == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert (ordered.epoch, ordered.position, ordered.exhausted) == (2, 2, False)


def test_blank_lines_are_ignored(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ["", json.dumps({"input": "a", "label": "1"}), "  ",
                                              json.dumps({"input": "b", "label": "2"})])
    source = PromptDataSource(path, shuffle=False)
    assert len(source) == 3  # "  " is a line with content to the scan; it is skipped on read
    assert prompts_of(read_all(source)) == ["a", "b"] and source.num_skipped == 0


def test_custom_keys_metadata_and_tools(tmp_path):
    tools = [{"type": "function", "function": {"name": "calc"}}]
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"question": "hello", "answer": 42, "extra": {"level": 2}, "functions": tools},
        {"question": "world", "answer": ["a", "b"]},
    ])
    source = PromptDataSource(path, input_key="question", label_key="answer", metadata_key="extra",
                              tools_key="functions", shuffle=False)
    first, second = source.get_groups(2)
    assert first[0].label == 42 and first[0].metadata == {"level": 2, "tools": tools}
    assert second[0].label == ["a", "b"] and second[0].metadata == {}
    unlabeled = PromptDataSource(path, input_key="question", label_key=None, shuffle=False)
    assert unlabeled.get_groups(1)[0][0].label is None


def test_eval_set_reads_every_prompt_once_in_order(tmp_path):
    path = write_jsonl(tmp_path / "eval.jsonl", arithmetic_rows(5))
    cfg = Config()
    cfg.eval.prompt_data = {"arith": str(path)}
    cfg.eval.n_samples_per_prompt = 2
    source = PromptDataSource.for_eval(cfg, "arith")
    groups = source.get_groups(100)
    assert [g[0].metadata["row"] for g in groups] == [0, 1, 2, 3, 4] and all(len(g) == 2 for g in groups)
    assert source.exhausted and source.get_groups(1) == []
    with pytest.raises(DataError, match="eval.prompt_data.nope"):
        PromptDataSource.for_eval(cfg, "nope")


def test_from_config(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", arithmetic_rows(3))
    cfg = Config()
    cfg.data.prompt_data, cfg.data.n_samples_per_prompt, cfg.data.num_epoch = str(path), 2, 2
    source = PromptDataSource.from_config(cfg)
    assert source.num_epoch == 2 and len(source.get_groups(1)[0]) == 2
    cfg.data.num_rollout = 10  # slime: num_rollout wins over num_epoch, the data cycles
    assert PromptDataSource.from_config(cfg).num_epoch is None


# ---------------------------------------------------------------- tokens


def test_chat_template_and_plain_tokens(tmp_path, tokenizer):
    tools = [{"name": "calc"}]
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"input": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 + 2 ?"}],
         "label": "4", "tools": tools},
        {"input": "what is 3 + 3 ?", "label": "6"},
    ])
    chat, text = PromptDataSource(path, tokenizer=tokenizer, shuffle=False).get_groups(2)
    assert tokenizer.decode(chat[0].tokens) == "<|tools|> 1 <|system|> be brief <|user|> what is 2 + 2 ? <|assistant|>"
    assert chat[0].metadata["tools"] == tools and chat[0].prompt[1]["content"] == "what is 2 + 2 ?"
    assert tokenizer.decode(text[0].tokens) == "what is 3 + 3 ?"  # plain text: no template unless asked
    assert chat[0].prompt_length == len(chat[0].tokens) and chat[0].response_length == 0

    templated = PromptDataSource(path, tokenizer=tokenizer, shuffle=False, apply_chat_template=True).get_groups(2)
    assert tokenizer.decode(templated[1][0].tokens) == "<|user|> what is 3 + 3 ? <|assistant|>"


def test_prompts_over_max_prompt_len_are_left_out_and_counted(tmp_path, tokenizer, caplog):
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "hello", "label": "a"},
                                              {"input": "what is 1 + 1 ?", "label": "b"},
                                              {"input": "hello world", "label": "c"}])
    source = PromptDataSource(path, tokenizer=tokenizer, shuffle=False, max_prompt_len=2)
    with caplog.at_level(logging.WARNING):
        groups = read_all(source)
    assert [g[0].label for g in groups] == ["a", "c"] and source.num_too_long == 1
    assert "max_prompt_len=2" in caplog.text


# ---------------------------------------------------------------- Parquet


def test_parquet_by_row_groups_matches_jsonl(tmp_path):
    rows = arithmetic_rows(11)
    jsonl = write_jsonl(tmp_path / "p.jsonl", rows)
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=3)  # 4 row groups
    assert pq.ParquetFile(parquet).metadata.num_row_groups == 4
    a = read_all(PromptDataSource(jsonl, seed=9, num_epoch=2), batch=4)
    b = read_all(PromptDataSource(parquet, seed=9, num_epoch=2), batch=4)
    assert [(g[0].prompt, g[0].label, g[0].metadata, g[0].index) for g in a] == \
           [(g[0].prompt, g[0].label, g[0].metadata, g[0].index) for g in b]


def test_parquet_chat_messages_and_missing_column(tmp_path):
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": "hello"}], "label": "x"}]), path)
    group = PromptDataSource(path, input_key="messages").get_groups(1)[0]
    assert group[0].prompt == [{"role": "user", "content": "hello"}]
    with pytest.raises(DataError) as err:
        PromptDataSource(path)  # input_key defaults to "input"
    assert str(err.value) == (f"data.input_key: no column 'input' in {path} (columns: label, messages); "
                              "set data.input_key")


# ---------------------------------------------------------------- bad input


def one_line_error(source_or_factory) -> str:
    with pytest.raises(DataError) as err:
        source_or_factory()
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("line, expected", [
    ('{"input": "x", "label": ', "malformed JSON (Expecting value)"),
    ('["input", "x"]', "expected a JSON object per line, got list"),
    ('{"prompt": "x", "label": "1"}', "no input key 'input' (keys: prompt, label); set data.input_key"),
    ('{"input": 7, "label": "1"}', "input 'input' must be a string or a list of chat messages"),
    ('{"input": "x", "label": true}', "label 'label' is bool; a label must be a string, number, list or object"),
    ('{"input": "x", "label": null}', "label 'label' is null"),
    ('{"input": "x"}', "no label key 'label' (keys: input); set data.label_key"),
    ('{"input": "x", "label": "1", "metadata": [1]}', "metadata 'metadata' must be an object, got list"),
    ('{"input": "", "label": "1"}', "input 'input' is empty"),
    ('{"input": " \\n ", "label": "1"}', "input 'input' is only whitespace"),
    ('{"input": [], "label": "1"}', "input 'input' must be a string or a list of chat messages ({role, content}), "
                                    "got an empty list"),
    ('{"input": [{"role": "user", "content": 5}], "label": "1"}', "input 'input' must be a string or a list of chat "
     'messages ({role, content}), but message 0 is {"role": "user", "content": 5} (role a string; content a string, '
     "list or null)"),
    ('{"input": [{"role": "user", "content": "hi"}, {"content": "x"}], "label": "1"}', "input 'input' must be a "
     'string or a list of chat messages ({role, content}), but message 1 is {"content": "x"}'),
    ('{"input": "x", "label": "1", "tools": {"name": "f"}}', "tools 'tools' must be a list of tool schemas"),
    ('{"input": "x", "label": ' + "9" * 5000 + "}", "malformed JSON (Exceeds the limit (4300 digits)"),
    (b'{"input": "\xff", "label": "1"}', "malformed JSON (not UTF-8)"),
    ('{"input": "a\\ud800b", "label": "1"}', "holds a lone UTF-16 surrogate escape"),
    ('{"input": "x", "label": "1", "metadata": {"k": ["\\udc00"]}}', "holds a lone UTF-16 surrogate escape"),
    ('{"input": "x", "label": "1", "metadata": {"a": ' + "[" * 5000 + "]" * 5000 + "}}",
     "nested too deeply to parse (more than 100 levels)"),  # json's RecursionError
    ('{"input": "x", "label": "1", "metadata": {"a": ' + "[" * 150 + "]" * 150 + "}}",
     "nested more than 100 levels deep"),  # json parses it; copying and storing samples would not
])
def test_a_bad_line_names_file_line_and_reason(tmp_path, line, expected):
    path = tmp_path / "p.jsonl"
    raw = line if isinstance(line, bytes) else line.encode()
    path.write_bytes(b'{"input": "ok", "label": "1"}\n' + raw + b'\n{"input": "ok2", "label": "2"}\n')
    source = PromptDataSource(path, shuffle=False)
    before = source.state_dict()
    message = one_line_error(lambda: source.get_groups(3))
    assert message.startswith(f"{path}:2: {expected}"), message
    assert "set data." in message.rsplit("; ", 1)[-1]  # the fix comes last
    assert source.state_dict() == before  # a failed call does not move the source
    # the driver's check reads the same line the same way (one parser, so they never disagree)
    assert one_line_error(lambda: PromptDataSource(path).check_records()) == message
    # and with skip_bad_lines the line is skipped, by both
    skipping = PromptDataSource(path, shuffle=False, skip_bad_lines=True)
    assert skipping.check_records() == 2
    assert prompts_of(skipping.get_groups(3)) == ["ok", "ok2"] and skipping.num_skipped == 1


def test_nesting_up_to_the_bound_goes_through_and_brackets_in_text_are_not_nesting(tmp_path):
    deep: object = "leaf"
    for _ in range(98):  # with the record and its metadata, 100 levels: the bound
        deep = [deep]
    # a surrogate pair (json.dumps writes one for an emoji) is text
    rows = [{"input": "[" * 300 + "x" + "]" * 300 + " \U0001F600", "label": "{" * 200, "metadata": {"deep": deep}}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    source = PromptDataSource(path, n_samples_per_prompt=2)
    assert source.check_records() == 1
    (group,) = source.get_groups(1)  # each sample gets a deep copy
    assert group[1].metadata == rows[0]["metadata"] and group[0].prompt == rows[0]["input"]


def test_check_finds_a_bad_line_the_first_batches_never_reach(tmp_path):
    rows = arithmetic_rows(50)
    rows[39] = '{"input": "what is 1 + 1 ?", "label": "2",}'
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = Config()
    cfg.data.prompt_data = str(path)
    cfg.data.shuffle = False
    assert len(PromptDataSource.from_config(cfg).get_groups(8)) == 8  # a run would only meet it at step 5
    assert one_line_error(lambda: PromptDataSource.check(cfg)).startswith(
        f"{path}:40: malformed JSON (Expecting property name enclosed in double quotes); fix the line or set "
        "data.skip_bad_lines=true")
    cfg.data.skip_bad_lines = True
    PromptDataSource.check(cfg)


def test_check_refuses_a_file_with_no_usable_prompt(tmp_path, caplog):
    cfg = Config()
    blank = tmp_path / "blank.jsonl"
    blank.write_text("  \n\t\n \n")  # whitespace only: no line is a prompt
    cfg.data.prompt_data = str(blank)
    assert one_line_error(lambda: PromptDataSource.check(cfg)) == (
        f"{blank}: the file holds no prompt (only blank lines); give a file with one prompt per line (or row)")
    # the source itself stops too, instead of a run of 0 steps
    assert "no usable prompt" in one_line_error(lambda: PromptDataSource(blank).get_groups(4))
    bad = write_jsonl(tmp_path / "bad.jsonl", ["", '{"input": 1, "label": "1"}', "{oops", '{"label": "2"}'])
    cfg.data.prompt_data, cfg.data.skip_bad_lines = str(bad), True
    assert one_line_error(lambda: PromptDataSource.check(cfg)) == (
        f"{bad}:2: no line of the file is usable (3 bad, skipped by data.skip_bad_lines); the first: input 'input' "
        "must be a string or a list of chat messages ({role, content}), got int; fix the data")
    assert "no usable prompt" in one_line_error(
        lambda: PromptDataSource(bad, skip_bad_lines=True).get_groups(4))
    some = write_jsonl(tmp_path / "some.jsonl", ["{oops", *arithmetic_rows(2)])
    with caplog.at_level(logging.WARNING, logger="slime_rl.buffer.data_source"):
        assert PromptDataSource(some, skip_bad_lines=True).check_records() == 2
    assert f"{some}: 1 bad line(s) will be skipped (data.skip_bad_lines); first: {some}:1:" in caplog.text


def test_check_eval_names_the_eval_file(tmp_path):
    cfg = Config()
    good = write_jsonl(tmp_path / "good.jsonl", arithmetic_rows(3))
    bad = write_jsonl(tmp_path / "bad.jsonl", [*arithmetic_rows(3), '{"input": "x"}'])
    cfg.eval.prompt_data = {"good": str(good), "bad": str(bad)}
    assert one_line_error(lambda: PromptDataSource.check_eval(cfg)) == (
        f"{bad}:4: no label key 'label' (keys: input); set data.label_key to the answer field, or to null for "
        "prompts without labels")


def test_check_parquet_names_the_row(tmp_path):
    path = tmp_path / "p.parquet"
    rows = [{"input": f"q{i}", "label": str(i)} for i in range(10)] + [{"input": None, "label": "x"}]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)
    assert one_line_error(lambda: PromptDataSource(path).check_records()).startswith(
        f"{path}:row 10: input 'input' must be a string")
    assert PromptDataSource(path, skip_bad_lines=True).check_records() == 10


def test_a_file_changed_under_the_run_is_named(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", arithmetic_rows(6))
    source = PromptDataSource(path, shuffle=False)
    source.get_groups(2)
    with open(path, "a") as f:
        f.write('{"input": "appended", "label": "1"}\n')
    assert one_line_error(lambda: source.get_groups(2)).startswith(
        f"{path}: changed while the run was reading it (")


def test_empty_or_missing_file_is_refused_up_front(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert one_line_error(lambda: PromptDataSource(empty)) == \
        f"{empty}: the file is empty; give a file with one prompt per line (or row)"
    (tmp_path / "blank.jsonl").write_text("\n\n")
    assert "the file is empty" in one_line_error(lambda: PromptDataSource(tmp_path / "blank.jsonl"))
    missing = tmp_path / "nope.jsonl"
    assert one_line_error(lambda: PromptDataSource(missing)) == \
        f"{missing}: file does not exist; set data.prompt_data to a JSONL or Parquet file of prompts"
    assert "is not a file" in one_line_error(lambda: PromptDataSource(tmp_path))
    not_parquet = write_jsonl(tmp_path / "x.parquet", ["not parquet"])
    assert one_line_error(lambda: PromptDataSource(not_parquet)).startswith(f"{not_parquet}: cannot read as Parquet")


def test_skip_bad_lines_skips_and_reports_the_count(tmp_path, caplog):
    rows = arithmetic_rows(8)
    rows[1], rows[4], rows[6] = "{broken", {"label": "no input"}, {"input": "x", "label": False}
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    source = PromptDataSource(path, skip_bad_lines=True, num_epoch=2, seed=5)
    with caplog.at_level(logging.WARNING, logger="slime_rl.buffer.data_source"):
        groups = read_all(source, batch=4)
    assert len(groups) == 2 * 5 and source.num_skipped == 2 * 3
    assert Counter(g[0].metadata["row"] for g in groups) == {r: 2 for r in (0, 2, 3, 5, 7)}
    warnings = [r.getMessage() for r in caplog.records]
    assert all("skipped" in w and f"{path}:" in w for w in warnings)
    assert "so far (data.skip_bad_lines)" in warnings[-1] and ", 6 so far" in warnings[-1]


def test_a_file_with_no_usable_prompt_stops_instead_of_spinning(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ["{bad", "{worse"])
    source = PromptDataSource(path, skip_bad_lines=True, num_epoch=None)
    assert "no usable prompt in a whole pass" in one_line_error(lambda: source.get_groups(1))


# ---------------------------------------------------------------- resume


RESUME_SCRIPT = textwrap.dedent("""
    import json, sys
    from slime_rl.buffer import PromptDataSource, SampleBuffer
    path, db, batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
    source = PromptDataSource(path, n_samples_per_prompt=2, seed=11, num_epoch=3, skip_bad_lines=True)
    with SampleBuffer(db) as buffer:
        source.load_state_dict(buffer.get_state("data_source"))
    out = [[[s.index, s.group_index, s.prompt, s.label] for s in g] for _ in range(batches)
           for g in source.get_groups(4)]
    print(json.dumps({"groups": out, "state": source.state_dict()}))
""")


def as_rows(groups):
    return [[[s.index, s.group_index, s.prompt, s.label] for s in g] for g in groups]


def test_resume_in_a_new_process_continues_exactly_across_epoch_boundaries(tmp_path):
    rows = arithmetic_rows(10)
    rows[3] = "{bad line"  # the skip counter and the order survive the restart too
    path = write_jsonl(tmp_path / "p.jsonl", rows)

    def make():
        return PromptDataSource(path, n_samples_per_prompt=2, seed=11, num_epoch=3, skip_bad_lines=True)

    uninterrupted = make()
    expected = [g for _ in range(2 + 5) for g in uninterrupted.get_groups(4)]

    first = make()
    head = [g for _ in range(2) for g in first.get_groups(4)]
    assert as_rows(head) == as_rows(expected[:8]) and first.epoch == 0
    with SampleBuffer(tmp_path / "run") as buffer:  # the state is stored where the buffer lives
        buffer.add(head, states={"data_source": first.state_dict()})

    done = subprocess.run([sys.executable, "-c", RESUME_SCRIPT, str(path), str(tmp_path / "run"), "5"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    resumed = json.loads(done.stdout)
    # 9 good prompts a pass: 8 read before, then the rest of epoch 0, all of epoch 1, part of epoch 2
    assert resumed["groups"] == as_rows(expected[8:]) and len(resumed["groups"]) == 19
    assert resumed["state"] == uninterrupted.state_dict()
    assert resumed["state"]["epoch"] == 3 and resumed["state"]["num_skipped"] == 3


def test_resume_refuses_a_changed_file(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", arithmetic_rows(5))
    state = PromptDataSource(path).state_dict()
    write_jsonl(path, arithmetic_rows(6))
    message = one_line_error(lambda: PromptDataSource(path).load_state_dict(state))
    assert message.startswith(f"{path}: changed since the state was saved (5 lines")


def test_parquet_bad_row_names_the_row(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"input": "a", "label": "1"}, {"input": None, "label": "2"}]), path)
    source = PromptDataSource(path, shuffle=False)
    assert one_line_error(lambda: source.get_groups(2)).startswith(
        f"{path}:row 1: input 'input' must be a string or a list of chat messages ({{role, content}}), got null")


def test_pickles_for_another_process_at_the_same_position(tmp_path, tokenizer):
    import pickle

    path = write_jsonl(tmp_path / "p.jsonl", arithmetic_rows(9))
    source = PromptDataSource(path, tokenizer=tokenizer, n_samples_per_prompt=2, seed=2, num_epoch=None)
    source.get_groups(7)
    clone = pickle.loads(pickle.dumps(source))
    assert as_rows(clone.get_groups(5)) == as_rows(source.get_groups(5))
    assert clone.state_dict() == source.state_dict() and clone.tokenizer is not None
