"""docker-compose.yml and the Dockerfile, checked without a Docker engine: what the files say. (The
Dockerfile's install step run as plain shell: ``tests/test_compose.py``.)"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from typing import Any

import pytest
import yaml

from tests.repofiles import ROOT, dockerfile_instructions


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # type: ignore[no-any-return]


def _seconds(value: str) -> int:
    m = re.fullmatch(r"(\d+)(s|m)", value)
    assert m, value
    return int(m[1]) * (60 if m[2] == "m" else 1)


def test_the_app_services_run_one_built_image_in_exec_form_and_stop_gracefully() -> None:
    compose = _compose()
    services = compose["services"]
    for name in ("hub", "worker"):
        s = services[name]
        assert s["build"] == "." and s["image"] == "redpacket:latest", name
        command = s["command"]
        # Exec form, the program itself as PID 1 (no `sh -c`, so SIGTERM reaches it), nothing installed.
        assert isinstance(command, list) and command[0] == "redpacket", command
        assert not any("pip" in part or part in ("sh", "bash") for part in command), command
        assert s["restart"] == "unless-stopped"
        budget = int(s["environment"]["REDPACKET_SHUTDOWN_SECONDS"])
        assert _seconds(s["stop_grace_period"]) > budget, (s["stop_grace_period"], budget)
        for dep in s["depends_on"]:
            # Of the default stack only: podman-compose fails on a service a profile leaves out.
            assert dep in services and "profiles" not in services[dep], dep
            assert s["depends_on"][dep]["condition"] == "service_healthy"
    assert services["hub"]["command"] == ["redpacket", "serve"]
    assert services["worker"]["command"] == ["redpacket", "worker"]
    hub_check = services["hub"]["healthcheck"]
    assert "start_period" in hub_check and hub_check["test"] == ["CMD", "redpacket", "serve", "--check"]
    assert services["worker"]["healthcheck"]["test"] == ["CMD", "redpacket", "worker", "--check"]
    # What the worker's check reads is published by the worker of the same container.
    assert services["worker"]["environment"].get("REDPACKET_WORKER_METRICS_PORT", "9108") == "9108"
    for volume in (v.split(":")[0] for s in services.values() for v in s.get("volumes", [])):
        if volume.startswith("./"):  # a file of the repository (monitoring/)
            assert (ROOT / volume).exists(), volume
        else:
            assert volume in compose["volumes"], volume


def test_the_dockerfile_installs_once_and_runs_redpacket_in_exec_form() -> None:
    steps = dockerfile_instructions()
    runs = [rest for word, rest in steps if word == "RUN"]
    assert runs and any(r.startswith("pip install") for r in runs)
    cmd = next(rest for word, rest in steps if word == "CMD")
    assert cmd.startswith("[") and cmd.endswith("]") and "redpacket" in cmd  # exec form
    copied = [rest.split()[:-1] for word, rest in steps if word == "COPY"]
    for sources in copied:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_the_default_stack_makes_grabs_durable_on_disk() -> None:
    services = _compose()["services"]
    env = services["hub"]["environment"]
    assert env == services["worker"]["environment"]
    assert env["REDPACKET_GRAB_DURABILITY"] == "${REDPACKET_GRAB_DURABILITY:-aof}"
    # WAITAOF answers when the write is fsynced: with appendfsync always that is the same event-loop
    # turn (group commit), with everysec up to a second later, past the grab's durability timeout.
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"
    assert services["redis"]["image"].split(":")[1] >= "7.2"  # WAITAOF


def test_the_cluster_variant_is_six_nodes_formed_once_and_named_as_the_docs_say() -> None:
    compose = _compose()
    services = compose["services"]
    nodes = [f"redis-{n}" for n in range(1, 7)]
    for name in nodes:
        s = services[name]
        assert s["profiles"] == ["cluster"], name
        c = s["command"]
        assert c[c.index("--cluster-enabled") + 1] == "yes"
        assert c[c.index("--cluster-announce-hostname") + 1] == name  # MOVED answers name the service
        assert c[c.index("--appendonly") + 1] == "yes"
        assert s["volumes"] == [f"{name}-data:/data"]
    init = services["redis-cluster"]
    assert init["profiles"] == ["cluster"] and set(init["depends_on"]) == set(nodes)
    script = init["command"][0]
    assert "--cluster-replicas 1" in script and "cluster_state:ok ||" in script
    # docs/operations.md's command names masters of this file and the plain server as arq's queue.
    operations = (ROOT / "docs" / "operations.md").read_text()
    m = re.search(
        r"REDPACKET_REDIS_URL=redis\+cluster://(\S+) \\\n(.*)docker compose --profile cluster up", operations
    )
    assert m, "docs/operations.md: the cluster variant's command"
    assert {h.split(":")[0] for h in m[1].split(",")} <= set(nodes)
    assert "REDPACKET_QUEUE_REDIS_URL=redis://redis:6379/0" in m[2]
    assert "REDPACKET_REDIS_URL=redis+cluster://redis-1:6379" in (ROOT / "docker-compose.yml").read_text()


def test_no_secret_is_written_in_the_file_and_internal_tools_are_not_published() -> None:
    """Before: the MariaDB password `redpacket` in the file, Grafana's admin `admin` with anonymous
    viewers, and 3000, 9090 and 9108 published on every interface."""
    compose = _compose()
    services = compose["services"]
    env = services["hub"]["environment"]
    assert re.search(r"\$\{[A-Z_]+:\?[^}]+\}", env["REDPACKET_DATABASE_URL"])  # required, never a default
    # The token secret has no default either: empty unless set, and the hub refuses to start without it
    # unless the backend's public key or JWKS is set instead (RS256/ES256 setups need no secret).
    assert env["REDPACKET_SECRET"] == "${REDPACKET_SECRET:-}"
    assert services["mariadb"]["environment"]["MARIADB_PASSWORD"].startswith("${MARIADB_PASSWORD:?")
    assert "${MARIADB_PASSWORD:?" in env["REDPACKET_DATABASE_URL"]
    grafana = services["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_AUTH_ANONYMOUS_ORG_ROLE" not in grafana
    for name, service in services.items():
        for published in service.get("ports", []):
            if name == "lb":
                assert published == "8000:8000"  # the one port for strangers: the balancer's
            else:
                assert published.startswith("127.0.0.1:"), (name, published)
    # The hub's metrics are on a port of their own, not published, where Prometheus reads them.
    assert env["REDPACKET_METRICS_PORT"] == "9100"
    assert not any("9100" in p for s in services.values() for p in s.get("ports", []))


def test_the_system_installs_without_the_tools_and_the_image_listens_on_its_network() -> None:
    """Before: `pip install -e .` pulled Locust (and gevent), matplotlib, picows, websocket-client and rich
    (a newcomer's clone-to-serving went from 18.5 s to 86 s), the image carried them, and a `docker run`
    outside compose listened on the container's loopback."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    tools = {"locust", "matplotlib", "picows", "websocket-client", "rich", "wsproto"}

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=\[; ]", r, maxsplit=1)[0].lower() for r in requirements}

    assert not names(project["dependencies"]) & tools
    assert names(project["optional-dependencies"]["tools"]) == tools
    assert "redpacket[tools]" in project["optional-dependencies"]["test"]
    runs = [rest for word, rest in dockerfile_instructions() if word == "RUN" and "pip install" in rest]
    assert runs == ["pip install ."], runs  # the system alone, no extra
    assert ("ENV", "REDPACKET_HOST=0.0.0.0") in dockerfile_instructions()


def test_a_tool_command_without_the_tools_asks_for_them_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from server import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "locust" else real(name, *a)
    )
    with pytest.raises(SystemExit) as ended:
        cli.main(["load", "--headless"])
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the tools (locust missing)" in err[0] and ".[tools]" in err[0], err


