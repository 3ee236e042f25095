"""Which Ray a client gets (actors/local_ray.py): the cluster the user names, else a private
instance, never one merely found on this host; a named cluster that does not answer is an
error within seconds that names it. No Ray instance is started here."""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterator

import pytest
import ray

from cadenza.actors import local_ray
from cadenza.actors.local_ray import ensure_ray, join_ray, named_ray_address

# The failure these guard against is ray.init waiting minutes on a GCS that is not there (over
# 200 s, measured); the probe answers in under PROBE_TIMEOUT_S x 2. A bound, not a timing.
HANG_S = 30.0


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process holds no Ray (the suite may share one: ensure_ray would keep it), no
    RAY_ADDRESS, and ray.init may not be reached: every error must come from the probe."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def refused(**kwargs: object) -> None:
        raise AssertionError(f"ray.init was reached with {kwargs}")

    monkeypatch.setattr(ray, "init", refused)


@pytest.fixture
def ways(no_ray: None, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """ensure_ray's two ways to get Ray, recorded instead of taken."""
    taken: list[tuple[str, object]] = []
    monkeypatch.setattr(local_ray, "init_local_ray", lambda num_cpus, **_: taken.append(("private", num_cpus)))
    monkeypatch.setattr(local_ray, "join_ray", lambda address, **_: taken.append(("join", address)))
    monkeypatch.setattr(local_ray, "_gcs_address", lambda: "127.0.0.1:1234")
    return taken


@pytest.fixture
def dead_address() -> str:
    """host:port where nothing listens (a port just freed): connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def silent_address() -> Iterator[str]:
    """host:port that accepts connections and never speaks: not a GCS."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_nothing_named_is_a_private_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert named_ray_address() is None
    assert named_ray_address("") is None
    assert named_ray_address("local") is None  # ray.init's own word for a new instance


def test_ray_address_names_a_cluster_and_the_argument_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert named_ray_address() == "10.0.0.5:6379"
    assert named_ray_address("127.0.0.1:7000") == "127.0.0.1:7000"
    assert named_ray_address("auto") == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert named_ray_address() is None


def test_unnamed_starts_a_private_instance_with_a_cpu_per_worker(ways: list) -> None:
    where = ensure_ray(1)
    many = ensure_ray(10_000)
    assert ways == [("private", os.cpu_count()), ("private", 10_000)]
    assert where == "a private Ray instance (GCS 127.0.0.1:1234)" and many == where


def test_a_named_cluster_is_joined_from_the_argument_or_ray_address(
    ways: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ensure_ray(1, "10.0.0.5:6379") == "the Ray cluster at 10.0.0.5:6379 (GCS 127.0.0.1:1234)"
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    ensure_ray(1)
    ensure_ray(1, "10.0.0.6:6379")
    assert ways == [("join", "10.0.0.5:6379"), ("join", "auto"), ("join", "10.0.0.6:6379")]


def test_ray_this_process_holds_is_kept(ways: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite's one shared instance, a Serve replica's: neither started nor joined again."""
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert ensure_ray(1, "10.0.0.5:6379") == "the Ray instance this process holds (GCS 127.0.0.1:1234)"
    assert ways == []


def test_a_named_cluster_that_fails_is_not_replaced_by_a_private_one(
    ways: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    def gone(address: str, **_: object) -> None:
        raise ConnectionError(f"no Ray cluster answers at {address}")

    monkeypatch.setattr(local_ray, "join_ray", gone)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    with pytest.raises(ConnectionError, match="10.0.0.5:6379"):
        ensure_ray(1)
    assert ways == []


@pytest.mark.parametrize("via_env", [False, True])
def test_a_named_cluster_that_refuses_fails_at_once_naming_it(
    no_ray: None, dead_address: str, via_env: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if via_env:
        monkeypatch.setenv("RAY_ADDRESS", dead_address)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=re.escape(f"no Ray cluster answers at {dead_address}")):
        ensure_ray(1, None if via_env else dead_address)
    assert time.monotonic() - start < HANG_S


def test_a_port_that_is_not_a_gcs_fails_within_seconds_naming_it(no_ray: None, silent_address: str) -> None:
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=re.escape(f"no Ray GCS answers at {silent_address}")):
        join_ray(silent_address)
    assert time.monotonic() - start < HANG_S


def test_localhost_and_ray_client_addresses_are_probed_too(no_ray: None, dead_address: str) -> None:
    port = dead_address.rsplit(":", 1)[1]
    with pytest.raises(ConnectionError, match=re.escape(f"localhost:{port} (127.0.0.1:{port})")):
        join_ray(f"localhost:{port}")
    with pytest.raises(ConnectionError, match=re.escape(f"ray://127.0.0.1:{port}")):
        join_ray(f"ray://127.0.0.1:{port}")


def test_auto_finds_no_cluster_or_a_dead_one(
    no_ray: None, dead_address: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The address "auto" is the only way to take a cluster found on this host; nothing found, or a
    ray_current_cluster left by processes that died, is an error at once."""
    from ray._private import services

    monkeypatch.setattr(services, "find_gcs_addresses", lambda: frozenset())  # other Ray users of this host
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # "auto" would set it in os.environ for good
    with pytest.raises(ConnectionError, match="no Ray cluster found for address 'auto'"):
        join_ray("auto")
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(dead_address)
    with pytest.raises(ConnectionError, match=re.escape(f"no Ray cluster answers at auto ({dead_address})")):
        join_ray("auto")
