"""What the agent end-to-end tests (test_e2e_agent, test_e2e_gateway_agent) share and the Ray
workers need not import: the tiny chat model warm-started on a task's format, the supervised steps that do it, and
the reading of what agent_e2e's RecordingEngine and RecordingTrainer wrote down."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def warm_started_chat_model(folder: Path, warm_start: Callable) -> Path:
    """A tiny random Qwen2 with the chat tokenizer, taught the task's format by ``warm_start(model, tokenizer)``,
    saved to ``folder``."""
    from slime_rl.core.testing import chat_tokenizer, save_model, tiny_config, tiny_model

    tok = chat_tokenizer()
    model = tiny_model(tiny_config("qwen2", vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                   bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    warm_start(model, tok)
    return save_model(folder, model, tok)


def train_on_episodes(model, episode: Callable[[], tuple[list[int], list[int]]], *, steps: int) -> None:
    """``steps`` supervised steps (AdamW, lr 1e-2) on batches of 16 of ``episode()``'s (ids, loss mask): the loss
    is the negative log-likelihood of the masked-in tokens. Leaves the model in eval mode."""
    import torch

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        rows = [episode() for _ in range(16)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r[0] + [0] * (width - len(r[0])) for r in rows])
        mask = torch.tensor([r[1] + [0] * (width - len(r[1])) for r in rows], dtype=torch.float32)
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def recorded_rows(folder: Path, kind: str) -> list[dict]:
    """Every row agent_e2e wrote under ``folder`` for ``kind`` ("engine" or "trainer"), over all processes."""
    return [json.loads(line) for f in sorted(folder.glob(f"{kind}-*.jsonl")) for line in f.read_text().splitlines()]


def rebuilds(calls: list[dict], row: dict, *, first_call_is_prompt: bool) -> bool:
    """True when the trainer's ``row`` is exactly these engine calls (in order) chained: each call's input is the
    trajectory so far, its sampled ids follow with mask 1 and the engine's log-probs; every other response token
    (observations) has mask 0 and log-prob 0, and the trajectory ends with the last call's sampled ids. With
    ``first_call_is_prompt`` the first call's input is also the row's prompt, exactly."""
    tokens, mask = row["tokens"], row["loss_mask"]
    prompt_len = len(tokens) - len(mask)
    sampled, log_probs = [0] * len(mask), [0.0] * len(mask)
    for call in calls:
        start = len(call["input_ids"])
        if tokens[:start] != call["input_ids"] or tokens[start:start + len(call["token_ids"])] != call["token_ids"]:
            return False
        for k, lp in enumerate(call["log_probs"]):
            sampled[start + k - prompt_len], log_probs[start + k - prompt_len] = 1, lp
    end = len(calls[-1]["input_ids"]) + len(calls[-1]["token_ids"])
    return ((not first_call_is_prompt or len(calls[0]["input_ids"]) == prompt_len) and end == len(tokens)
            and sampled == mask
            and all(abs(a - b) <= 1e-6 * max(1.0, abs(a)) for a, b in zip(log_probs, row["rollout_log_probs"],
                                                                           strict=True)))
