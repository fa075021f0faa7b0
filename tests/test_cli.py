"""The `slipstream` command and the four services as real processes: start, serve, report health, stop on SIGTERM."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.common.clients import health_status
from services.train.tiny_checkpoint import write_tiny_model
from slipstream.v1 import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc

REPO = Path(__file__).resolve().parents[1]

SERVICES = {
    "buffer": "slipstream.v1.BufferService",
    "rollout": "slipstream.v1.RolloutService",
    "reward": "slipstream.v1.RewardService",
    "trainer": "slipstream.v1.TrainerService",
}


def run_cli(*args, cwd=None, env=None):
    environ = {**os.environ, **env} if env else None
    return subprocess.run([sys.executable, "-m", "services", *args], capture_output=True, text=True, cwd=cwd,
                          env=environ)  # fmt: skip


def test_help_lists_the_subcommands_without_heavy_imports():
    code = (
        "import sys; from services.train.cli import main; main(['--help']); "
        "heavy = {'grpc', 'torch', 'pydantic', 'megatron'} & set(sys.modules); assert not heavy, heavy"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for command in [*SERVICES, "engine", "receiver", "train", "demo"]:
        assert f"  {command} " in result.stdout
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert listed[:2] == ["train", "demo"]  # what a newcomer runs first, before each service on its own


def test_unknown_command_names_the_closest():
    result = run_cli("trian")
    assert result.returncode == 2
    assert "unknown command 'trian'; did you mean train?" in result.stderr
    assert "choose one of train, demo, buffer" in run_cli("xyzzy").stderr


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_service_process_serves_and_stops_on_sigterm(name, service_process, free_port, wait_serving, tmp_path):
    port = free_port()
    run_folder = ["--output-dir", str(tmp_path / "runs")] if name == "buffer" else []
    if name == "trainer":  # it waits for a buffer that never comes, and stops when told
        run_folder = ["--hf-checkpoint", str(write_tiny_model(tmp_path / "model"))]
    proc = service_process(name, "--host", "127.0.0.1", "--port", str(port), *run_folder)
    address = f"127.0.0.1:{port}"
    wait_serving(address, proc)
    with grpc.insecure_channel(address) as channel:
        assert health_status(channel, SERVICES[name]) == "SERVING"
        assert SERVICES[name] in ProtoReflectionDescriptorDatabase(channel).get_services()
    start = time.monotonic()
    assert proc.terminate(timeout_s=10) == 0, proc.log
    assert time.monotonic() - start < 10
    assert "Traceback" not in proc.log


def test_commands_name_the_extra_they_need_when_it_is_missing():
    for command, extra in (("trainer", "trainer"), ("engine", "engine"), ("receiver", "engine"), ("train", "all")):
        result = subprocess.run([sys.executable, "-m", "tests.no_torch", command, "--help"], capture_output=True,
                                text=True, cwd=REPO)  # fmt: skip
        assert result.returncode == 2
        assert f"slipstream {command} needs the '{extra}' extra (torch" in result.stderr
        assert f"pip install 'slipstream[{extra}]'" in result.stderr


@pytest.mark.timeout(300)
def test_the_buffer_reward_and_rollout_services_run_a_rollout_without_torch(service_process, free_port, wait_serving,
                                                                            tmp_path):  # fmt: skip
    """Packaging by role: the three services import nothing of the trainer's or the engine's extras (they are
    blocked in their processes), and still serve a rollout end to end with a real engine, each reading the run's
    settings from one run file as the service image does in the compose stack."""
    model = write_tiny_model(tmp_path / "model")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Add {i} and 2", "label": str(i + 2)}) + "\n" for i in range(8)))
    ports = {name: free_port() for name in ("buffer", "reward", "rollout", "engine")}
    engine = service_process("engine", "--model-path", str(model), "--port", str(ports["engine"]))
    run_file = tmp_path / "run.flags"
    run_file.write_text(f"--prompt-data {data} --label-key label --hf-checkpoint {model} --num-epoch 1\n"
                        "--rollout-batch-size 4 --n-samples-per-prompt 2 --rm-type math --rollout-max-response-len 8\n"
                        f"--engine-urls http://127.0.0.1:{ports['engine']}\n")  # fmt: skip
    flags = {
        "buffer": ["--output-dir", str(tmp_path), "--max-staleness", "100"],  # no trainer: all under version 0
        "reward": [],
        "rollout": ["--buffer-addr", f"127.0.0.1:{ports['buffer']}", "--reward-addr", f"127.0.0.1:{ports['reward']}"],
    }
    procs = {}
    for name in ("buffer", "reward", "rollout"):
        procs[name] = service_process(name, "--host", "127.0.0.1", "--port", str(ports[name]), "--metrics-port",
                                      "null", f"@{run_file}", *flags[name], module="tests.no_torch")  # fmt: skip
        wait_serving(f"127.0.0.1:{ports[name]}", procs[name], timeout_s=120)
    assert engine.proc.poll() is None
    with grpc.insecure_channel(f"127.0.0.1:{ports['rollout']}") as channel:
        rollout_pb2_grpc.RolloutServiceStub(channel).StartRollout(rollout_pb2.StartRolloutRequest(), timeout=30)
    with grpc.insecure_channel(f"127.0.0.1:{ports['buffer']}") as channel:
        buffer = buffer_pb2_grpc.BufferServiceStub(channel)
        deadline = time.monotonic() + 180
        while buffer.GetState(buffer_pb2.GetStateRequest(), timeout=10).counters["completed"] < 8:
            assert time.monotonic() < deadline, procs["rollout"].log[-3000:]
            time.sleep(0.2)
    for proc in procs.values():
        assert "blocked: not installed" not in proc.log and "Traceback" not in proc.log, proc.log[-3000:]


def test_every_command_checks_its_settings_without_starting(tmp_path):
    """`--check`: what a container's command line is validated with before a deployment starts it."""
    model = write_tiny_model(tmp_path / "model")
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1 + 1", "label": "2"}\n')
    commands = {
        "buffer": ["--prompt-data", str(data), "--hf-checkpoint", str(model), "--output-dir", str(tmp_path / "runs")],
        "reward": ["--rm-type", "math"],
        "rollout": ["--engine-urls", "http://engine-0:30000"],
        "trainer": ["--hf-checkpoint", str(model)],
        "engine": ["--model-path", str(model)],
        "train": ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--output-dir", str(tmp_path / "runs")],
    }
    for command, args in commands.items():
        result = run_cli(command, *args, "--check", cwd=tmp_path)
        assert result.returncode == 0 and f"slipstream {command}: the settings are valid" in result.stdout, (
            result.stderr
        )
        bad = run_cli(command, *args, "--port", "-1", "--check", cwd=tmp_path)
        assert bad.returncode == 2 and "port" in bad.stderr, bad.stderr
    assert not (tmp_path / "runs").exists()  # nothing started


