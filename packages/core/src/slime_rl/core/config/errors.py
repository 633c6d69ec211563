"""A config mistake as one line: `ConfigError`, and the two ways one is found (a key no section has, a value
pydantic refuses) said as ``<dotted field>: <what is wrong and the fix>``."""

from __future__ import annotations

import difflib
import re
import reprlib
from collections.abc import Iterable

from pydantic import ValidationError


class ConfigError(ValueError):
    """A config mistake. ``str(err)`` is one line: ``<field>: <what is wrong and the fix>``."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):  # pickle (Ray) rebuilds it from both arguments, not from the joined message
        return type(self), (self.field, self.message), self.__dict__


def unknown_key_error(prefix: str, key: object, valid: Iterable[str]) -> ConfigError:
    """``key`` is not one of ``valid`` in section ``prefix``: name the nearest valid key, or list them."""
    valid = sorted(set(valid))
    dotted = f"{prefix}.{key}" if prefix else str(key)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    hint = f"did you mean `{prefix + '.' if prefix else ''}{close[0]}`?" if close else (
        f"valid keys here: {', '.join(valid)}")
    return ConfigError(dotted, f"unknown key; {hint}")


# pydantic's type errors, said as what to give instead
_TYPE_ERRORS = {
    "int_type": "must be a whole number",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string (quote it)",
    "finite_number": "must be a finite number (not .inf or .nan)",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
}
_UNION_TAG = re.compile(r"int|float|bool|str|none|(list|dict|literal)\[.*\]|function-.*|\[key\]")


def field_error(err: ValidationError, prefix: str = "") -> ConfigError:
    """pydantic's first error as one line: the dotted field (under ``prefix``), what is wrong, what it got
    (shortened). A validator that raised a ConfigError (a backend's section, checked inside its section)
    already names its field: that error is the answer."""
    first = err.errors(include_url=False)[0]
    raised = (first.get("ctx") or {}).get("error")
    if isinstance(raised, ConfigError):
        return raised
    # drop the union-member tags pydantic puts in the location (`bool`, `list[str]`, `function-after[...]`)
    loc = ".".join([prefix] * bool(prefix) + [str(p) for p in first["loc"] if not _UNION_TAG.fullmatch(str(p))])
    value = first.get("input")
    if first["type"] == "value_error":  # our validators' messages say it all, the value included
        return ConfigError(loc or "config", first["msg"].removeprefix("Value error, "))
    message = _TYPE_ERRORS.get(first["type"]) or first["msg"].replace("Input should be", "must be")
    got = (str(value).lower() + ", a boolean") if isinstance(value, bool) else reprlib.repr(value)
    return ConfigError(loc or "config", f"{message} (got {got})")
