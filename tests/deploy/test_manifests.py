"""The deploy files keep the hardening: Ray's dashboard off 0.0.0.0, the API key from a Secret
and never in a config, the image not root and exposing only Serve's port."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ALL_INTERFACES = {"0.0.0.0", "::", "[::]", "*", ""}


def _manifest() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "kuberay-rayservice.yaml").read_text())


def _serve_configs() -> dict[str, dict[str, Any]]:
    return {
        "serve_config.yaml": yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()),
        "kuberay serveConfigV2": yaml.safe_load(_manifest()["spec"]["serveConfigV2"]),
    }


def _groups() -> list[dict[str, Any]]:
    cluster = _manifest()["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


IMAGES = ["Dockerfile", "Dockerfile.cpu"]


def _dockerfile(name: str = "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (w[0].upper(), w[1] if len(w) > 1 else "")
        for line in lines
        if line and not line.startswith("#")
        for w in [line.split(None, 1)]
    ]


def test_no_ray_dashboard_on_all_interfaces() -> None:
    head = _groups()[0]
    host = head["rayStartParams"].get("dashboard-host")
    assert host is not None, "left out, KubeRay binds the dashboard on 0.0.0.0"
    assert host.strip().strip("\"'") not in ALL_INTERFACES
    for group in _groups()[1:]:
        assert group.get("rayStartParams", {}).get("dashboard-host") in (None, "127.0.0.1")
    if var := re.fullmatch(r"\$\{?(\w+)\}?", host):  # the pod's IP, from the downward API
        container = head["template"]["spec"]["containers"][0]
        source = _env(container)[var[1]]["valueFrom"]["fieldRef"]["fieldPath"]
        assert source == "status.podIP"
        # KubeRay's own head probes fetch localhost:8265, where such a dashboard is not.
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] == 8265 and "host" not in container[probe]["httpGet"]
    else:
        assert host == "127.0.0.1"
    for instruction, args in _dockerfile():
        if instruction in ("CMD", "ENTRYPOINT", "RUN"):
            assert not re.search(r"dashboard[-_]host[= ]+(0\.0\.0\.0|::)", args), args


def test_the_api_key_comes_from_a_secret_in_every_ray_container() -> None:
    for group in _groups():
        for container in group["template"]["spec"]["containers"]:
            key = _env(container).get("CADENZA_API_KEY")
            assert key is not None, f"{container['name']} has no CADENZA_API_KEY"
            assert "value" not in key, "the key must not be written in the manifest"
            ref = key["valueFrom"]["secretKeyRef"]
            assert ref["name"] and ref["key"]
            literal = [e["name"] for e in container.get("env", []) if "KEY" in e["name"] and "value" in e]
            assert not literal, literal


def _keys(tree: Any) -> set[str]:
    if isinstance(tree, dict):
        return set(tree) | {k for v in tree.values() for k in _keys(v)}
    if isinstance(tree, list):
        return {k for v in tree for k in _keys(v)}
    return set()


@pytest.mark.parametrize("name", ["serve_config.yaml", "kuberay serveConfigV2"])
def test_no_api_key_in_the_serve_config(name: str) -> None:
    config = _serve_configs()[name]
    assert "api_key" not in _keys(config)
    (app,) = config["applications"]
    assert "api_key" not in (app["args"].get("gateway") or {})


@pytest.mark.parametrize("image", IMAGES)
def test_the_image_runs_as_a_user_and_exposes_only_the_serve_port(image: str) -> None:
    instructions = _dockerfile(image)
    users = [args.split(":", 1)[0].strip() for instruction, args in instructions if instruction == "USER"]
    assert users, "no USER: the image runs as root"
    assert users[-1] not in ("root", "0"), users
    last_user = max(i for i, (instruction, _) in enumerate(instructions) if instruction == "USER")
    cmd = max(i for i, (instruction, _) in enumerate(instructions) if instruction in ("CMD", "ENTRYPOINT"))
    assert last_user < cmd
    exposed = [port for instruction, args in instructions if instruction == "EXPOSE" for port in args.split()]
    assert exposed == ["8000"], exposed


def test_the_serve_app_takes_the_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from cadenza.gateway.serve_app import API_KEY_ENV, gateway_with_env_key
    from cadenza.gateway.settings import GatewaySettings

    assert API_KEY_ENV == "CADENZA_API_KEY"
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert gateway_with_env_key({"max_queued_requests": 8}) == {"max_queued_requests": 8}
    monkeypatch.setenv(API_KEY_ENV, "from-the-secret")
    assert gateway_with_env_key({})["api_key"] == "from-the-secret"
    assert gateway_with_env_key({"api_key": None})["api_key"] == "from-the-secret"
    assert gateway_with_env_key({"api_key": "in-config"})["api_key"] == "in-config"  # the config wins
    assert GatewaySettings(**gateway_with_env_key({})).key_accepts(["from-the-secret"])
    monkeypatch.setenv(API_KEY_ENV, "  ")
    with pytest.raises(ValueError, match="api_key must not be empty"):  # set but blank: refuse, not open
        GatewaySettings(**gateway_with_env_key({}))


@pytest.mark.parametrize("image", IMAGES)
def test_the_image_copies_every_package_folder(image: str) -> None:
    """`pip install .` in the image builds from what was copied: a package folder left out
    (cli/ once) installs a `cadenza` command that cannot import its own entry point."""
    setuptools = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    copied = {args.split()[0] for instruction, args in _dockerfile(image) if instruction == "COPY"}
    assert set(setuptools["package-dir"].values()) <= copied


@pytest.mark.parametrize("image", IMAGES)
def test_docker_run_serves_on_the_container_interface_with_a_healthcheck(image: str) -> None:
    """`docker run -p 8000:8000` reaches the server: it listens on the container's interface
    (its loopback reaches nothing from outside), /health is its HEALTHCHECK, and Ray is the
    version the KubeRay manifest names."""
    instructions = _dockerfile(image)
    cmd = json.loads(next(args for instruction, args in instructions if instruction == "CMD"))
    from cadenza.cli.main import build_parser

    args = build_parser().parse_args(cmd[1:])
    assert cmd[0] == "cadenza" and (args.command, args.host, args.port) == ("serve", "0.0.0.0", 8000)
    health = next(args for instruction, args in instructions if instruction == "HEALTHCHECK")
    assert "http://127.0.0.1:8000/health" in health
    ray_version = _manifest()["spec"]["rayClusterConfig"]["rayVersion"]
    assert any(f'"ray[serve]=={ray_version}"' in args for instruction, args in instructions if instruction == "RUN")


def test_the_manifest_has_no_fields_kuberay_no_longer_reads() -> None:
    spec = _manifest()["spec"]
    assert not {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"} & set(spec)
