"""Secrets stay secret (issue 34): a key is given inline or as env:NAME, reaches the call that sends it,
and is redacted wherever a config or an error is printed or saved, URL credentials included."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from slime_rl.core.config import ConfigError, RolloutConfig, load_config
from slime_rl.core.config.secrets import REDACTED, Secret, redact, redact_url
from slime_rl.core.infra.net import free_port
from slime_rl.core.rewards import score_samples
from slime_rl.core.sample import Sample, SampleStatus

KEY = "sk-inline-7f3c9a1b2d"
ENV_KEY = "sk-from-env-5e8d2c"
URL_PASSWORD = "url-pass-91ab3c"
URL_TOKEN = "url-token-44de7f"
SECRETS = (KEY, ENV_KEY, URL_PASSWORD, URL_TOKEN)


def secret_config(monkeypatch, url: str = "http://127.0.0.1:9/score", *, url_credentials: bool = True,
                  **more: str):
    monkeypatch.setenv("TEST_REWARD_KEY", ENV_KEY)
    user_url = (url.replace("://", f"://judge:{URL_PASSWORD}@", 1) + f"?token={URL_TOKEN}&model=m1"
                if url_credentials else url)
    overrides = ["rollout.reward=remote", f"rollout.reward_url={user_url}", "cluster.device=cpu",
                 *(f"{k}={v}" for k, v in more.items())]
    return load_config(None, overrides, check=False), user_url


def leaks(text: str) -> list[str]:
    return [s for s in SECRETS if s in text]


def test_a_saved_or_printed_config_holds_no_key_and_no_url_credentials(monkeypatch):
    cfg, url = secret_config(monkeypatch, **{"rollout.reward_api_key": KEY})
    assert cfg.rollout.reward_api_key.reveal() == KEY
    shown = cfg.to_dict()
    assert not leaks(json.dumps(shown)) and not leaks(cfg.to_yaml())
    assert shown["rollout"]["reward_api_key"] == REDACTED
    assert shown["rollout"]["reward_url"] == f"http://{REDACTED}@127.0.0.1:9/score?token={REDACTED}&model=m1"
    assert KEY not in str(cfg.rollout.reward_api_key) and KEY not in repr(cfg)
    # the run's own actors get the values (they send them), and rebuild the same config
    for_actors = cfg.to_dict(reveal_secrets=True)
    assert for_actors["rollout"]["reward_api_key"] == KEY and for_actors["rollout"]["reward_url"] == url
    assert type(cfg).model_validate(for_actors).rollout.reward_api_key.reveal() == KEY
    assert pickle.loads(pickle.dumps(cfg.rollout.reward_api_key)).reveal() == KEY


def test_an_env_reference_is_read_at_load_and_saved_as_the_reference(monkeypatch):
    cfg, _ = secret_config(monkeypatch, **{"rollout.reward_api_key": "env:TEST_REWARD_KEY"})
    assert cfg.rollout.reward_api_key.reveal() == ENV_KEY
    assert cfg.to_dict()["rollout"]["reward_api_key"] == "env:TEST_REWARD_KEY"
    assert cfg.to_dict(reveal_secrets=True)["rollout"]["reward_api_key"] == ENV_KEY


@pytest.mark.parametrize("given, message", [
    ("env:TEST_UNSET_KEY_34", "rollout.reward_api_key: env:TEST_UNSET_KEY_34: the environment variable"
                              " TEST_UNSET_KEY_34 is not set; export it, or give the key"),
    ("env:1bad", "rollout.reward_api_key: 'env:1bad': env: takes an environment variable's name"),
    (REDACTED, f"rollout.reward_api_key: holds {REDACTED} (a saved config never keeps a key); give the key"),
])
def test_a_key_that_cannot_be_read_is_refused_in_one_line(monkeypatch, given, message):
    monkeypatch.delenv("TEST_UNSET_KEY_34", raising=False)
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"rollout.reward_api_key={given}"], check=False)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_redact_takes_out_known_keys_and_url_credentials():
    Secret("sk-known-in-this-process")
    text = ("POST https://user:pw-in-url@host:8/p?api_key=abc123&x=1 failed; key sk-known-in-this-process; "
            "https://tok-as-user@host/p?sig=zz&X-Amz-Signature=qq")
    out = redact(text)
    for leaked in ("pw-in-url", "abc123", "sk-known-in-this-process", "tok-as-user", "=zz", "=qq"):
        assert leaked not in out
    assert "x=1" in out and "host:8/p" in out
    assert redact_url("http://h:1/score") == "http://h:1/score"  # nothing to hide: unchanged


class KeyCheckingServer:
    """A reward server that answers 1.0 with the right bearer key, 401 (echoing the URL) without it."""

    def __init__(self, key: str):
        self.seen: list[str | None] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["content-length"]))
                server.seen.append(self.headers.get("authorization"))
                ok = self.headers.get("authorization") == f"Bearer {key}"
                body = b"1.0" if ok else f"bad key for {self.path}".encode()
                self.send_response(200 if ok else 401)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def key_server():
    server = KeyCheckingServer(ENV_KEY)
    yield server
    server.close()


def score(samples: list[Sample], cfg) -> list[Sample]:
    asyncio.run(score_samples(samples, RolloutConfig.model_validate(cfg.to_dict(reveal_secrets=True)["rollout"])))
    return samples


def test_the_remote_reward_sends_its_key_as_a_bearer_token(monkeypatch, key_server):
    cfg, _ = secret_config(monkeypatch, key_server.url, url_credentials=False,
                           **{"rollout.reward_api_key": "env:TEST_REWARD_KEY"})
    samples = score([Sample(index=i, response="r", status=SampleStatus.COMPLETED) for i in range(2)], cfg)
    assert [s.reward for s in samples] == [1.0, 1.0] and key_server.seen == [f"Bearer {ENV_KEY}"] * 2


@pytest.mark.parametrize("where", ["refused", "dead"])
def test_a_failing_remote_reward_leaves_no_secret_in_the_samples_errors(monkeypatch, key_server, where, caplog):
    url = key_server.url if where == "refused" else f"http://127.0.0.1:{free_port()}/score"
    cfg, _ = secret_config(monkeypatch, url, **{"rollout.reward_api_key": KEY})  # the wrong key: 401
    monkeypatch.setattr("slime_rl.core.rewards.remote.RemoteReward.backoff_s", 0.01)
    samples = score([Sample(index=i, response="r", status=SampleStatus.COMPLETED) for i in range(2)], cfg)
    errors = [s.metadata["error"] for s in samples]
    assert all(s.status == SampleStatus.FAILED for s in samples)
    assert all(("HTTP 401" if where == "refused" else "ConnectError") in e for e in errors), errors
    assert all(f"http://{REDACTED}@127.0.0.1" in e for e in errors), errors
    assert not leaks(" ".join(errors)) and not leaks(caplog.text)