def test_one_run_file_configures_every_container(tmp_path):
    """`@run.flags`: `slipstream train`'s flags in slime's names; each service takes what `slipstream train` would
    give it, the reference engine its `--sglang-*` options."""
    model = write_tiny_model(tmp_path / "model")
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1 + 1", "label": "2"}\n')
    run_file = tmp_path / "run.flags"
    run_file.write_text(f"""# the run
--hf-checkpoint {model} --prompt-data {data}
--rollout-batch-size 4 --n-samples-per-prompt 8 --global-batch-size 32
--rm-type exact --async-buffer-size 1   # one step of overlap
--sglang-max-running-requests 16
""")
    buffer = run_cli("buffer", f"@{run_file}", "--print-config", cwd=tmp_path)
    assert buffer.returncode == 0, buffer.stderr
    assert "rollout_batch_size: 4" in buffer.stdout and "max_staleness: 1" in buffer.stdout
    reward = run_cli("reward", f"@{run_file}", "--print-config", cwd=tmp_path)
    assert "rm_type: exact" in reward.stdout
    engine = run_cli("engine", f"@{run_file}", "--model-path", str(model), "--print-config", cwd=tmp_path)
    assert "max_running_requests: 16" in engine.stdout, engine.stderr
    assert run_cli("train", f"@{run_file}", "--check", cwd=tmp_path).returncode == 0
    missing = run_cli("buffer", "@/nowhere/run.flags", cwd=tmp_path)
    assert missing.returncode == 2 and "@/nowhere/run.flags: cannot read the run file" in missing.stderr


