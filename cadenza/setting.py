"""One source of truth for a setting: the dataclass field carries its group, its one-line
doc and how it reads from the command line, and the CLI flags, their help and the settings
tables in docs/settings.md are all made from it (cadenza/settings_docs.py), so none can drift."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

# Field metadata keys.
_KEY = "cadenza"


@dataclasses.dataclass(frozen=True, slots=True)
class SettingInfo:
    """What a field says about itself beyond its type and default.

    group: the docs section and --help group (vLLM's: model, cache, scheduler, parallel,
    speculative, device; plus limits, and the gateway's own). parse: how a flag's text becomes
    the value (default: the field's type). aliases: other spellings of the flag (vLLM's `-tp`).
    default_text: the default as the docs say it where the value alone says little ("the
    model's context"). env: an environment variable the flag's default is read from.
    flag: False for a setting that is not a flag (the model, given positionally or --model).
    """

    group: str
    doc: str
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()
    default_text: str | None = None
    env: str | None = None
    flag: bool = True


def setting(default: Any, group: str, doc: str, **info: Any) -> Any:  # noqa: ANN401 - a field of any type
    """A dataclass field whose metadata documents it (see SettingInfo)."""
    return dataclasses.field(default=default, metadata={_KEY: SettingInfo(group, doc, **info)})


def info_of(field: dataclasses.Field) -> SettingInfo:
    try:
        return field.metadata[_KEY]
    except KeyError:
        raise TypeError(f"setting {field.name!r} has no setting(...) metadata: give it a group and a doc") from None


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def kind_of(field: dataclasses.Field) -> str:
    """The field's annotation (a string under `from __future__ import annotations`), bare."""
    text = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    return text.replace(" | None", "").strip()


_PARSERS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def add_flags(p: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of `cls`, grouped in --help as in the docs."""
    groups: dict[str, Any] = {}  # group -> argparse's argument group
    for field in dataclasses.fields(cls):
        meta = info_of(field)
        if not meta.flag or field.name in skip:
            continue
        if meta.group not in groups:
            groups[meta.group] = p.add_argument_group(f"{meta.group} settings")
        _add_flag(groups[meta.group], field, meta)


def _add_flag(p: Any, field: dataclasses.Field, meta: SettingInfo) -> None:  # noqa: ANN401 - argparse's group
    names = (flag_name(field.name), *meta.aliases)
    default = field.default
    kind = kind_of(field)
    if meta.env:
        default = os.environ.get(meta.env) or default
    help_text = meta.doc.replace("%", "%%")
    if kind == "bool":  # --x / --no-x as vLLM spells them; type=bool would read "False" as True
        p.add_argument(*names, action=argparse.BooleanOptionalAction, default=default, help=help_text)
    elif kind.startswith("tuple"):  # a list of words; type=tuple would split a word into letters
        p.add_argument(*names, nargs="*", default=list(default), help=help_text)
    else:
        parse = meta.parse or _PARSERS.get(kind, str)
        p.add_argument(*names, type=parse, default=default, choices=meta.choices, help=help_text)


def values_from_args(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of `cls` that are flags, from parsed arguments (lists back to tuples)."""
    values = {}
    for field in dataclasses.fields(cls):
        if info_of(field).flag and hasattr(args, field.name):
            value = getattr(args, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return values


def json_value(text: str) -> Any:  # noqa: ANN401 - whatever the JSON holds
    """A flag that takes JSON (`--speculative-config '{"method": "ngram"}'`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
