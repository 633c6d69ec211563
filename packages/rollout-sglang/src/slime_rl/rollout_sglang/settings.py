"""``rollout.sglang``: the SGLang engine's own config keys, checked when the config loads.

Light on purpose (pydantic only, no torch): the config loader finds this model through the entry point
``slime_rl.rollout_engines.settings`` without importing the engine. A new SGLang server flag with a check
of its own is a field here (listed in `SERVER_FLAGS`) and a line in docs/config.md's generated table;
any other flag passes through ``server_args``.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field, field_validator, model_validator

from slime_rl.core.config import BackendSettings, ConfigError
from slime_rl.core.config.checks import is_http_url
from slime_rl.core.config.secrets import Secret

if TYPE_CHECKING:
    from slime_rl.core.config import Config

# Flags slime-rl sets itself; given in server_args they would be silently overridden.
OWN_FLAGS = frozenset({"model-path", "host", "port", "tp-size", "tp", "tensor-parallel-size", "api-key",
                       "admin-api-key"})


# Flags under which SGLang 0.5.17 serves copies of the weights it builds once, after loading, and no weight update
# rebuilds: with them every sync would leave the engine on the first weights (or fail), so they are refused.
STALE_AFTER_SYNC = {
    "quantization": "SGLang quantises the checkpoint online after loading and does not re-quantise an update (a"
                    " bf16 push into the FP8 parameters fails); for FP8 rollouts set rollout.precision: fp8, which"
                    " starts the engine from an FP8 copy and quantises every sync (docs/fp8.md)",
    "torchao-config": "torchao quantises the weights once after loading; a weight update does not re-quantise them:"
                      " remove it",
}
DCP_REPLICATE_Q = ("with --dcp-size > 1 SGLang gathers each MLA layer's q_b_proj and w_kc into full-head copies once at"
                   " start-up (--dcp-replicate-q-proj, model_runner._prepare_replicated_q_proj) and decode reads them"
                   " after every sync: set dcp_replicate_q_proj: false")


def flag_name(key: object) -> str:
    """A server_args key as SGLang's flag: ``chunked_prefill_size`` -> ``chunked-prefill-size``."""
    return str(key).lstrip("-").replace("_", "-")


