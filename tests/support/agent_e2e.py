"""The agent end-to-end test's engine and trainer, loaded by ``module:attr`` inside Ray actors: the real ones,
writing down what each saw so the test can compare them token by token; and the warm start that teaches a
tiny random model the tool-call format. The task's tool and reward are in agent_task.py (the reward workers
import that, and need not import these backends)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from agent_runs import train_on_episodes
from agent_task import ANSWER, CALL, PROMPT, SECRET

from slime_rl.rollout_hf.engine import HFEngine
from slime_rl.trainer_megatron.trainer import MegatronTrainer


def _record(kind: str, row: dict) -> None:
    with open(Path(os.environ["AGENT_E2E_DIR"]) / f"{kind}-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


class RecordingEngine(HFEngine):
    """The transformers engine, writing every request's input ids and sampled ids and log-probs down."""

    async def generate(self, input_ids, params, request_id=None):
        out = await super().generate(input_ids, params, request_id)
        _record("engine", {"request_id": request_id, "input_ids": list(input_ids), "token_ids": out.token_ids,
                           "log_probs": out.log_probs, "finish_reason": out.finish_reason})
        return out


class RecordingTrainer(MegatronTrainer):
    """The Megatron trainer, writing down the ids, loss mask and engine log-probs of every sample it trains on."""

    def train_step(self, batch):
        offsets, response_offsets = batch.offsets().tolist(), batch.response_offsets().tolist()
        for row, sample_id in enumerate(batch.sample_ids.tolist()):
            _record("trainer", {
                "sample_id": sample_id,
                "tokens": batch.tokens[offsets[row]:offsets[row + 1]].tolist(),
                "loss_mask": batch.loss_mask[response_offsets[row]:response_offsets[row + 1]].tolist(),
                "rollout_log_probs": batch.rollout_log_probs[response_offsets[row]:response_offsets[row + 1]].tolist()})
        return super().train_step(batch)


def warm_start(model, tokenizer, *, steps: int = 60, seed: int = 0) -> None:
    """Teach the format by supervised steps on episodes where each assistant turn is, independently, the tool
    call or the answer: the model then calls the tool at about half of its turns whatever came before, so
    about half its episodes earn the reward and RL has something to learn (call first, then answer)."""
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    call_ids = tokenizer.encode(CALL, add_special_tokens=False) + [tokenizer.eos_token_id]
    answer_ids = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]
    observation = tokenizer.encode(f"\n<|im_start|>tool\n{SECRET}<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)

    def episode() -> tuple[list[int], list[int]]:
        ids, mask = list(prompt_ids), [0] * len(prompt_ids)
        for _ in range(4):
            turn = call_ids if rng.random() < 0.5 else answer_ids
            ids, mask = ids + turn, mask + [1] * len(turn)
            if turn is answer_ids:
                break
            ids, mask = ids + observation, mask + [0] * len(observation)
        return ids, mask

    train_on_episodes(model, episode, steps=steps)
