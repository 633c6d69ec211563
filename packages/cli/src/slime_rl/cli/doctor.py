"""`slime-cli doctor`: what is installed here and whether it imports.

A backend adds lines of its own through the entry point group ``slime_rl.doctor_checks``: the entry
point's name is the section, its target a function of no arguments returning ``(name, status)`` pairs
(trainer-megatron's ``moe`` says which expert MLP its MoE layers run). The CLI imports no backend:
a contribution that does not load, raises or returns something else is one line under its section.
"""

from __future__ import annotations

import importlib
import platform
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, entry_points, version

from slime_rl.core.config.backends import registered_settings
from slime_rl.core.config.cpu import choose_cpu_dtype, cpu_info
from slime_rl.core.infra.plugins import GROUPS, PluginError, installed, load_plugin

# distribution -> module it provides
SLIME_PACKAGES = {
    "slime-rl-core": "slime_rl.core",
    "slime-rl-buffer": "slime_rl.buffer",
    "slime-rl-trainer-megatron": "slime_rl.trainer_megatron",
    "slime-rl-rollout-sglang": "slime_rl.rollout_sglang",
    "slime-rl-rollout-hf": "slime_rl.rollout_hf",
    "slime-rl-cli": "slime_rl.cli",
}
ENGINES = "slime_rl.rollout_engines"
DOCTOR_CHECKS = "slime_rl.doctor_checks"
TRAINERS = "slime_rl.trainers"
LIBRARIES = ("megatron-core", "sglang", "sglang-router", "ray", "transformers", "pydantic")


@dataclass
class Report:
    lines: list[tuple[str, str, str]] = field(default_factory=list)  # (section, name, status)
    broken: list[str] = field(default_factory=list)  # what is installed but does not import

    def add(self, section: str, name: str, status: str, *, ok: bool = True, what: str | None = None) -> None:
        self.lines.append((section, name, status))
        if not ok:
            self.broken.append(what or name)


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _one_line(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())


def _cause(err: Exception) -> str:
    # PluginError already says which entry point; keep only why it failed.
    text = " ".join(str(err).split())
    return text.split(" does not load: ", 1)[-1] if isinstance(err, PluginError) else _one_line(err)


def _provider(group: str, name: str) -> str:
    """The distribution and version that registered an entry point: a backend's pip name."""
    dist = next((ep.dist for ep in entry_points(group=group) if ep.name == name), None)
    return f"{dist.name} {dist.version}" if dist is not None else "no distribution"


def _claims(engine_class: object) -> str:
    """A rollout engine's claimed optional capabilities (RolloutEngine.capabilities; the conformance suite's)."""
    claimed = sorted(getattr(engine_class, "capabilities", ()) or ())
    return f"capabilities: {', '.join(claimed)}" if claimed else "capabilities: none beyond the core contract"


def collect() -> Report:
    report = Report()
    report.add("python", "python", f"{platform.python_version()} ({sys.executable})")
    report.add("python", "platform", platform.platform())

    try:
        import torch

        cuda = torch.cuda.is_available()
        report.add("torch", "torch", torch.__version__)
        report.add("torch", "cuda", torch.version.cuda or "none (CPU build)")
        if cuda:
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            report.add("torch", "devices", f"{len(names)}: {', '.join(names)}")
        else:
            report.add("torch", "devices", "none (runs on CPU)")
        info = cpu_info()
        report.add("cpu", "model", info.describe())
        choice = choose_cpu_dtype(info)
        report.add("cpu", "model.dtype=auto", f"{choice.dtype} on this CPU: {choice.reason}")
    except ImportError as err:
        report.add("torch", "torch", f"does not import: {_one_line(err)}", ok=False)

    for dist, module in SLIME_PACKAGES.items():
        ver = _version(dist)
        if ver is None:
            report.add("slime-rl", dist, "not installed")
            continue
        try:
            importlib.import_module(module)
            report.add("slime-rl", dist, f"{ver}, imports")
        except Exception as err:  # report, don't crash: that is the doctor's job
            report.add("slime-rl", dist, f"{ver}, does not import: {_one_line(err)}", ok=False)

    for group in GROUPS:
        names = installed(group)
        if not names:
            report.add(group, "(none)", "no backend installed")
        for name, target in sorted(names.items()):
            try:
                loaded = load_plugin(group, name)
                if group == ENGINES:
                    report.add(group, name, f"{target} ({_provider(group, name)}), loads, {_claims(loaded)}")
                    continue
                report.add(group, name, f"{target}, loads")
            except Exception as err:  # PluginError, or an error raised while importing the backend module
                report.add(group, name, f"{target}, does not load: {_cause(err)}", ok=False, what=f"{group}:{name}")

    from slime_rl.core.sandbox.report import sandbox_report  # runs one sandboxed call

    for name, status, ok in sandbox_report():
        report.add("sandbox", name, status, ok=ok, what=f"sandbox {name}")

    for dist in LIBRARIES:
        report.add("libraries", dist, _version(dist) or "not installed")
    add_contributed_lines(report)
    return report


def add_contributed_lines(report: Report) -> None:
    """Every installed ``slime_rl.doctor_checks`` contribution, by section name."""
    for section, target in sorted(installed(DOCTOR_CHECKS).items()):
        _add_contribution(report, section, target)


def _add_contribution(report: Report, section: str, target: str) -> None:
    """One backend's contribution as lines under ``section``; one line if it fails."""
    try:
        lines = list(load_plugin(DOCTOR_CHECKS, section)())
        if not all(isinstance(line, tuple) and len(line) == 2 and all(isinstance(part, str) for part in line)
                   for line in lines):
            raise TypeError(f"returned {repr(lines)[:80]}, not a list of (name, status) string pairs")
    except Exception as err:  # a backend's broken check is reported, not raised: that is the doctor's job
        report.add(section, section, f"{target} ({_provider(DOCTOR_CHECKS, section)}), does not run: {_cause(err)}",
                   ok=False, what=f"{DOCTOR_CHECKS}:{section}")
        return
    for name, status in lines:
        report.add(section, name, status)


def model_support(path: str) -> tuple[bool, str]:
    """`doctor --model`: what each installed trainer backend makes of the model folder at ``path`` (its settings
    model's ``model_support``), and whether one of them trains it (True where none has anything to say)."""
    out = [f"model support of {path} (trainer backends):"]
    verdicts = []
    for name in sorted(installed(TRAINERS)):
        try:
            settings = registered_settings(TRAINERS, name)
            verdict = settings.model_support(path) if settings is not None else None
        except Exception as err:  # a backend's broken check is reported, not raised
            out.append(f"  {name}: does not run: {_cause(err)}")
            continue
        if verdict is None:
            continue
        supported, lines = verdict
        verdicts.append(supported)
        out.append(f"  {name}: {'supported' if supported else 'NOT supported'}")
        out += [f"    {line_name}: {status}" for line_name, status in lines]
    if len(out) == 1:
        out.append("  (no installed trainer checks models)")
    return any(verdicts) or not verdicts, "\n".join(out)


def render(report: Report) -> str:
    out: list[str] = []
    section = None
    width = max(len(name) for _, name, _ in report.lines)
    for sec, name, status in report.lines:
        if sec != section:
            out.append(f"{sec}:")
            section = sec
        out.append(f"  {name.ljust(width)}  {status}")
    out.append("")
    out.append(f"problems: {', '.join(report.broken)}" if report.broken else "no problems found")
    return "\n".join(out)
