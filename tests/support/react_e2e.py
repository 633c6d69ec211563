"""The gateway end-to-end test's fixed task and warm start: examples/react_agent's ReAct format taught to a tiny
random model, each turn independently one of the two calculator actions or the answer, so about a quarter of its
episodes compute twice before answering and RL has something to learn (the order: two calls, then the answer)."""

from __future__ import annotations

import random

# The two actions differ in their last digit only: a tiny model learns one choice there, where actions differing
# in two places came out mixed (6*9, 8*7: it did not tie the second digit to the first).
QUESTION = "What is 6 * 7 + 6 * 9?"
LABEL = "96"
TURNS = {"first": "Action: calculator[6*7]", "second": "Action: calculator[6*9]", "answer": "Answer: 96"}
OBSERVATIONS = {"first": "Observation: 42", "second": "Observation: 54"}
# Half the turns answer: most failures are then an answer at the first or second turn, a decision taken in the
# same one or two contexts in every episode, which GRPO unlearns within a few steps. (At 0.2 the failures were
# mostly long episodes gone to garbage past the turns the warm start showed, and the reward rose by 0.15 in 20
# steps in 1 of 5 runs.)
WEIGHTS = {"first": 0.25, "second": 0.25, "answer": 0.5}


def warm_start(model, tokenizer, *, steps: int = 200, seed: int = 0) -> None:
    """Supervised steps on episodes tokenised as the gateway tokenises them (the agent's messages rendered by the
    chat template; each later turn appended as the template's user turn), up to the agent's MAX_STEPS turns, so
    no turn the agent can reach is one the model never saw."""
    import torch
    from agent_runs import train_on_episodes
    from react_agent import MAX_STEPS, SYSTEM

    from slime_rl.core.agent.template import TurnTemplate, encode, render

    template = TurnTemplate.from_tokenizer(tokenizer)
    prompt = encode(tokenizer, render(tokenizer, [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": QUESTION}], add_generation_prompt=True))
    turn_ids = {k: encode(tokenizer, text) + [tokenizer.eos_token_id] for k, text in TURNS.items()}
    observation_ids = {k: template.observation_ids([{"role": "user", "content": text}], ended_on_end_of_turn=True)
                       for k, text in OBSERVATIONS.items()}
    rng = random.Random(seed)
    torch.manual_seed(seed)

    def episode() -> tuple[list[int], list[int]]:
        ids, mask = list(prompt), [0] * len(prompt)
        for _ in range(MAX_STEPS):
            kind = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
            ids, mask = ids + turn_ids[kind], mask + [1] * len(turn_ids[kind])
            if kind == "answer":
                break
            ids, mask = ids + observation_ids[kind], mask + [0] * len(observation_ids[kind])
        return ids, mask

    train_on_episodes(model, episode, steps=steps)


def calculator_then_answer(sample) -> float:
    """The e2e task's reward: 1 when the agent computed with the calculator at least twice and then answered right.
    (examples/react_agent's own reward also wants every product of the question computed: a tiny model learns
    that ordering too slowly for a few-minute test.)"""
    state = sample.metadata.get("agent_result") or {}
    return float(len(state.get("computed", [])) >= 2 and str(state.get("answer")) == LABEL)