def test_hub_and_worker_replicas_publish_no_port_and_sit_behind_the_balancer() -> None:
    """Before: the hub published 8000:8000 and the worker 9108:9108, so the `--scale hub=3 --scale
    worker=2` that prometheus.yml suggests collided on the host's ports."""
    services = _compose()["services"]
    assert "ports" not in services["hub"] and "ports" not in services["worker"]
    lb = services["lb"]
    assert lb["image"].startswith("haproxy:") and "./deploy/haproxy.cfg:" in lb["volumes"][0]
    config = (ROOT / "deploy" / "haproxy.cfg").read_text()
    assert "server-template hub" in config and "hub:8000" in config  # every replica, by the service's name
    assert "option httpchk GET /healthz" in config and "option forwardfor" in config
    # The hubs trust X-Forwarded-For from the balancer alone, by its fixed address; it drops a client's own.
    assert "http-request del-header X-Forwarded-For" in config
    lb_address = lb["networks"]["default"]["ipv4_address"]
    assert services["hub"]["environment"]["REDPACKET_TRUSTED_PROXIES"] == lb_address
    network = _compose()["networks"]["default"]["ipam"]["config"][0]
    assert ipaddress.ip_address(lb_address) in ipaddress.ip_network(network["subnet"])
    # Outside the range the others are given theirs from: no container (a scaled hub) can take it first.
    assert ipaddress.ip_address(lb_address) not in ipaddress.ip_network(network["ip_range"])


def _flags(command: list[str]) -> dict[str, str]:
    """``--name=value`` flags of a command as a dict (a bare ``--flag`` maps to "")."""
    return {name: value for name, _, value in (f.removeprefix("--").partition("=") for f in command)}


