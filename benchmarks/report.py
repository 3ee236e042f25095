"""Benchmarks report alike: indented JSON on stdout, and the same in a file when asked."""

from __future__ import annotations

import json
from typing import Any


def report(result: dict[str, Any], path: str | None) -> dict[str, Any]:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    return result
