"""The installed package's version (`cadenza --version`, GET /version)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("cadenza")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"