def test_busy_port_is_one_sentence(service_process, free_port, wait_serving):
    port = free_port()
    first = service_process("reward", "--host", "127.0.0.1", "--port", str(port))
    wait_serving(f"127.0.0.1:{port}", first)
    second = service_process("rollout", "--host", "127.0.0.1", "--port", str(port))
    assert second.wait() == 1
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in second.log
    assert "Traceback" not in second.log


def test_unreachable_redis_is_one_sentence(tmp_path):
    result = run_cli("buffer", "--port", "0", "--redis-url", "redis://127.0.0.1:1", "--redis-connect-timeout-s", "1")
    assert result.returncode == 1
    assert "cannot reach Redis at redis://127.0.0.1:1" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "abc"], "--port: Input should be a valid integer"),
        (["--prot", "1"], "unknown option --prot; did you mean --port?"),
        (["--config", "missing.yaml"], "config file missing.yaml does not exist"),
    ],
)
def test_bad_settings_are_one_sentence(args, message, tmp_path):
    result = run_cli("reward", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_config_key_is_one_sentence(tmp_path):
    (tmp_path / "run.yaml").write_text("prot: 1\n")
    result = run_cli("trainer", "--config", "run.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().startswith(
        'slipstream trainer: error: run.yaml: prot: unknown setting; did you mean "port"? (valid here: host, port, '
        "grace_period_s, max_message_mb,"
    )
    assert len(result.stderr.strip().splitlines()) == 1


def test_train_checks_slimes_batch_constraint_before_starting_anything(tmp_path):
    result = run_cli("train", "--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rollout-batch-size", "4",
                     "--n-samples-per-prompt", "8", "--global-batch-size", "30", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2
    assert "global_batch_size" in result.stderr or "global-batch-size" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_train_checks_the_batch_with_the_trainers_data_parallel_size_before_starting_anything(tmp_path):
    """Two ranks split a step's 32 samples into 16 each, which micro-batches of 32 cannot divide: said before any
    service starts, not by a rank under torchrun once everything runs."""
    result = run_cli("train", "--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--rollout-batch-size", "4",
                     "--n-samples-per-prompt", "8", "--global-batch-size", "32", "--micro-batch-size", "32",
                     "--actor-num-gpus-per-node", "2", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 2
    said = (
        "each rank's part of a step (16 samples = global_batch_size 32 / 2 ranks) is not divisible by micro_batch_size"
    )
    assert f"{said} 32 (the trainer's 2 rank(s) make a data-parallel size of 2)" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_train_checks_the_model_folder_and_the_data_before_starting_anything(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    cases = [(["--hf-checkpoint", "/nowhere/model", "--prompt-data", "p.jsonl"],
              "--hf-checkpoint /nowhere/model: no such folder; pass the folder of an HF checkpoint"),
             (["--hf-checkpoint", str(tmp_path), "--prompt-data", "p.jsonl"],
              f"--hf-checkpoint {tmp_path} has no config.json"),
             (["--hf-checkpoint", "model/typo", "--prompt-data", "p.jsonl"],  # org/name, but under a folder here
              "--hf-checkpoint model/typo: no such folder; pass the folder of an HF checkpoint (config.json, the "
              "weights and the tokenizer), or a Hub id (org/name), which needs the network"),
             (["--hf-checkpoint", str(model), "--prompt-data", "p.jsonl@[0:10]"],
              "--prompt-data p.jsonl@[0:10]: dataset p.jsonl does not exist; pass a .jsonl or .parquet file, a glob of "
              "them, or a folder written by datasets' save_to_disk")]  # fmt: skip
    for args, said in cases:
        result = run_cli("train", *args, cwd=tmp_path)
        assert result.returncode == 2 and said in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()
    (tmp_path / "p.jsonl").write_text('{"prompt": "1 + 1?", "label": "2"}\n')


def test_a_hub_id_is_taken_from_the_cache_and_refused_at_once_without_a_network(tmp_path):
    """A Hub id stays one (transformers fetches it at the start) where it is cached or the Hub answers; here, with
    no network, one not cached is refused in a sentence within seconds, not after a minute of loading."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "1 + 1?", "label": "2"}\n')
    hub_id, cache = "someorg/somemodel", tmp_path / "hf-cache"
    args = ["--hf-checkpoint", hub_id, "--prompt-data", "p.jsonl", "--check"]
    result = run_cli(
        "train", *args, cwd=tmp_path, env={"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://hub.invalid"}
    )
    said = (f"--hf-checkpoint {hub_id}: no such folder, and as a Hub id it is not in this machine's Hugging Face "
            "cache and hub.invalid cannot be reached from here")  # fmt: skip
    assert result.returncode == 2 and said in result.stderr, result.stderr
    snapshot = cache / "models--someorg--somemodel" / "snapshots" / "abc"  # huggingface_hub's layout
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--someorg--somemodel" / "refs").mkdir()
    (cache / "models--someorg--somemodel" / "refs" / "main").write_text("abc")
    result = run_cli(
        "train", *args, cwd=tmp_path, env={"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://hub.invalid"}
    )
    assert result.returncode == 0, result.stderr


FIRST_MISTAKES = {  # a new user's, each with the sentence that refuses it
    "rm-type": (["--rm-type", "exactt"], "--rm-type 'exactt' is unknown; did you mean exact?"),
    "missing-reward": (["--custom-rm-path", "nowhere.py:score"], "--custom-rm-path: file nowhere.py does not exist"),
    "reward-import": (["--custom-rm-path", "imports.py:score"],
                      "loading imports.py raised ModuleNotFoundError: No module named 'no_such_package'"),
    "reward-signature": (["--custom-rm-path", "one.py:score"], "score(sample) cannot be called as fn(args, sample)"),
    "bad-row": (["--prompt-data", "bad.jsonl"], "--prompt-data: bad.jsonl line 6: not valid JSON"),
    "label-key": (["--label-key", "label"],
                  'p.jsonl line 1: field "label" missing (keys present: answer, prompt); pass --label-key'),
}  # fmt: skip


def _first_run_folder(tmp_path: Path) -> list[str]:
    """A model, prompts, and the files of the mistakes above; the flags of a good run of them."""
    model = write_tiny_model(tmp_path / "model")
    rows = [json.dumps({"prompt": f"{i} + 1?", "answer": str(i + 1)}) for i in range(8)]
    (tmp_path / "p.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "bad.jsonl").write_text("\n".join([*rows[:5], '{"prompt": "5 + 1?" "answer": "6"}', *rows[6:]]))
    (tmp_path / "imports.py").write_text("import no_such_package\n\ndef score(args, sample):\n    return 1.0\n")
    (tmp_path / "one.py").write_text("def score(sample):\n    return 1.0\n")
    return ["--hf-checkpoint", str(model), "--prompt-data", "p.jsonl", "--label-key", "answer"]


@pytest.mark.parametrize("mistake", list(FIRST_MISTAKES))
def test_train_refuses_a_first_mistake_before_starting_anything(mistake, tmp_path):
    """Each service's own start-up checks, run by the launcher before any service starts: one sentence."""
    args, said = FIRST_MISTAKES[mistake]
    result = run_cli("train", *_first_run_folder(tmp_path), *args, cwd=tmp_path)
    assert result.returncode == 2 and said in result.stderr.splitlines()[-1], result.stderr
    assert not (tmp_path / "runs").exists()  # nothing started


def test_train_check_runs_the_same_checks(tmp_path):
    base = _first_run_folder(tmp_path)
    checked = run_cli("train", *base, "--rm-type", "exactt", "--check", cwd=tmp_path)
    assert checked.returncode == 2 and "did you mean exact?" in checked.stderr
    assert run_cli("train", *base, "--rm-type", "exact", "--check", cwd=tmp_path).returncode == 0


def test_a_gateway_applies_the_run_rules_wherever_it_loads_its_config(tmp_path):
    """Delta sync needs a weight receiver beside each engine: a gateway that starts its engines starts them (offset
    1), one given running engines says what to add, the same sentence from `slipstream train` and from the gateway's
    own config file (as compose and k8s start it)."""
    from services.common.config import ConfigError, load_config
    from services.rollout.config import RolloutConfig, needs_receivers

    launching = load_config(RolloutConfig, ["--update-weight-mode", "delta", "--rollout-num-gpus", "1",
                                            "--hf-checkpoint", str(tmp_path)], "slipstream rollout")  # fmt: skip
    assert launching.weight_receiver_port_offset == 1
    assert load_config(RolloutConfig, ["--rollout-num-gpus", "1", "--hf-checkpoint", str(tmp_path)],
                       "slipstream rollout").weight_receiver_port_offset is None  # fmt: skip
    refusal = needs_receivers("--update-weight-mode delta")
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        load_config(RolloutConfig, ["--update-weight-mode", "delta", "--engine-urls", "http://engine:30000"], "x")
    config = tmp_path / "rollout.yaml"
    config.write_text(yaml.safe_dump({"update_weight_mode": "delta", "engine_urls": ["http://engine:30000"]}))
    gateway = run_cli("rollout", "--config", str(config), "--check")
    train = run_cli("train", "--check", "--update-weight-mode", "delta", "--engine-urls", "http://engine:30000",
                    "--hf-checkpoint", str(tmp_path), "--prompt-data", str(config))  # fmt: skip
    for process in (gateway, train):
        assert process.returncode == 2 and refusal in process.stderr, process.stderr


def test_train_names_the_closest_option(tmp_path):
    result = run_cli("train", "--rollout-batch-sise", "4", cwd=tmp_path)
    assert result.returncode == 2
    assert "unknown option --rollout-batch-sise; did you mean --rollout-batch-size?" in result.stderr


def test_train_joining_a_buffer_checks_its_redis_first(tmp_path, free_port):
    """A job that joins running services (compose) and is given the buffer's Redis says what is wrong with it in one
    sentence, rather than waiting for a buffer that cannot start."""
    model = write_tiny_model(tmp_path / "model")
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    result = run_cli("train", "--hf-checkpoint", str(model), "--buffer-addr", "127.0.0.1:1", "--redis-url", url,
                     "--rollout-addr", "127.0.0.1:1", "--reward-addr", "127.0.0.1:1", cwd=tmp_path)  # fmt: skip
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "cannot reach Redis at redis://:***@127.0.0.1:" in last and "fix --redis-url" in last, result.stderr
    assert "secret" not in result.stderr


def test_train_takes_slimes_moe_flags():
    """slime's MoE model arguments (scripts/models/qwen3-30B-A3B.sh, deepseek-v3.sh): the shape flags are read from
    config.json instead (a warning each), expert parallelism and the routers' loss go to the trainer, and a router
    bias update, which would route the trainer away from the engines, stops the launch naming why."""
    from services.train.options import ConfigError, route

    slime = ["--num-experts", "128", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "768", "--moe-grouped-gemm",
             "--moe-token-dispatcher-type", "alltoall", "--multi-latent-attention", "--kv-lora-rank", "512",
             "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0", "--moe-layer-freq", "1",
             "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--moe-aux-loss-coeff", "0.001",
             "--moe-router-load-balancing-type", "seq_aux_loss"]  # fmt: skip
    trainer = route(slime)["trainer"]
    assert trainer == ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                       "--moe-aux-loss-coeff", "0.001", "--moe-router-load-balancing-type", "seq_aux_loss"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"--moe-router-bias-update-rate 0\.001: only 0 is supported"):
        route(["--moe-router-bias-update-rate", "0.001"])


def test_print_config_shows_no_password(tmp_path):
    """`--print-config` of each service, given a password in every setting that names a URL or an address (user:PW@
    with or without a scheme, in lists, in query parameters, in a reward function's settings) and the engines' API
    key: the password is nowhere in what it prints, and every such setting shows that it had one. (The W&B run
    config, which `slipstream train` logs, is the same redaction: tests/common/test_config.py.)"""
    model = write_tiny_model(tmp_path / "model")
    pw = "pw-0123456789abcdef"
    at = f"user:{pw}@"
    commands = {
        "buffer": ["--redis-url", f"redis://{at}redis:6379/0", "--output-dir", str(tmp_path / "runs"),
                   "--buffer-addr", f"{at}buffer:50051"],  # a run fact: every service takes it
        "reward": ["--rm-url", f"https://{at}rm.example/score?api_key={pw}", "--rm-grpc-addr", f"{at}rm:50053",
                   "--custom-rm-args", json.dumps({"judge": f"http://{at}judge:8000", "password": pw}),
                   "--buffer-addr", f"{at}buffer:50051"],
        "rollout": ["--engine-urls", f"http://{at}engine-0:30000", f"http://:{pw}@engine-1:30000",
                    "--redis-url", f"unix:///run/redis.sock?db=0&password={pw}", "--port", "50052",
                    "--advertise-addr", f"{at}10.0.0.7:50052", "--sglang-api-key", pw,
                    "--buffer-addr", f"{at}buffer:50051", "--reward-addr", f"{at}reward:50053"],
        "trainer": ["--hf-checkpoint", str(model), "--redis-url", f"rediss://:{pw}@redis:6380/0",
                    "--buffer-addr", f"{at}buffer:50051", "--rollout-addr", f"{at}rollout:50052"],
        "engine": ["--model-path", str(model), "--api-key", pw],
    }  # fmt: skip
    for command, args in commands.items():
        result = run_cli(command, *args, "--print-config", cwd=tmp_path)
        assert result.returncode == 0, (command, result.stderr)
        assert pw not in result.stdout + result.stderr, (command, result.stdout)
        settings = _flattened(yaml.safe_load(result.stdout))
        named = {k: v for k, v in settings.items() if re.search(r"(url|urls|addr|api_key)$", k) and v}
        assert named and all("***" in str(v) for v in named.values()), (command, named)


def _flattened(settings: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in settings.items():
        flat |= _flattened(value, f"{prefix}{key}_") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return flat


def test_train_routes_the_loss_settings_to_the_trainer():
    """The trainer's loss settings are one group in its config, and slime's flat flags still reach it."""
    from services.train.options import route
    from services.trainer.config import TrainerConfig

    argv = ["--eps-clip", "0.3", "--eps-clip-high", "0.28", "--use-kl-loss", "--kl-loss-coef", "0.01"]
    trainer = route(argv)["trainer"]
    assert trainer == argv
    assert TrainerConfig.model_validate({"eps_clip": 0.3}).loss.eps_clip == 0.3


def test_a_flag_two_models_declare_is_refused_before_any_run():
    """Routing goes by each flag's owner: a new field named as another model's would silently change where that flag
    goes; it is refused when the table is built, naming both models."""
    from services.common.config import StrictModel
    from services.train.options import takers

    class Buffer(StrictModel):
        lr: float = 1.0

    class Trainer(StrictModel):
        lr: float = 2.0

    with pytest.raises(TypeError, match="--lr is declared by Buffer and Trainer: a setting has one owner"):
        takers({"buffer": Buffer, "trainer": Trainer})
    assert takers({"buffer": Buffer})["--lr"] == ["buffer"]


def test_train_refuses_at_once_an_address_to_join_where_no_service_answers(tmp_path, free_port):
    """A running service to join that is not there: `--check` says so (no connection), and a start stops after the
    few seconds a running service takes to answer its health check, before it starts anything, naming the flag. A
    name that does not resolve here (a deployment's, checked before its services run) is reported, not refused."""
    model = write_tiny_model(tmp_path / "model")
    (tmp_path / "p.jsonl").write_text('{"prompt": "1 + 1?", "label": "2"}\n')
    address = f"127.0.0.1:{free_port()}"
    args = ["--hf-checkpoint", str(model), "--prompt-data", "p.jsonl", "--buffer-addr", address]
    checked = run_cli("train", *args, "--check", cwd=tmp_path)
    said = f"--buffer-addr {address}: no buffer service there (Connection refused); start it there, or drop"
    assert checked.returncode == 2 and said in checked.stderr, checked.stderr
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes connections, answers nothing (a hung service)
        hung = f"127.0.0.1:{silent.getsockname()[1]}"
        checked = run_cli("train", *args[:4], "--buffer-addr", hung, "--check", cwd=tmp_path)
    said = f"--buffer-addr {hung}: something takes connections there, but no buffer service answers its health check"
    assert checked.returncode == 2 and said in checked.stderr, checked.stderr
    named = run_cli("train", *args[:4], "--buffer-addr", "buffer.invalid:50051", "--check", cwd=tmp_path)
    assert named.returncode == 0 and "buffer.invalid does not resolve here, so it is not checked" in named.stderr
    started = run_cli("train", *args, cwd=tmp_path)
    said = f"gave up waiting for the buffer service at {address} (--buffer-addr) to serve after 5 s"
    assert started.returncode == 1 and said in started.stderr, started.stderr
    assert not list((tmp_path / "runs" / "default" / "logs").glob("*.log"))  # nothing was started


def test_a_slime_flag_refused_here_says_why_as_docs_arguments_does():
    """A newcomer's slime flag we refuse is named as refused with the reason docs/ARGUMENTS.md gives, not as an
    unknown flag with the closest name's hint (`--offload` → "did you mean --load?")."""
    from services.common.config import ConfigError
    from services.train.options import SERVICES, TrainOptions, route, takers
    from services.train.refused import REFUSED

    documented = {}
    for line in (Path(__file__).parents[1] / "docs" / "ARGUMENTS.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[2] == "refused":
            reason = re.sub(r"\[([^\]]+)\]\([^)]+\)", r"docs/\1", cells[3].replace("`", ""))
            documented |= {
                f: reason for f in re.findall(r"`(--[a-z0-9-]+)`", cells[0]) if not f.startswith("--sglang-")
            }
    assert documented == REFUSED
    assert not set(REFUSED) & set(takers({**SERVICES, "train": TrainOptions}))  # none is a flag we take
    for flag in ("--offload", "--optimizer-cpu-offload"):
        with pytest.raises(ConfigError) as refused:
            route([flag])
        assert str(refused.value) == f"{flag} (slime's) is not taken here: {REFUSED[flag]} (docs/ARGUMENTS.md)"
        assert "did you mean" not in str(refused.value)


def test_check_reads_every_row_of_the_data_and_says_how_many(tmp_path, monkeypatch, caplog):
    """A bad row far into the file is found before any service starts, by its line, across the blocks the file is
    read in; a good file's row count is said."""
    import logging

    from services.buffer import preflight
    from services.buffer.config import BufferConfig
    from services.common.config import ConfigError

    monkeypatch.setattr(preflight, "BLOCK_BYTES", 4096)  # many blocks
    rows = [json.dumps({"prompt": f"{i} + 1?", "label": str(i + 1)}) for i in range(12_000)]
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(rows) + "\n")
    with caplog.at_level(logging.INFO, logger=preflight.__name__):
        preflight.check(BufferConfig(prompt_data=str(good), label_key="label", hf_checkpoint=str(tmp_path)))
    assert f"--prompt-data {good}: 12000 rows, each valid" in caplog.text
    rows[9_999] = '{"prompt": "9999 + 1?" "label": "10000"}'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows) + "\n")
    with pytest.raises(ConfigError, match=re.escape("--prompt-data: bad.jsonl line 10000: not valid JSON")):
        preflight.check(BufferConfig(prompt_data=str(bad), label_key="label", hf_checkpoint=str(tmp_path)))


def test_the_engine_says_its_name_for_the_model_and_a_port_in_use_before_it_loads(tmp_path):
    """`slipstream engine --hf-checkpoint` (slime's name) names the engine's flag; a port in use is refused in one
    sentence before the model loads, not as uvicorn's [Errno 98] once it has."""
    import socket

    result = run_cli("engine", "--hf-checkpoint", str(tmp_path))
    assert result.returncode == 2 and "unknown option --hf-checkpoint; slipstream engine's is --model-path" in (
        result.stderr
    ), result.stderr
    model = write_tiny_model(tmp_path / "model")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_cli("engine", "--model-path", str(model), "--port", str(port))
    said = f"cannot listen on 127.0.0.1:{port} (Address already in use): pass --port with a free port"
    assert result.returncode == 1 and said in result.stderr, result.stderr
    assert "loaded" not in result.stderr.lower()


def test_train_takes_a_saved_datasets_folder_and_a_glob_and_scans_every_row(tmp_path):
    import datasets

    model = write_tiny_model(tmp_path / "model")
    rows = [{"prompt": f"{i} + 1?", "label": str(i + 1)} for i in range(12)]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "saved", num_shards=2)
    (tmp_path / "parts").mkdir()
    for i in range(3):
        (tmp_path / "parts" / f"{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4 * i : 4 * i + 4]))
    for data in ("saved", "parts/*.jsonl"):
        result = run_cli("train", "--hf-checkpoint", str(model), "--prompt-data", data, "--check", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert f"--prompt-data {data}: 12 rows, each valid" in result.stdout + result.stderr
    (tmp_path / "parts" / "3.jsonl").write_text('{"prompt": "x"\n')
    result = run_cli("train", "--hf-checkpoint", str(model), "--prompt-data", "parts/*.jsonl", cwd=tmp_path)
    assert result.returncode == 2 and "--prompt-data: 3.jsonl line 1: not valid JSON" in result.stderr, result.stderr
