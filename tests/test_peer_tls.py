"""Peers over TLS with client certificates and a token: replication and restore work,
and a plaintext or certificate-less caller gets nowhere."""

import shutil
import subprocess

import grpc
import pytest

from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.protos import peer_pb2_grpc
from bubblesnap.testing import wait_for
from tests.test_peers import JOB, assert_restores, committed, snapshot_steps

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(directory) -> dict[str, str]:
    """A CA and one certificate for 127.0.0.1 that every test daemon shares."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=directory)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", "host.key", "-out", "host.csr", cwd=directory)
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "host.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", "host.pem",
             cwd=directory)
    return {name: str(directory / name) for name in ("ca.pem", "host.pem", "host.key")}


def test_tls_ring_replicates_restores_and_refuses_plaintext(start_ring, tmp_path):
    certs = make_certificates(tmp_path)
    ring = start_ring(3, "--replicas", "1", "--peer-tls-cert", certs["host.pem"],
                      "--peer-tls-key", certs["host.key"], "--peer-tls-ca", certs["ca.pem"],
                      "--peer-tls-client-auth", env={"BUBBLESNAP_PEER_TOKEN": "tok"})
    snapshot_steps(ring, range(2))
    wait_for(lambda: committed(ring.daemons[0], 1), "step 1 committed over TLS")
    ring.daemons[1].kill()
    assert_restores(ring.replace(1), 1, 1, "peer")  # gRPC and data channel both over TLS

    token = (("authorization", "Bearer tok"),)
    plain = peer_pb2_grpc.PeerStub(grpc.insecure_channel(ring.peers[0]))
    with pytest.raises(grpc.RpcError) as info:
        plain.Holdings(ppb.HoldingsRequest(job=JOB), timeout=5, metadata=token)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with open(certs["ca.pem"], "rb") as f:
        no_client_cert = grpc.ssl_channel_credentials(root_certificates=f.read())
    stub = peer_pb2_grpc.PeerStub(grpc.secure_channel(ring.peers[0], no_client_cert))
    with pytest.raises(grpc.RpcError) as info:
        stub.Holdings(ppb.HoldingsRequest(job=JOB), timeout=5, metadata=token)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
