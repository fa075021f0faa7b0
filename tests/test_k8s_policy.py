"""deploy/k8s checked as a platform team would before applying it: every rendered object valid for the API of each
Kubernetes version we support (strict: an unknown field is an error), checkov's findings none but those accepted in
deploy/k8s/checkov-accepted.yaml with their reasons, and no secret on a command line or in an env literal."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
# The three newest minor versions, which upstream Kubernetes supports (docs/DEPLOY.md).
SUPPORTED_VERSIONS = ("1.35", "1.36", "1.37")


def _checkov() -> str | None:
    own = Path(sys.prefix) / "checkov" / "bin" / "checkov"  # `make install` puts it in a venv of its own (Makefile)
    return os.environ.get("CHECKOV") or (str(own) if own.is_file() else shutil.which("checkov"))


pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize)")


@pytest.fixture(scope="module", params=["base", "mps"])
def rendered(request, tmp_path_factory) -> str:
    """deploy/k8s as it is, and with its mps component (an overlay that adds it)."""
    folder = K8S
    if request.param == "mps":
        folder = tmp_path_factory.mktemp("overlay")
        base = os.path.relpath(K8S, folder)  # kustomize takes relative paths only
        (folder / "kustomization.yaml").write_text(f"resources: [{base}]\ncomponents: [{base}/mps]\n")
    result = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def objects(rendered) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def name(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def pods(objects) -> dict[str, dict]:
    """Each workload's pod spec, by Kind/name."""
    return {
        name(o): o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")
    }


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_every_object_is_valid_for_the_kubernetes_versions_we_support(objects, version):
    errors = []
    for obj in objects:
        try:
            assert kubernetes_validate.validate(obj, version, strict=True) == version, "no schema of this version"
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{name(obj)} at {'.'.join(map(str, e.absolute_path))}: {e.message}")
    assert not errors, f"Kubernetes {version}:\n" + "\n".join(errors)


def test_the_validation_is_strict(objects):
    """The check above would catch a misspelt field, which the API server would drop without a word."""
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    misspelt = json.loads(json.dumps(deployment))
    misspelt["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {"runAsNonRoot": True}
    with pytest.raises(kubernetes_validate.ValidationError, match="securityContex"):
        kubernetes_validate.validate(misspelt, SUPPORTED_VERSIONS[-1], strict=True)


@pytest.fixture(scope="module")
def checkov_findings(rendered, tmp_path_factory) -> set[tuple[str, str]]:
    """(check, Kind/name) of each check that failed, from one checkov run over the rendered manifests."""
    if (checkov := _checkov()) is None:
        pytest.skip("needs checkov: `make install` puts it in .venv/checkov")
    manifests = tmp_path_factory.mktemp("k8s") / "rendered.yaml"
    manifests.write_text(rendered)
    command = [checkov, "--file", str(manifests), "--framework", "kubernetes", "--output", "json", "--skip-download"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 1), result.stderr  # 1: some check failed
    report = json.loads(result.stdout)
    assert report["summary"]["parsing_errors"] == 0 and report["summary"]["resource_count"] > 0, report["summary"]
    return {(f["check_id"], _kind_name(f["resource"])) for f in report["results"]["failed_checks"]}


def _kind_name(resource: str) -> str:
    kind, _namespace, obj = resource.split(".", 2)  # checkov's Kind.namespace.name
    return f"{kind}/{obj}"


def accepted_findings() -> dict[tuple[str, str], str]:
    entries = yaml.safe_load((K8S / "checkov-accepted.yaml").read_text())
    accepted = {}
    for entry in entries:
        assert len(entry["reason"].split()) >= 10, f"give {entry['checks']} a reason that says why"
        accepted |= {(check, obj): entry["reason"] for check in entry["checks"] for obj in entry["resources"]}
    return accepted


def test_checkov_finds_nothing_but_what_we_accept(checkov_findings):
    accepted = accepted_findings()
    new = sorted(checkov_findings - set(accepted))
    assert not new, f"fix these or list them in deploy/k8s/checkov-accepted.yaml with the reason: {new}"
    stale = sorted(set(accepted) - checkov_findings)
    assert not stale, f"deploy/k8s/checkov-accepted.yaml accepts what checkov no longer finds; remove: {stale}"


SECRET_NAME = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|AUTH", re.IGNORECASE)
SECRET_FLAG = re.compile(r"--[\w-]*(?:password|passwd|requirepass|secret|token|api-key)(?:=|\s+)(\"[^\"]*\"|\S+)")
URL_PASSWORD = re.compile(r"[\w+.-]+://[^/\s@]*:[^/\s@]+@")


def command_lines(container: dict) -> list[str]:
    """The container's command line and its exec probes', as the processes get them (Kubernetes' $$ is a $)."""
    probes = [container.get(p, {}).get("exec", {}).get("command") for p in ("readinessProbe", "livenessProbe")]
    lines = [[*container.get("command", []), *container.get("args", [])], *filter(None, probes)]
    return [" ".join(line).replace("$$", "$") for line in lines]


def test_no_secret_is_on_a_command_line_or_in_an_env_literal(objects):
    """Secrets reach the pods as files of the Secrets' volumes: no command or argument of any container (nor an exec
    probe's) holds a password, a user:password@ URL, or a $(VAR) or $VAR of an env var taken from a Secret (which
    would put the secret on a process's command line), and no env var of a secret's name is a literal."""
    assert not [o for o in objects if o["kind"] == "Secret"], "Secrets are created beside the manifests, not in them"
    secrets_passed = []
    for workload, pod in pods(objects).items():
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            env, where = container.get("env", []), (workload, container["name"])
            assert not container.get("envFrom"), where  # every variable of a Secret, in every child's environment
            from_secrets = {e["name"] for e in env if "secretKeyRef" in e.get("valueFrom", {})}
            assert not [e["name"] for e in env if "value" in e and SECRET_NAME.search(e["name"])], where
            for line in command_lines(container):
                assert not URL_PASSWORD.search(line), (where, line)
                for var in from_secrets:
                    assert not re.search(rf"\$\(?{{?{var}\b", line), (where, var)
                secrets_passed += [(workload, value) for value in SECRET_FLAG.findall(line)]
    # The one exception, and why: SGLang takes its API key only as --api-key, so the engine's shell reads the key's
    # file into that argument (the gateway sends it from --engine-api-key-file). Nothing else is given a secret.
    assert secrets_passed == [("StatefulSet/engine", '"$(cat /etc/slipstream/auth/engine-api-key)"')]


def test_the_namespace_holds_everything_and_admits_no_privileged_pod(objects):
    """The default-deny network policy and Pod Security admission apply to the namespace they are in: slipstream's."""
    (namespace,) = [o for o in objects if o["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/warn"] == "restricted"
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace["metadata"]["name"], name(obj)
