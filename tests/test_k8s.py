"""deploy/k8s renders with `kubectl kustomize`, and what it renders holds together: the workloads and their kinds,
probes and resource requests on every container, GPUs for the engines and the trainer, the Redis pod run for real as
the kubelet would run it, every address a command names served by a Service on that port, network policies opening
each port, and every slipstream command line — its run file included — accepted by our parsers (`--check`), SGLang's
by the pinned release's options. tests/test_k8s_policy.py checks the same objects as a platform team would."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.train.tiny_checkpoint import write_tiny_model
from tests.redis_servers import check_redis_password, skip_without_containers

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize)")
SLIPSTREAM = {"buffer", "reward", "rollout", "trainer"}
ADDRESS = re.compile(r"(?:dns:///|http://|redis://|^)([a-z][a-z0-9-]*(?:\.[a-z0-9-]+)?):(\d+)")  # host (pod.svc), port


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    result = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(objects, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def workloads(objects) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")}


def containers(workload: dict) -> dict[str, dict]:
    return {c["name"]: c for c in workload["spec"]["template"]["spec"]["containers"]}


def container(workload: dict) -> dict:
    """The workload's main container: the one named as the workload (the engine's pod also runs its receiver)."""
    return containers(workload)[workload["metadata"]["name"]]


def command_line(workload: dict, c: dict | None = None) -> list[str]:
    """A container's command and arguments as its process gets them: Kubernetes makes $$ a literal $."""
    c = c or container(workload)
    return [part.replace("$$", "$") for part in [*c.get("command", []), *c.get("args", [])]]


def test_the_workloads_and_their_kinds(objects):
    kinds = {name: o["kind"] for name, o in workloads(objects).items()}
    assert kinds == {"redis": "StatefulSet", "buffer": "Deployment", "reward": "Deployment", "rollout": "Deployment",
                     "engine": "StatefulSet", "trainer": "Job"}  # fmt: skip
    assert workloads(objects)["trainer"]["spec"]["completionMode"] == "Indexed"
    assert set(by_kind(objects, "HorizontalPodAutoscaler")) == {"reward"}
    assert set(by_kind(objects, "PodDisruptionBudget")) == {"buffer", "reward", "rollout", "engine"}
    redis = workloads(objects)["redis"]
    assert redis["spec"]["volumeClaimTemplates"] and "--appendonly yes" in " ".join(command_line(redis))


def test_every_container_asks_for_resources_and_the_gpu_ones_for_gpus(objects):
    for name, workload in workloads(objects).items():
        for c in containers(workload).values():
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), (name, c["name"])
            assert "memory" in c["resources"]["limits"], (name, c["name"])
        gpus = container(workload)["resources"].get("limits", {}).get("nvidia.com/gpu")
        claims = container(workload)["resources"].get("claims")
        assert (gpus is not None or claims is not None) == (name in ("engine", "trainer")), name


