"""docs/config.md documents every config key, and README.md opens with the two commands."""

import re
from pathlib import Path

from pydantic import BaseModel, Field

from slime_rl.core.config import BackendSettings, Config, docs

REPO = Path(__file__).resolve().parents[2]


def documented_keys() -> dict[str, set[str]]:
    """{section: keys} from the `## section` tables of docs/config.md."""
    keys: dict[str, set[str]] = {}
    section = None
    for line in (REPO / "docs" / "config.md").read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif section and (m := re.match(r"\| `([a-z0-9_]+)` \|", line)):
            keys.setdefault(section, set()).add(m.group(1))
    return keys


def config_sections(model=Config, prefix=""):
    """{dotted section: model} for every section of the tree, nested ones (rollout.sandbox) included."""
    sections = {}
    for name, info in model.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            sections[prefix + name] = info.annotation
            sections.update(config_sections(info.annotation, f"{prefix}{name}."))
    return sections


def test_config_reference_covers_every_key():
    documented = documented_keys()
    sections = config_sections()
    assert "rollout.sandbox" in sections
    for name, section in sections.items():
        fields = {f.alias or n for n, f in section.model_fields.items()}
        missing = fields - documented.get(name, set())
        stale = documented.get(name, set()) - fields
        assert not missing, f"docs/config.md, section `{name}`: add {sorted(missing)}"
        assert not stale, f"docs/config.md, section `{name}`: {sorted(stale)} are no longer config keys"


def test_readme_opens_with_make_demo_and_make_test():
    text = (REPO / "README.md").read_text()
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]


def test_backend_settings_tables_are_current():
    """docs/config.md's tables of backend settings are what the models generate (config/docs.py)."""
    text = (REPO / "docs" / "config.md").read_text()
    assert docs.updated(text) == text, "docs/config.md: run `python -m slime_rl.core.config.docs docs/config.md`"
    for section in ("rollout.sglang", "rollout.hf", "trainer.megatron"):
        assert f"## {section}\n" in text


def test_a_new_backend_key_shows_in_the_generated_table():
    class Knobs(BackendSettings):
        """A backend's keys."""
        chunk: int | None = Field(None, description="tokens | per chunk")
        names: list[str] = Field(default_factory=list, description="some names")

    assert docs.settings_table(Knobs)[2:] == ["| `chunk` | `null` | tokens \\| per chunk |",
                                              "| `names` | `[]` | some names |"]
    stale = docs.updated("# title\n").replace("`chunked_prefill_size`", "`chunk_size`")
    assert docs.updated(stale) != stale and docs.main([str(REPO / "docs" / "config.md"), "--check"]) == 0
