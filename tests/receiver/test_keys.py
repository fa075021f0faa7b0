"""The weight receiver reads its keys from files (as a Kubernetes pod gets them from a Secret): its routes but /health
refuse a caller without the key, and a missing or empty key file stops it with a sentence."""

import httpx
import pytest

from services.common.config import ConfigError, load_config
from services.receiver.config import ReceiverConfig
from tests.rollout.conftest import wait_healthy


def test_the_api_key_file_guards_every_route_but_health(service_process, free_port, tmp_path):
    (key := tmp_path / "engine-api-key").write_text("k3y-0123456789\n")
    port = free_port()
    proc = service_process("receiver", "--engine-url", "http://127.0.0.1:1", "--port", str(port),
                           "--api-key-file", str(key), "--engine-api-key-file", str(key))  # fmt: skip
    url = wait_healthy(proc, f"http://127.0.0.1:{port}")
    body = {"group_name": "none"}
    assert httpx.post(f"{url}/destroy_weights_update_group", json=body).status_code == 401
    authorized = {"Authorization": "Bearer k3y-0123456789"}
    answer = httpx.post(f"{url}/destroy_weights_update_group", json=body, headers=authorized)
    assert answer.status_code != 401 and "does not exist" in answer.text


def test_a_missing_or_empty_key_file_is_named(tmp_path):
    (empty := tmp_path / "empty").write_text("\n")
    for path, says in ((tmp_path / "missing", "No such file or directory"), (empty, "is empty; write the key in it")):
        with pytest.raises(ConfigError) as e:
            load_config(ReceiverConfig, ["--engine-url", "http://x:1", "--engine-api-key-file", str(path)], "receiver")
        assert f"--engine-api-key-file {path}" in str(e.value) and says in str(e.value)


def test_an_engine_url_that_is_not_an_http_url_is_named():
    for url in ("127.0.0.1:30000", "tcp://127.0.0.1:30000", "http://", "http://127.0.0.1:99999"):
        with pytest.raises(ConfigError) as e:
            load_config(ReceiverConfig, ["--engine-url", url], "receiver")
        assert "engine_url" in str(e.value) or "--engine-url" in str(e.value), str(e.value)
