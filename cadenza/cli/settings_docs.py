"""docs/settings.md's tables, made from the settings' own fields (cadenza/setting.py).

`python -m cadenza.cli.settings_docs` rewrites them; `--check` exits 1 when the file is stale
(tests/cadenza_api/test_settings_docs.py runs it)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from cadenza.config import EngineConfig
from cadenza.gateway.settings import GatewaySettings
from cadenza.setting import flag_name, info_of, kind_of

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
# Where each class's tables go: between its two marker lines in docs/settings.md.
MARKED: dict[str, type] = {"engine": EngineConfig, "gateway": GatewaySettings}


def default_text(field: dataclasses.Field) -> str:
    meta = info_of(field)
    if meta.default_text is not None:
        return meta.default_text
    value: Any = field.default
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == ():
        return "none"
    return f"`{value}`" if isinstance(value, str) else str(value)


def _flag_cell(field: dataclasses.Field) -> str:
    meta = info_of(field)
    if not meta.flag:
        return "(positional or `--model`)" if field.name == "model" else "-"
    names = [flag_name(field.name), *meta.aliases]
    if kind_of(field) == "bool":
        names.append("--no-" + flag_name(field.name)[2:])
    return ", ".join(f"`{n}`" for n in names)


def render(cls: type) -> str:
    """One table per group, in the order the fields first name them."""
    groups: dict[str, list[str]] = {}
    for field in dataclasses.fields(cls):
        meta = info_of(field)
        doc = meta.doc + (f"; choices: {', '.join(map(str, meta.choices))}" if meta.choices else "")
        row = f"| `{field.name}` | {_flag_cell(field)} | {default_text(field)} | {doc} |"
        groups.setdefault(meta.group, []).append(row)
    parts = []
    for group, rows in groups.items():
        header = f"### {group.capitalize()}\n\n| setting | flag | default | meaning |\n| --- | --- | --- | --- |"
        parts.append("\n".join([header, *rows]))
    return "\n\n".join(parts)


def updated(text: str) -> str:
    """`text` with every marked table replaced by its rendering."""
    for marker, cls in MARKED.items():
        begin, end = f"<!-- settings:{marker} -->", f"<!-- /settings:{marker} -->"
        head, found, rest = text.partition(begin)
        if not found or end not in rest:
            raise ValueError(f"docs/settings.md lacks the markers {begin} ... {end}")
        text = f"{head}{begin}\n{render(cls)}\n{end}{rest.split(end, 1)[1]}"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 if docs/settings.md is stale")
    args = p.parse_args(argv)
    text = DOC.read_text(encoding="utf-8")
    new = updated(text)
    if args.check:
        if new != text:
            print("docs/settings.md is stale: run `python -m cadenza.cli.settings_docs`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