class SGLangSettings(BackendSettings):
    """The SGLang engine: servers it launches (or attaches to) behind sglang-router."""

    #: For one release an old ``rollout.engine_args`` lands in server_args (config/renamed.py).
    engine_args_field: ClassVar[str | None] = "server_args"
    serves_fp8: ClassVar[bool] = True  # rollout.precision=fp8 and rollout.kv_cache_dtype=fp8_e4m3 (docs/fp8.md)
    #: Typed fields that are SGLang server flags, passed as ``--<field-with-dashes> <value>`` when set.
    SERVER_FLAGS: ClassVar[tuple[str, ...]] = ("chunked_prefill_size",)

    engine_urls: list[str] = Field(default_factory=list, description=(
        "attach to running servers instead of launching them; their keys come from `SLIME_RL_ENGINE_API_KEY` /"
        " `SLIME_RL_ENGINE_ADMIN_API_KEY` in the environment (docs/multi-node.md)"))
    api_key: Secret | None = Field(None, description=(
        "with engine_urls: the servers' `--api-key`, inline or `env:NAME` (a secret: redacted wherever the config"
        " is printed or saved); unset: `SLIME_RL_ENGINE_API_KEY` from the environment. Servers slime-rl launches"
        " get fresh keys of their own"))
    admin_api_key: Secret | None = Field(None, description=(
        "with engine_urls: the servers' `--admin-api-key` (a secret, as api_key); unset:"
        " `SLIME_RL_ENGINE_ADMIN_API_KEY`, else the api key"))
    engine_python: str | None = Field(None, description=(
        "interpreter that launches SGLang servers (SGLang in its own venv); checked to be an executable"))
    server_args: dict[str, Any] = Field(default_factory=dict, description=(
        "other SGLang server flags, passed through: `{mem_fraction_static: 0.7}` is `--mem-fraction-static 0.7`"
        " (`true` a bare flag, `false`/`null` none; slime's `--sglang-*`). Each wins over the flag slime-rl would"
        " set from the rest of the config; the ones slime-rl must set itself (`host`, `port`, `tp_size`, keys)"
        " are refused, and so are those under which SGLang serves copies of the weights no sync rebuilds"
        " (`quantization`, `torchao_config`: use `rollout.precision`; `dcp_size` > 1 without"
        " `dcp_replicate_q_proj: false`)"))
    chunked_prefill_size: int | None = Field(None, description=(
        "tokens per prefill chunk (`--chunked-prefill-size`): a long prompt is prefilled in chunks of this many"
        " tokens, capping the prefill's activation memory; `-1` turns chunking off; `null` leaves SGLang's own"
        " choice (by GPU memory). Only for servers slime-rl launches"))
    router_policy: str = Field("round_robin", description=(
        "sglang-router policy (`--router-policy`): `round_robin`, `cache_aware`, `random`, `power_of_two`, or"
        " `manual`, which sends every turn of a multi-turn episode to the same engine (session affinity by the"
        " routing key `<session>` of request ids `<session>/<turn>`, docs/agents.md)"))
    engine_startup_timeout: float = Field(900.0, gt=0, description=(
        "seconds a launched server has to answer `/health`; then the error carries its log's tail"))
    weight_sync_timeout: float = Field(600.0, gt=0, description=(
        "seconds per weight-sync step (one bucket into one engine, a pause, a flush); then the error names the"
        " engine and the step"))
    max_engine_restarts: int = Field(3, ge=0, description=(
        "how many times in a row a failed engine (health checks) is restarted, its weights restored and put back"
        " in the router, before the run gives up on it; the step metrics count `engine/restarts` and"
        " `engine/request_retries` (generate requests retried after a router 5xx or a dropped connection). A"
        " server restored after a sync the trainer pushed itself (CUDA IPC, NCCL, CPU tensors) loads the copy"
        " trainer rank 0 writes after every sync to `<logging.dir>/sglang/weights/restore` (host memory for one"
        " copy of the weights on rank 0, written in the background; trainer and engines must share that folder);"
        " `0` turns restarts and the copy off"))
    generate_max_retries: int = Field(20, ge=0, description=(
        "failed attempts (router 5xx such as 503 \"error sending request\", a dropped connection) of one generate"
        " request retried, with backoff up to 2 s, while no engine is being restarted; then the request fails"
        " naming the router and the engines. While an engine is restarting its requests wait for it instead, up"
        " to `engine_startup_timeout`"))
    check_weight_update: bool = Field(False, description=(
        "after every sync, compare the checksums of sampled parameters (each bucket's first and last that the"
        " engine holds under the same name; with TP only the replicated norms) with the engines' (SGLang's"
        " `/weights_checker`; slime: `--check-weight-update-equal`)"))

    @model_validator(mode="before")
    @classmethod
    def _typed_flags_out_of_server_args(cls, data: Any) -> Any:
        """A typed flag given in server_args (an old ``rollout.engine_args``) is checked as its typed field."""
        if not isinstance(data, dict) or not isinstance(data.get("server_args"), dict):
            return data
        server_args, data = dict(data["server_args"]), dict(data)
        for key in list(server_args):
            field = flag_name(key).replace("-", "_")
            if field in cls.SERVER_FLAGS:
                if data.get(field) is not None:
                    raise ValueError(f"server_args.{key}: set it once, as rollout.sglang.{field}")
                data[field] = server_args.pop(key)
        return {**data, "server_args": server_args}

    @field_validator("engine_urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not is_http_url(url):
                raise ValueError(f"{url!r} is not an http(s) URL; give http://host:port")
        return urls

    @field_validator("server_args")
    @classmethod
    def _not_our_flags(cls, server_args: dict[str, Any]) -> dict[str, Any]:
        for key in server_args:
            if flag_name(key) in OWN_FLAGS:
                raise ValueError(f"{key}: slime-rl sets --{flag_name(key)} itself; remove it from server_args")
        return server_args

    @field_validator("server_args")
    @classmethod
    def _no_copies_a_sync_leaves_stale(cls, server_args: dict[str, Any]) -> dict[str, Any]:
        flags = {flag_name(k): (k, v) for k, v in server_args.items()}
        for flag, why in STALE_AFTER_SYNC.items():
            if flag in flags and flags[flag][1] not in (None, False):
                raise ValueError(f"{flags[flag][0]}: {why}")
        dcp = str(flags.get("dcp-size", (None, 1))[1])
        replicate = flags.get("dcp-replicate-q-proj", (None, None))[1]
        # unset, SGLang turns it on for some models (Kimi-K3's DCP overrides): only an explicit false is safe
        if replicate or (dcp.isdigit() and int(dcp) > 1 and replicate is not False):
            raise ValueError(f"{flags.get('dcp-replicate-q-proj', flags.get('dcp-size'))[0]}: {DCP_REPLICATE_Q}")
        return server_args

    @field_validator("chunked_prefill_size")
    @classmethod
    def _chunk_size(cls, size: int | None) -> int | None:
        if size is not None and size != -1 and size < 1:
            raise ValueError(f"give a number of tokens >= 1, or -1 to turn chunked prefill off (got {size})")
        return size

    def server_flags(self) -> dict[str, Any]:
        """The typed server flags that are set, as server_args entries."""
        return {name: getattr(self, name) for name in self.SERVER_FLAGS if getattr(self, name) is not None}

    def check(self, cfg: Config, where: str) -> None:
        """What the values alone cannot say: the interpreter runs here; launch flags need a launch."""
        python = self.engine_python
        if python is not None and not (os.access(python, os.X_OK) if os.sep in python else shutil.which(python)):
            raise ConfigError(f"{where}.engine_python", f"{python} is not an executable interpreter;"
                                                        " give the python of SGLang's environment")
        for name in ("api_key", "admin_api_key"):
            if getattr(self, name) is not None and not self.engine_urls:
                raise ConfigError(f"{where}.{name}", "is for servers you run (rollout.sglang.engine_urls); the servers"
                                                     " slime-rl launches get fresh keys: remove it")
        if self.engine_urls and (flags := self.server_flags()):
            name = next(iter(flags))
            raise ConfigError(f"{where}.{name}", f"sets a flag of servers slime-rl launches, but {where}.engine_urls"
                                                 f" attaches to running ones; start those with --{flag_name(name)}"
                                                 f" or drop {where}.engine_urls")


def sglang_settings(cfg: Config) -> SGLangSettings:
    """The run's ``rollout.sglang`` (its defaults when the config gives none)."""
    return cfg.rollout.settings_of(SGLangSettings, "sglang")
