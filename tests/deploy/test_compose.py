"""deploy/docker-compose.yml (Cadenza, Open WebUI, Prometheus, Grafana) holds together without
Docker: every port on the host's loopback, Cadenza's command a valid `cadenza serve` line that
Open WebUI can reach by its service name, Prometheus scraping it with the key, Grafana's
provisioning finding the dashboard, and every metric the dashboard reads one we export."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import yaml

from cadenza.cli.main import build_parser
from cadenza.gateway.metrics import Metrics, RequestTimes
from cadenza.stats import BlockPoolStats, EngineStats, ServingStats

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_every_service_publishes_on_the_hosts_loopback_only() -> None:
    services = _compose()["services"]
    assert set(services) == {"cadenza", "open-webui", "prometheus", "grafana"}
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)


def test_cadenzas_command_serves_on_the_container_interface_for_its_service_name() -> None:
    cadenza = _compose()["services"]["cadenza"]
    args = build_parser().parse_args(cadenza["command"][1:])
    assert (args.command, args.host, args.metrics_prefix) == ("serve", "0.0.0.0", "cadenza")
    assert "cadenza" in args.allowed_hosts  # Open WebUI and Prometheus call it by that name
    webui = _compose()["services"]["open-webui"]["environment"]
    assert webui["OPENAI_API_BASE_URL"] == "http://cadenza:8000/v1"
    assert webui["OPENAI_API_KEY"] == cadenza["environment"]["CADENZA_API_KEY"]


def test_prometheus_scrapes_cadenza_with_the_key_file_it_mounts() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["cadenza:8000"] and job["metrics_path"] == "/metrics"
    mounts = dict(v.rsplit(":", 1)[0].split(":") for v in _compose()["services"]["prometheus"]["volumes"])
    assert job["authorization"]["credentials_file"] in mounts.values()
    assert (DEPLOY / mounts["./prometheus.yml"].replace("/etc/prometheus/", "")).name == "prometheus.yml"


def _exported_names() -> set[str]:
    """Every sample name /metrics gives under the default prefix, engine gauges included."""
    metrics = Metrics("m")
    recorder = metrics.request()
    recorder.tokens(1, 0.5, 0.0)
    recorder.tokens(1, 0.6, 0.0)
    recorder.finish("stop", 3, RequestTimes(0.0, 0.1, 0.5, 1.0), 2)
    kv = BlockPoolStats(num_blocks=1, num_free_blocks=1, usage=0.0, queries=0, hits=0, evictions=0)
    engine = EngineStats(num_running=0, num_waiting=0, num_preemptions=0, kv_cache=kv)
    stats = ServingStats(
        engine=engine, num_workers=0, worker_pids=[], num_worker_restarts=0, num_steps=0, compiled_graph=False,
        engine_pid=0,
    )  # fmt: skip

    class Engine:
        async def stats(self) -> ServingStats:
            return stats

    text = asyncio.run(metrics.render(Engine())).decode()  # type: ignore[arg-type]
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_the_dashboard_reads_only_metrics_we_export_and_grafana_finds_it() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "cadenza.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {m.replace("${prefix}", "cadenza") for e in exprs for m in re.findall(r"\$\{prefix\}:\w+", e)}
    assert used and used - _exported_names() == set()
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/cadenza.yml").read_text())
    mounts = _compose()["services"]["grafana"]["volumes"]
    assert any(m.endswith(f"{provider['providers'][0]['options']['path']}/cadenza.json:ro") for m in mounts)
