"""The wire contract: committed stubs are current, and protos/ alone is enough for a client."""

import pathlib
import subprocess
import sys

from grpc_tools import protoc

PROTOS = pathlib.Path(__file__).resolve().parent.parent / "protos"
sys.path.insert(0, str(PROTOS))
import generate  # noqa: E402


def test_committed_stubs_are_not_stale(tmp_path):
    for fresh in generate.generate(tmp_path):
        committed = PROTOS / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed} is stale: run `python protos/generate.py`")


def test_client_from_protos_alone_queries_status_and_health(daemon, tmp_path):
    args = ["protoc", f"-I{PROTOS}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}",
            str(PROTOS / "daemon.proto")]
    assert protoc.main(args) == 0
    script = f"""
import sys
sys.path.insert(0, {str(tmp_path)!r})
import grpc, daemon_pb2, daemon_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
channel = grpc.insecure_channel({daemon.address!r})
status = daemon_pb2_grpc.DaemonStub(channel).Status(daemon_pb2.StatusRequest(), timeout=10)
health = health_pb2_grpc.HealthStub(channel).Check(
    health_pb2.HealthCheckRequest(service="bubblesnap.v1.Daemon"), timeout=10)
assert not any(m.startswith("bubblesnap") for m in sys.modules), "imported bubblesnap"
print(status.memory.budget_bytes, health_pb2.HealthCheckResponse.ServingStatus.Name(health.status))
"""
    out = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    budget, serving = out.stdout.split()
    assert int(budget) > 0 and serving == "SERVING"


def test_reflection_lists_the_service(daemon):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )
    db = ProtoReflectionDescriptorDatabase(daemon.channel)
    assert "bubblesnap.v1.Daemon" in db.get_services()
