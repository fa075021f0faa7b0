"""Every config file the project ships parses with its service's config model, and compose points at them."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.buffer.config import BufferConfig
from services.common.config import read_config_file, validate_config
from services.reward.config import RewardConfig
from services.rollout.config import RolloutConfig
from services.trainer.config import TrainerConfig

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "deploy" / "compose"
MODELS = {"buffer": BufferConfig, "rollout": RolloutConfig, "reward": RewardConfig, "trainer": TrainerConfig}


@pytest.mark.parametrize("path", sorted((COMPOSE / "config").glob("*.yaml")), ids=lambda p: p.name)
def test_compose_config_parses(path):
    model = MODELS[path.stem]
    config = validate_config(model, read_config_file(path), set(), str(path))
    assert config.metrics_port, "compose publishes a fixed metrics port"


def test_compose_runs_each_service_with_its_config():
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    for name in MODELS:
        service = compose["services"][name]
        command = service["command"]
        assert command[0] == name
        config_path = command[command.index("--config") + 1]
        assert (COMPOSE / "config" / Path(config_path).name).exists()
        port = validate_config(MODELS[name], read_config_file(COMPOSE / "config" / f"{name}.yaml"), set(), None).port
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
