"""Every run file the project ships configures every service, and compose's health checks probe the right ports."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.config import load_config
from services.reward.config import RewardConfig

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "deploy" / "compose"


@pytest.mark.parametrize("path", sorted(COMPOSE.glob("*.flags")), ids=lambda p: p.name)
def test_compose_run_files_route_to_every_service(path):
    """A run file gives every service a valid config (tests/test_deploy.py checks each container's whole command)."""
    from services.train.options import SERVICES, route
    from services.train.runfile import read

    routed = route(read(path))
    for name, model in SERVICES.items():
        load_config(model, routed[name], prog=name)


def test_compose_health_checks_probe_each_services_port():
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    for name in ("buffer", "reward", "rollout"):
        service = compose["services"][name]
        command = service["command"]
        assert command[0] == name
        port = command[command.index("--port") + 1]
        assert f"localhost:{port}" in service["healthcheck"]["test"]


def test_health_probe_command(grpc_service):
    from services.reward.server import build

    running = grpc_service(build, RewardConfig())
    probe = [sys.executable, "-m", "services.common.clients"]
    assert subprocess.run([*probe, running.address], capture_output=True).returncode == 0
    running.stop()
    failed = subprocess.run([*probe, running.address, "1"], capture_output=True, text=True)
    assert failed.returncode == 1
    assert "did not report SERVING" in failed.stderr