def test_each_engine_pod_runs_its_weight_receiver_beside_it_on_the_same_gpu(objects):
    """The receiver is a second container of the engine's pod: the same network namespace (it calls the engine at
    127.0.0.1; the gateways find it on the engine's port + --weight-receiver-port-offset), the pod's IPC namespace
    (always shared by a pod's containers) and /dev/shm, one process namespace, and the same GPU: one DRA claim that
    both containers name (the device plugin gives an nvidia.com/gpu to one container only). It runs as the other
    slipstream containers do: non-root, read-only root file system, no capabilities, keys from the Secret's file."""
    engine = workloads(objects)["engine"]
    pod = engine["spec"]["template"]["spec"]
    sglang, receiver = containers(engine)["engine"], containers(engine)["receiver"]
    assert set(containers(engine)) == {"engine", "receiver"} and pod["shareProcessNamespace"] is True
    assert "hostIPC" not in pod and "hostNetwork" not in pod  # the pod's own namespaces, shared by its containers
    (claim,) = pod["resourceClaims"]
    template = by_kind(objects, "ResourceClaimTemplate")[claim["resourceClaimTemplateName"]]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": "gpu.nvidia.com", "count": 1}
    for c in (sglang, receiver):
        assert c["resources"]["claims"] == [{"name": claim["name"]}] and "nvidia.com/gpu" not in str(c["resources"])
    shm = {m["name"] for m in sglang["volumeMounts"] if m["mountPath"] == "/dev/shm"}
    assert shm and shm == {m["name"] for m in receiver["volumeMounts"] if m["mountPath"] == "/dev/shm"}

    args = command_line(engine, receiver)
    gateway = command_line(workloads(objects)["rollout"])
    offset = int(gateway[gateway.index("--weight-receiver-port-offset") + 1])
    engine_port = next(p["containerPort"] for p in sglang["ports"] if p["name"] == "http")
    assert receiver["image"] == "slipstream-torch:latest" and args[0] == "receiver"
    assert args[args.index("--engine-url") + 1] == f"http://127.0.0.1:{engine_port}"
    assert args[args.index("--port") + 1] == str(engine_port + offset) and args[args.index("--host") + 1] == "0.0.0.0"
    assert args[args.index("--device") + 1] == "cuda"
    port = {p["name"]: p["containerPort"] for p in receiver["ports"]}["receiver"]
    assert port == engine_port + offset and receiver["readinessProbe"]["httpGet"]["port"] == "receiver"
    security = receiver["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] == 65534 and security["readOnlyRootFilesystem"]
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {"drop": ["ALL"]}
    key = "/etc/slipstream/auth/engine-api-key"
    assert args[args.index("--engine-api-key-file") + 1] == args[args.index("--api-key-file") + 1] == key


def test_the_mps_component_shares_the_engine_gpu_through_the_dra_driver_as_one_user(objects, tmp_path):
    """deploy/k8s/mps: the engine pod's claim asks NVIDIA's DRA driver for MPS sharing, and the receiver runs as the
    engine's user (MPS serves one user on a GPU at a time); nothing else changes."""
    base = os.path.relpath(K8S, tmp_path)  # kustomize takes relative paths only
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{base}]\ncomponents: [{base}/mps]\n")
    result = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    shared = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    template = by_kind(shared, "ResourceClaimTemplate")["engine-gpu"]["spec"]["spec"]["devices"]
    (config,) = template["config"]
    assert config["requests"] == ["gpu"] and config["opaque"]["driver"] == "gpu.nvidia.com"
    assert config["opaque"]["parameters"]["kind"] == "GpuConfig"
    assert config["opaque"]["parameters"]["sharing"] == {"strategy": "MPS"}
    engine = containers(workloads(shared)["engine"])
    assert engine["receiver"]["securityContext"]["runAsUser"] == 0 and "runAsUser" not in engine["engine"].get(
        "securityContext", {}
    )  # the engine runs as its image's user, root
    assert engine["receiver"]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert _without_mps(shared) == _without_mps(objects)


def _without_mps(objects: list[dict]) -> list[dict]:
    """A copy without what the mps component sets: the claim's config and the receiver's user."""
    objects = json.loads(json.dumps(objects))
    for obj in objects:
        if obj["kind"] == "ResourceClaimTemplate":
            obj["spec"]["spec"]["devices"].pop("config", None)
        if obj["kind"] == "StatefulSet" and obj["metadata"]["name"] == "engine":
            for key in ("runAsUser", "runAsGroup", "runAsNonRoot"):
                containers(obj)["receiver"]["securityContext"].pop(key)
    return objects


def test_services_probe_what_they_serve(objects):
    for name, workload in workloads(objects).items():
        c = container(workload)
        if name == "trainer":  # a Job: its ranks end when the run does
            continue
        for each in containers(workload).values():
            assert "readinessProbe" in each and "livenessProbe" in each, (name, each["name"])
        if name in SLIPSTREAM:
            port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
            assert c["readinessProbe"]["grpc"]["port"] == port and c["livenessProbe"]["grpc"]["port"] == port


