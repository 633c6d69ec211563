"""TEST DOUBLE (CPU tests only): the checks SGLang 0.5.17 makes of a ``/generate`` request before running it, with
its messages, for the stand-in server (server.py). Refusals are HTTP 400 ``{"error": {"message"}}`` unless
said otherwise.

- the context length (managers/tokenizer_manager.py ``_validate_one_request``): the input, and the input plus
  ``max_new_tokens``, must fit (``--context-length``, else the model's ``max_position_embeddings``);
- the sampling parameters (sampling/sampling_params.py ``SamplingParams.verify``): temperature, top_p, top_k,
  max_new_tokens;
- the sampling parameters' names: ``SamplingParams(**sampling_params)`` (a msgspec struct) raises TypeError on
  any other key, which the endpoint does not catch: HTTP 500.
"""

from __future__ import annotations

import math

# SGLang 0.5.17's SamplingParams fields (sampling/sampling_params.py)
SAMPLING_FIELDS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty presence_penalty "
    "repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos skip_special_tokens "
    "spaces_between_special_tokens no_stop_trim stream_interval logit_bias sampling_seed custom_params".split())


def context_length(flag: int | None, hf_config: dict) -> int:
    """SGLang's context length: ``--context-length`` when given, else the model config's."""
    return int(flag) if flag else int(hf_config.get("max_position_embeddings", 2048))


def request_error(sp: dict, input_len: int, context_len: int) -> tuple[int, str] | None:
    """SGLang's refusal of one request (HTTP status, message), or None."""
    unknown = sorted(set(sp) - SAMPLING_FIELDS)
    if unknown:
        return 500, f"Internal Server Error (TypeError: Unexpected keyword argument '{unknown[0]}')"
    message = _length_or_value_error(sp, input_len, context_len)
    return (400, message) if message else None


def _length_or_value_error(sp: dict, input_len: int, context_len: int) -> str | None:
    if input_len >= context_len:
        return f"The input ({input_len} tokens) is longer than the model's context length ({context_len} tokens)."
    max_new = sp.get("max_new_tokens")  # absent: SGLang checks no total (its default, 128, applies later)
    if max_new is not None and max_new + input_len > context_len:
        return (f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
                f"You requested a total of {max_new + input_len} tokens: {input_len} tokens from the input messages "
                f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input messages "
                "or the completion to fit within the limit.")
    temperature = sp.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else float(temperature)
    if not math.isfinite(temperature) or temperature < 0.0:
        return f"temperature must be a non-negative finite number, got {temperature}."
    top_p = sp.get("top_p", 1.0)
    if top_p is not None and not 0.0 < float(top_p) <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}."
    top_k = sp.get("top_k", -1)
    if top_k is not None and top_k != -1 and top_k < 1:
        return f"top_k must be -1 (disable) or at least 1, got {top_k}."
    if max_new is not None and max_new < 0:
        return f"max_new_tokens must be at least 0, got {max_new}."
    return None