def test_the_galera_variant_is_three_nodes_the_first_bootstrapping_one_copy_at_a_time() -> None:
    compose = _compose()
    services = compose["services"]
    nodes = ["galera-1", "galera-2", "galera-3"]
    for name in nodes:
        s = services[name]
        assert s["profiles"] == ["galera"] and s["image"] == "mariadb:10.11", name
        flags = _flags(s["command"])
        assert flags["wsrep_on"] == "ON" and flags["wsrep_provider"] == "/usr/lib/galera/libgalera_smm.so"
        assert flags["wsrep_cluster_address"] == "gcomm://" + ",".join(nodes)
        assert flags["wsrep_node_name"] == flags["wsrep_node_address"] == name
        # What the ledger needs of Galera, as tests/test_galera_cluster.py runs it.
        assert flags["binlog_format"] == "ROW" and flags["innodb_autoinc_lock_mode"] == "2"
        assert flags["default_storage_engine"] == "InnoDB" and flags["character-set-server"] == "utf8mb4"
        # The copy (SST) by mariabackup (the image has no rsync), logged in by the unix socket: the user
        # the image makes with the grants mariabackup needs, and no password in the file.
        assert flags["wsrep_sst_method"] == "mariabackup" and flags["wsrep_sst_auth"] == "mysql:"
        env = s["environment"]
        assert env["MARIADB_MYSQL_LOCALHOST_USER"] == "1"
        grants = {g.strip() for g in env["MARIADB_MYSQL_LOCALHOST_GRANTS"].split(",")}
        assert grants == {"RELOAD", "PROCESS", "LOCK TABLES", "BINLOG MONITOR"}
        assert (
            env["MARIADB_PASSWORD"].startswith("${MARIADB_PASSWORD:?") and "MARIADB_ROOT_PASSWORD" not in env
        )
        assert s["volumes"] == [f"{name}-data:/var/lib/mysql"] and "ports" not in s
        assert "--galera_online" in s["healthcheck"]["test"] and "--su-mysql" in s["healthcheck"]["test"]
    # Only the first bootstraps; each next waits until the one before is synced (one copy at a time).
    assert [("wsrep-new-cluster" in _flags(services[n]["command"])) for n in nodes] == [True, False, False]
    assert "depends_on" not in services["galera-1"]
    assert services["galera-2"]["depends_on"] == {"galera-1": {"condition": "service_healthy"}}
    assert services["galera-3"]["depends_on"] == {"galera-2": {"condition": "service_healthy"}}
    # The plain server stays the default, the apps' URL untouched; the file and docs/operations.md say how to
    # point the apps at all three nodes.
    assert "profiles" not in services["mariadb"]
    for app in ("hub", "worker"):
        assert "@mariadb:3306/" in services[app]["environment"]["REDPACKET_DATABASE_URL"]
        assert not set(services[app]["depends_on"]) & set(nodes)
    url = "@galera-1:3306,galera-2:3306,galera-3:3306/redpacket"
    assert url in (ROOT / "docker-compose.yml").read_text()
    assert "docker compose --profile galera up" in (ROOT / "docs" / "operations.md").read_text()


def test_the_image_takes_its_base_as_an_argument_runs_unprivileged_and_checks_its_hub() -> None:
    steps = dockerfile_instructions()
    words = [word for word, _ in steps]
    assert steps[0] == ("ARG", "BASE=python:3.11-slim") and steps[1] == ("FROM", "${BASE}")
    # Installed into a virtualenv of its own: Debian's own python3 refuses a `pip install` into itself.
    assert ("RUN", "python3 -m venv /opt/redpacket") in steps and (
        "ENV",
        "PATH=/opt/redpacket/bin:$PATH",
    ) in steps
    assert words.index("USER") < words.index("CMD") and ("USER", "redpacket") in steps
    check = next(rest for word, rest in steps if word == "HEALTHCHECK")
    assert check.endswith('CMD ["redpacket", "serve", "--check"]'), check


def test_the_registry_free_override_swaps_images_only() -> None:
    """deploy/local/compose.yml builds what would be pulled; the stack itself (ports, health checks,
    secrets, the balancer's discovery) stays docker-compose.yml's."""
    local = yaml.safe_load((ROOT / "deploy" / "local" / "compose.yml").read_text())
    services = _compose()["services"]
    for name, change in local["services"].items():
        assert name in services, name
        if name == "grafana":  # (not packaged by Debian: left out unless its profile is asked for)
            assert change == {"profiles": ["grafana"]}
            continue
        assert set(change) <= {"image", "build"}, (name, change)
        build = change["build"]
        assert set(build["args"]) == {"BASE"}
        if name in ("hub", "worker"):
            assert build["context"] == "." and "image" not in change  # redpacket:latest, the Dockerfile
        else:
            assert change["image"].startswith("localhost/redpacket-"), change
            assert (ROOT / build["context"] / build["dockerfile"]).exists(), build
    # Every service the default stack starts with a pulled image is built here instead.
    default = {n for n, s in services.items() if "profiles" not in s and "image" in s and "build" not in s}
    assert default <= set(local["services"]), default - set(local["services"])