def test_the_redis_pod_takes_its_password_from_the_secret_and_shows_it_nowhere(objects, tmp_path):
    """The redis pod run for real in redis:7 containers as the kubelet runs it: its init container, then Redis, each
    with the pod's user and group, a read-only root file system, no capabilities and no privilege escalation, on its
    volumes (host folders; the Secret's file where the pod mounts it). A password with a space, quotes and a backslash
    works, a client without it is refused, no process has it on its command line, and the probes pass."""
    skip_without_containers()
    import docker
    from testcontainers.core.container import DockerContainer

    pod = workloads(objects)["redis"]["spec"]["template"]["spec"]
    (init,), (redis,) = pod["initContainers"], pod["containers"]
    password = 'deploy "secret" pw\\'
    folders = {volume: tmp_path / volume for volume in ("redis-password", "config", "data")}
    for folder in folders.values():
        folder.mkdir()
        folder.chmod(0o777)  # an emptyDir; the data volume, whose files are the pod's fsGroup's
    (folders["redis-password"] / "password").write_text(password + "\n")
    image, options, mounts = as_the_kubelet_runs(pod, init, folders)
    volumes = {host: {"bind": path, "mode": mode} for host, path, mode in mounts}
    docker.from_env().containers.run(image, volumes=volumes, remove=True, **options)
    assert (folders["config"] / "redis.conf").stat().st_mode & 0o777 == 0o600  # only the pod's user reads it
    image, options, mounts = as_the_kubelet_runs(pod, redis, folders)
    container = DockerContainer(image, **options).with_exposed_ports(6379)
    for host, path, mode in mounts:
        container.with_volume_mapping(host, path, mode)
    with container:
        check_redis_password(container, password)
        for probe in ("readinessProbe", "livenessProbe"):
            assert container.exec(redis[probe]["exec"]["command"]).exit_code == 0, probe


def as_the_kubelet_runs(pod: dict, container: dict, folders: dict[str, Path]) -> tuple[str, dict, list]:
    """`container` of `pod` as docker options: its image, command and arguments, the pod's user and groups, its
    security context, and its mounts (host folder, path, mode) of `folders` by volume name."""
    security = pod["securityContext"] | container["securityContext"]
    options = {
        "user": f"{security['runAsUser']}:{security['runAsGroup']}",
        "group_add": [str(security["fsGroup"])],
        "read_only": security["readOnlyRootFilesystem"],
        "cap_drop": security["capabilities"]["drop"],
        "security_opt": ["no-new-privileges"] if security["allowPrivilegeEscalation"] is False else [],
        "command": [arg.replace("$$", "$") for arg in container.get("args", [])],
    }
    if "command" in container:
        options["entrypoint"] = [arg.replace("$$", "$") for arg in container["command"]]
    mounts = [(str(folders[m["name"]]), m["mountPath"], "ro" if m.get("readOnly") else "rw")
              for m in container["volumeMounts"]]  # fmt: skip
    return container["image"], options, mounts


def test_every_address_a_command_names_is_served_on_that_port(objects):
    services, loads = by_kind(objects, "Service"), workloads(objects)
    for name, service in services.items():  # each Service's ports are its workload's
        ports = {p["name"]: p["containerPort"] for c in containers(loads[name]).values() for p in c["ports"]}
        assert service["spec"]["selector"] == loads[name]["spec"]["template"]["metadata"]["labels"] | {}, name
        for port in service["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"], (name, port)
    named = []
    for name, workload in loads.items():
        for arg in command_line(workload):
            for host, port in ADDRESS.findall(arg):
                pod, _, service = host.partition(".")
                target = services[service or pod]
                assert int(port) in {p["port"] for p in target["spec"]["ports"]}, (name, arg)
                if service:  # a pod of a StatefulSet or an indexed Job: its index exists
                    index = int(pod.rsplit("-", 1)[1])
                    spec = loads[service]["spec"]
                    assert index < spec.get("replicas", spec.get("completions", 0)), (name, arg)
                    assert target["spec"]["clusterIP"] == "None", (name, arg)
                named.append((name, host))
    assert {("rollout", "buffer"), ("rollout", "engine"), ("trainer", "rollout"), ("buffer", "redis"),
            ("rollout", "redis"), ("trainer", "redis")} <= set(named)  # fmt: skip


