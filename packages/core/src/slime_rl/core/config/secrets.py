"""Secrets: the one way a run holds a key (the remote reward's, the engines'), and redaction.

A `Secret` field takes the key inline (``rollout.reward_api_key: sk-...``) or as a reference to an
environment variable (``env:MY_KEY``, read when the config loads). Everywhere a config is printed or
saved (``slime-cli plan``, meta.json of a checkpoint, wandb/tensorboard) an inline key is written as
`REDACTED` and a reference as itself; only ``Config.to_dict(reveal_secrets=True)``, which hands the
config to the run's own actors, carries the value.

Every key a process has loaded is remembered (`known_secrets`), so `redact` can take them out of any
text an error or a sample's ``metadata["error"]`` carries, with the credentials of URLs (userinfo
and query values whose names say token, key, secret...): docs/reliability.md#secrets.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from pydantic import GetCoreSchemaHandler, SerializationInfo
from pydantic_core import core_schema

REDACTED = "<redacted>"
ENV_PREFIX = "env:"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Shorter values would redact common words; no real key is this short.
_MIN_SECRET_LEN = 6
_known: set[str] = set()
# Query parameters whose value is a credential (?token=, ?api_key=, ?sig=, X-Amz-Signature=...).
_SENSITIVE_QUERY = re.compile(r"(?i)token|key|secret|pass|auth|sig|credential|session|code")
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>)\]}]+")


def remember(value: str) -> None:
    """Take ``value`` out of every text `redact` sees in this process from now on."""
    if len(value) >= _MIN_SECRET_LEN:
        _known.add(value)


def known_secrets() -> frozenset[str]:
    return frozenset(_known)


class Secret:
    """A key: given inline, or ``env:NAME`` (read from the environment when the config loads).
    ``str`` and ``repr`` never show it; `reveal` does, for the one call that sends it."""

    __slots__ = ("_value", "env")

    def __init__(self, value: str, env: str | None = None):
        self._value, self.env = value, env
        remember(value)

    @classmethod
    def parse(cls, given: Any) -> Secret:
        """A config value as a Secret; ValueError (one line, the fix) for anything else."""
        if isinstance(given, Secret):
            return given
        if not isinstance(given, str) or not given:
            raise ValueError("give the key as a string, or env:NAME to read it from an environment variable")
        if given == REDACTED:
            raise ValueError(f"holds {REDACTED} (a saved config never keeps a key); give the key, or env:NAME")
        if not given.startswith(ENV_PREFIX):
            return cls(given)
        name = given.removeprefix(ENV_PREFIX)
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"{given!r}: env: takes an environment variable's name, such as env:MY_API_KEY")
        value = os.environ.get(name)
        if not value:
            raise ValueError(f"{given}: the environment variable {name} is not set; export it, or give the key")
        return cls(value, env=name)

    def reveal(self) -> str:
        return self._value

    def serialized(self, reveal: bool) -> str:
        """What a config holds: the key only for the run's own actors; else the reference or REDACTED."""
        if reveal:
            return self._value
        return ENV_PREFIX + self.env if self.env else REDACTED

    def __str__(self) -> str:
        return self.serialized(reveal=False)

    def __repr__(self) -> str:
        return f"Secret({self.serialized(reveal=False)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and (self._value, self.env) == (other._value, other.env)

    def __hash__(self) -> int:
        return hash((self._value, self.env))

    def __reduce__(self) -> tuple[Any, ...]:  # pickled to an actor (Ray) whole: the actor sends it
        return _rebuild, (self._value, self.env)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls.parse, json_schema_input_schema=core_schema.str_schema(),
            serialization=core_schema.plain_serializer_function_ser_schema(
                _serialize_secret, info_arg=True, return_schema=core_schema.str_schema()))


def _rebuild(value: str, env: str | None) -> Secret:
    return Secret(value, env)


def _reveals(info: SerializationInfo) -> bool:
    return bool(isinstance(info.context, dict) and info.context.get("reveal_secrets"))


def _serialize_secret(secret: Secret, info: SerializationInfo) -> str:
    return secret.serialized(_reveals(info))


def serialize_url(url: str | None, info: SerializationInfo) -> str | None:
    """A URL field as a config holds it: its credentials redacted but for the run's own actors."""
    return url if url is None or _reveals(info) else redact_url(url)


def remember_url(url: str | None) -> str | None:
    """A URL field's validator: its credentials become known secrets of this process."""
    if url:
        parts = urlsplit(url)
        for part in (parts.password, parts.username):  # a bare userinfo is often the token itself
            if part:
                remember(part)
        for name, value in parse_qsl(parts.query, keep_blank_values=False):
            if _SENSITIVE_QUERY.search(name):
                remember(value)
    return url


def redact_url(url: str) -> str:
    """``url`` without credentials: userinfo and the values of token-like query parameters."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    netloc = parts.netloc
    if "@" in netloc:
        netloc = REDACTED + "@" + netloc.rpartition("@")[2]
    query = "&".join(
        f"{name}={REDACTED}" if _SENSITIVE_QUERY.search(name) and sep else piece
        for piece in parts.query.split("&") if piece
        for name, sep, _ in [piece.partition("=")]
    ) if parts.query else ""
    return parts._replace(netloc=netloc, query=query).geturl()


def redact(text: str) -> str:
    """``text`` with every known secret and every URL's credentials replaced by REDACTED."""
    text = _URL.sub(lambda m: redact_url(m.group(0)), text)  # first: REDACTED's '<' ends a URL's match
    for value in sorted(_known, key=len, reverse=True):
        if value in text:
            text = text.replace(value, REDACTED)
    return text
