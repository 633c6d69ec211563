"""A served role on the transformers engine (CPU, or one GPU): a frozen teacher, reward model or judge behind
a small HTTP server that answers the subset of SGLang's native API the run's `RoleClient`
(core/roles/client.py) sends, the same requests and the same replies:

- ``POST /generate`` with ``input_ids`` and ``max_new_tokens: 0``: a prefill; ``meta_info.input_token_logprobs``
  ``[[log-prob, id, None], ...]`` from ``logprob_start_len`` (the first token's log-prob is None);
- ``POST /generate`` with ``text``: a completion (greedy at temperature 0), ``{"text": ...}``;
- ``POST /classify`` with ``text``: a ``...ForSequenceClassification``'s scores, ``[{"embedding": [score]}]``;
- ``GET /health`` (open), ``GET /model_info``.

Every other request needs the role's key as a bearer token (401 otherwise). One request uses the model at a
time; the server's threads only parse and queue. Nothing here updates the weights: a role is frozen.
"""

from __future__ import annotations

import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from slime_rl.core.config.device import resolve_device
from slime_rl.core.infra.net import LOOPBACK
from slime_rl.rollout_hf.engine import resolve_dtype

if TYPE_CHECKING:
    from slime_rl.core.config import Config

MAX_BODY_BYTES = 64 * 2**20


