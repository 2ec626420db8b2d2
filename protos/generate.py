"""Regenerates the Python stubs committed next to the .proto files.

Run ``python protos/generate.py`` after editing a .proto file;
``tests/test_protos.py`` fails while the committed stubs are stale.

The .proto files are compiled as ``bubblesnap/protos/<name>.proto`` so the
generated modules import each other as ``bubblesnap.protos.<name>_pb2``.
"""

import pathlib
import shutil
import sys
import tempfile

from grpc_tools import protoc

PROTO_DIR = pathlib.Path(__file__).resolve().parent
PROTO_FILES = ("daemon.proto", "peer.proto")


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compiles every .proto into ``out_dir``; returns the generated files."""
    generated = []
    with tempfile.TemporaryDirectory() as tmp:
        package_dir = pathlib.Path(tmp, "bubblesnap", "protos")
        package_dir.mkdir(parents=True)
        for name in PROTO_FILES:
            shutil.copy(PROTO_DIR / name, package_dir / name)
            args = ["protoc", f"-I{tmp}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                    f"--grpc_python_out={tmp}", str(package_dir / name)]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {name}")
        for path in sorted(package_dir.glob("*_pb2*.py*")):
            target = out_dir / path.name
            shutil.copy(path, target)
            generated.append(target)
    return generated


if __name__ == "__main__":
    for path in generate(PROTO_DIR):
        print(f"wrote {path}", file=sys.stderr)
