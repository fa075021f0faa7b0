"""Regenerates the Python stubs (messages, `.pyi` type stubs, gRPC) from `protos/slipstream/v1/*.proto`.

`make protos` runs this; a test runs it into a temporary folder and fails when the committed stubs differ.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / "slipstream" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Writes `slipstream/v1/*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` under `out_dir`; returns the written files."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    sources = [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{well_known}", f"--python_out={out_dir}", f"--pyi_out={out_dir}"]
    args += [f"--grpc_python_out={out_dir}", *sources]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    return sorted((out_dir / "slipstream" / "v1").glob("*_pb2*"))


if __name__ == "__main__":
    for path in generate(ROOT):
        print(path.relative_to(ROOT))
    sys.exit(0)