def test_network_policies_deny_by_default_and_open_each_port_to_its_callers(objects):
    policies = by_kind(objects, "NetworkPolicy")
    assert policies["default-deny"]["spec"]["podSelector"] == {}
    opened = {}
    for name, policy in policies.items():
        for rule in policy["spec"].get("ingress", []):
            callers = {peer["podSelector"]["matchLabels"]["app"] for peer in rule["from"]}
            for port in rule.get("ports", [{"port": "any"}]):
                opened.setdefault((name, port["port"]), set()).update(callers)
    assert opened[("buffer", 50051)] == {"rollout", "trainer"}
    assert opened[("reward", 50053)] == {"rollout"} and opened[("rollout", 50052)] == {"trainer", "rollout"}
    assert opened[("redis", 6379)] == {"buffer", "rollout", "trainer"} and opened[("engine", 30000)] == {"rollout"}
    assert opened[("engine", 30001)] == {"rollout"}  # the weight receivers, which the gateways call
    assert opened[("trainer", "any")] == {"trainer", "engine"}  # torchrun, NCCL and the weight group


def test_every_command_line_is_accepted(objects, tmp_path):
    data = tmp_path / "data"
    write_tiny_model(data / "Qwen3-4B")
    (data / "dapo-math-17k.jsonl").write_text('{"prompt": "1 + 1", "label": "2"}\n')
    auth = tmp_path / "auth"
    auth.mkdir()
    (auth / "tokens").write_text("".join(f"{role} {role}-token-0123456789abcdef\n" for role in ("worker", "trainer")))
    (auth / "engine-api-key").write_text("engine-key-0123456789\n")
    (auth / "password").write_text("redis-password\n")
    (flags := tmp_path / "run.flags").write_text(by_kind(objects, "ConfigMap").popitem()[1]["data"]["run.flags"])
    flags.write_text(flags.read_text().replace("/data", str(data)))
    places = {"/etc/slipstream/run.flags": str(flags), "/etc/slipstream/auth": str(auth),
              "/etc/slipstream/redis": str(auth), "/data": str(data), "/checkpoints": str(tmp_path / "checkpoints"),
              "/runs": str(tmp_path / "runs"), "$(NODE_RANK)": "0", "$(POD_IP)": "10.0.0.7"}  # fmt: skip
    for name, workload in workloads(objects).items():
        args = command_line(workload)
        for place, here in places.items():
            args = [a.replace(place, here) for a in args]
        if name == "engine":  # its receiver, a slipstream command too
            receiver = command_line(workload, containers(workload)["receiver"])
            receiver = [a.replace("/etc/slipstream/auth", str(auth)) for a in receiver]
            result = subprocess.run([sys.executable, "-m", "services", *receiver, "--check"], capture_output=True,
                                    text=True, cwd=tmp_path, timeout=120)  # fmt: skip
            assert result.returncode == 0, f"receiver: {result.stderr}"
        if name == "trainer":
            assert args[0] == "torchrun" and args[args.index("--no-python") + 1] == "slipstream"
            args = args[args.index("--no-python") + 2 :]
        if name in SLIPSTREAM:
            result = subprocess.run([sys.executable, "-m", "services", *args, "--check"], capture_output=True,
                                    text=True, cwd=tmp_path, timeout=120)  # fmt: skip
            assert result.returncode == 0, f"{name}: {result.stderr}"
        if name == "engine":
            sglang_options_are_the_releases(args, tmp_path)


def sglang_options_are_the_releases(args: list[str], tmp_path: Path) -> None:
    """The engine's shell command runs for real (with `python3` printing its arguments): every option is one of the
    pinned SGLang release's (services/rollout/sglang_server_args.txt)."""
    listed = (REPO / "services" / "rollout" / "sglang_server_args.txt").read_text().splitlines()
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin"}
    argv = subprocess.run(args, capture_output=True, text=True, check=True, env=env).stdout.split()
    assert argv[:2] == ["-m", "sglang.launch_server"] and "--mem-fraction-static" in argv
    assert argv[argv.index("--api-key") + 1] == "engine-key-0123456789"  # the Secret's file, read by the shell
    unknown = [a for a in argv if a.startswith("--") and a.split("=")[0] not in listed]
    assert not unknown, f"not options of the pinned SGLang: {unknown}"
