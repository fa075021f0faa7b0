"""Downloads, into a folder (default `.whl/`), the Python 3.12 wheels that a GPU machine without network lacks to run
`make test-gpu`: the versions installed in this checkout's venv, less what such a machine's image already has
(PyTorch and CUDA, transformers and the hub, numpy, grpcio, protobuf, …) and what only development here needs.

    .venv/bin/python tools/gpu_wheels.py [--dest .whl]     (what `make gpu-wheels` runs)
"""

import argparse
import re
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
}  # fmt: skip
# Not needed to run the GPU tests: tools of development here, Parquet data (imported only for .parquet prompts), the
# TLS tests' certificates and the container tests' clients (both skip there), the run report's plots and W&B (the
# launcher's options, imported only when asked for), profilers, the manifests' schema check.
NOT_NEEDED = {"ruff", "grpcio-tools", "hypothesis", "sortedcontainers", "sglang-router", "pyarrow", "truststore",
              "fastapi", "slipstream", "cryptography", "cffi", "pycparser", "docker", "testcontainers",
              "podman-compose", "wandb", "matplotlib", "fonttools", "kiwisolver", "contourpy", "cycler",
              "py-spy", "kubernetes-validate", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
              "importlib-resources"}  # fmt: skip
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
    command = [*download, *target, "-d", args.dest, *wanted()]
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