class HFRoleServer:
    """`RoleService` of a role served by transformers in this process."""

    def __init__(self, model: Any, tokenizer: Any, *, kind: str, api_key: str | None, path: str,
                 host: str = LOOPBACK, port: int = 0):
        self.model, self.tokenizer, self.kind, self.path = model.eval(), tokenizer, kind, path
        self.api_key = api_key
        self.lock = threading.Lock()  # one forward at a time
        if kind == "reward_model" and getattr(model.config, "pad_token_id", None) is None:
            # a sequence classifier finds each row's last token by the pad id
            model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
                tokenizer.eos_token_id)
        self.http = ThreadingHTTPServer((host, port), _handler(self))
        self.http.daemon_threads = True
        self.thread = threading.Thread(target=self.http.serve_forever, name="hf-role-server", daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, cfg: Config, name: str, *, api_key: str | None, host: str = LOOPBACK,
              gpu_ids: list[int] | None = None, port: int = 0) -> HFRoleServer:
        role = cfg.roles[name]
        device = torch.device(resolve_device(cfg.cluster.device, here=True))
        auto = AutoModelForSequenceClassification if role.kind == "reward_model" else AutoModelForCausalLM
        model = auto.from_pretrained(role.path, dtype=resolve_dtype(cfg.model.dtype, device)).to(device)
        tokenizer = AutoTokenizer.from_pretrained(role.tokenizer_path or role.path)
        return cls(model, tokenizer, kind=role.kind, api_key=api_key, path=role.path, host=host, port=port)

    @property
    def url(self) -> str:
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def port(self) -> int:
        return self.http.server_address[1]

    def healthy(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    # ------------------------------------------------------------------ what the endpoints compute

    @torch.no_grad()
    def prefill(self, sequences: list[list[int]], start: int) -> list[dict[str, Any]]:
        """Each sequence's input log-probs from position ``start``: one padded forward for all of them."""
        device = next(self.model.parameters()).device
        longest = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), longest, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, :len(seq)] = torch.as_tensor(seq)
            mask[row, :len(seq)] = 1
        with self.lock:
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        replies = []
        for row, seq in enumerate(sequences):
            scored = torch.log_softmax(logits[row, :len(seq) - 1].float(), dim=-1)
            picked = scored.gather(-1, ids[row, 1:len(seq), None]).squeeze(-1).tolist()
            entries = [[None, seq[0], None]] + [[lp, tok, None] for lp, tok in zip(picked, seq[1:], strict=True)]
            replies.append({"text": "", "output_ids": [], "meta_info": {
                "input_token_logprobs": entries[start:], "prompt_tokens": len(seq), "completion_tokens": 0}})
        return replies

    @torch.no_grad()
    def complete(self, prompt: str, sampling: dict[str, Any]) -> dict[str, Any]:
        device = next(self.model.parameters()).device
        encoded = self.tokenizer(prompt, return_tensors="pt").to(device)
        max_new = int(sampling.get("max_new_tokens", 64))
        temperature = float(sampling.get("temperature", 0.0))
        kwargs: dict[str, Any] = {"max_new_tokens": max_new, "do_sample": temperature > 0,
                                  "pad_token_id": self.tokenizer.pad_token_id or self.tokenizer.eos_token_id}
        if temperature > 0:
            kwargs["temperature"] = temperature
        if sampling.get("ignore_eos"):
            kwargs["min_new_tokens"] = max_new
        with self.lock:
            out = self.model.generate(**encoded, **kwargs)
        new = out[0, encoded["input_ids"].shape[1]:].tolist()
        return {"text": self.tokenizer.decode(new, skip_special_tokens=True), "output_ids": new,
                "meta_info": {"completion_tokens": len(new)}}

    @torch.no_grad()
    def classify(self, texts: list[str]) -> list[dict[str, Any]]:
        device = next(self.model.parameters()).device
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        encoded = self.tokenizer(texts, return_tensors="pt", padding=True).to(device)
        with self.lock:
            scores = self.model(**encoded).logits[:, 0].float().tolist()
        return [{"embedding": [score], "meta_info": {}} for score in scores]

    def answer(self, path: str, body: dict[str, Any]) -> Any:
        """The reply to ``POST path``; ValueError for a request this server cannot answer."""
        many = isinstance(body.get("text"), list) or (isinstance(body.get("input_ids"), list)
                                                      and body["input_ids"] and isinstance(body["input_ids"][0], list))
        if path == "/classify":
            if self.kind != "reward_model":
                raise ValueError(f"/classify: this role is a {self.kind}, not a reward model")
            texts = body.get("text")
            replies = self.classify(texts if isinstance(texts, list) else [texts])
            return replies if many else replies[0]
        if path != "/generate":
            raise LookupError(path)
        if self.kind == "reward_model":
            raise ValueError("/generate: this role is a reward model (a scalar head): use /classify")
        sampling = body.get("sampling_params") or {}
        if "input_ids" in body and int(sampling.get("max_new_tokens", 1)) == 0:
            sequences = body["input_ids"] if many else [body["input_ids"]]
            replies = self.prefill(sequences, int(body.get("logprob_start_len", 0)))
            return replies if many else replies[0]
        if isinstance(body.get("text"), str):
            return self.complete(body["text"], sampling)
        raise ValueError("/generate: give input_ids with sampling_params.max_new_tokens=0 (a prefill) or a text")


def _handler(server: HFRoleServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # requests are many; errors come back to the caller

        def _reply(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if not server.api_key:
                return True
            given = self.headers.get("Authorization", "")
            return hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode())

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/health":
                self._reply(200, {})
            elif not self._authorized():
                self._reply(401, {"error": "unauthorized"})
            elif self.path in ("/model_info", "/get_model_info"):
                self._reply(200, {"model_path": server.path, "is_generation": server.kind != "reward_model"})
            else:
                self._reply(404, {"error": f"no {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if not self._authorized():
                self._reply(401, {"error": "unauthorized"})
                return
            size = int(self.headers.get("content-length") or 0)
            if size > MAX_BODY_BYTES:
                self._reply(413, {"error": f"request over {MAX_BODY_BYTES} bytes"})
                return
            try:
                body = json.loads(self.rfile.read(size) or b"{}")
                self._reply(200, server.answer(self.path, body))
            except LookupError:
                self._reply(404, {"error": f"no {self.path}"})
            except (ValueError, TypeError, KeyError) as err:
                self._reply(400, {"error": f"{type(err).__name__}: {err}"})
            except Exception as err:  # the model failed: the client may retry
                self._reply(500, {"error": f"{type(err).__name__}: {err}"})

    return Handler
