"""The few etcd v3 calls the group needs, over etcd's JSON gateway (etcd3gw).

Why etcd3gw: it is maintained (OpenStack), speaks the gateway every etcd
since 3.4 serves on its client port, and brings no protobuf or grpcio of its
own, so it cannot clash with the versions the daemon's gRPC needs; etcd's
own protos would need gogoproto and the googleapis annotations generated
here. Its watcher is not used: it drops a broken stream silently and cannot
resume from a revision, so ``watch`` below reads the gateway's stream
itself. Every call goes to the first endpoint that answers.
"""

import base64
import json
import logging
import socket
import threading

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import Etcd3Exception

from bubblesnap.service.coordination.keys import prefix_end

log = logging.getLogger("bubblesnap.daemon")

#: etcd's default limit on the operations of one transaction (``--max-txn-ops``).
MAX_TXN_OPS = 128


class EtcdUnavailable(Exception):
    """No endpoint of the etcd cluster answered (or it refused the request)."""


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def parse_endpoints(url: str) -> list[tuple[str, int]]:
    """``etcd://HOST:PORT[,HOST:PORT...]`` -> [(host, port)]; ValueError names what is wrong."""
    if not url.startswith("etcd://"):
        raise ValueError(f"{url!r} is not etcd://HOST:PORT[,HOST:PORT...]")
    endpoints = []
    for part in url[len("etcd://"):].rstrip("/").split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{part!r} in {url!r} is not HOST:PORT")
        endpoints.append((host.strip("[]"), int(port)))
    return endpoints


class EtcdKV:
    """Leases, puts, deletes, ranges and prefix watches against an etcd cluster."""

    def __init__(self, endpoints: list[tuple[str, int]], timeout_seconds: float = 2.0):
        self._clients = [Etcd3Client(host=h, port=p, timeout=timeout_seconds, api_path="/v3/")
                         for h, p in endpoints]
        self._timeout = timeout_seconds
        self._watches: set = set()  # open watch streams, closed by close()
        self._lock = threading.Lock()

    def _post(self, path: str, payload: dict):
        errors = []
        for client in self._clients:
            try:
                return client.post(client.get_url(path), json=payload)
            except (Etcd3Exception, requests.RequestException, ValueError) as err:
                # ValueError: an answer that is not the gateway's JSON (not etcd there)
                errors.append(f"{client.host}:{client.port}: {type(err).__name__}")
        raise EtcdUnavailable("etcd did not answer: " + "; ".join(errors)[:300])

    def grant(self, ttl_seconds: int) -> int:
        return int(self._post("/lease/grant", {"TTL": ttl_seconds, "ID": 0})["ID"])

    def keepalive(self, lease: int) -> int:
        """The lease's new TTL; 0 or less when it expired."""
        answer = self._post("/lease/keepalive", {"ID": lease})
        return int(answer.get("result", {}).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        self._post("/lease/revoke", {"ID": lease})

    def create(self, key: str, value: bytes, lease: int = 0) -> bool:
        """Puts ``key`` only if it does not exist; whether it did."""
        put = {"key": _b64(key), "value": _b64(value), **({"lease": lease} if lease else {})}
        answer = self._post("/kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE",
                         "create_revision": 0}],
            "success": [{"request_put": put}]})
        return bool(answer.get("succeeded"))

    def apply(self, puts: dict[str, bytes], deletes=(), lease: int = 0) -> None:
        """Puts and deletes, in transactions of at most etcd's default 128 operations
        (``--max-txn-ops``); each applies all or none of its own."""
        ops = [{"request_put": {"key": _b64(k), "value": _b64(v),
                                **({"lease": lease} if lease else {})}} for k, v in puts.items()]
        ops += [{"request_delete_range": {"key": _b64(k)}} for k in deletes]
        for start in range(0, len(ops), MAX_TXN_OPS):
            self._post("/kv/txn", {"success": ops[start:start + MAX_TXN_OPS]})

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.apply({key: value}, lease=lease)

    def get(self, key: str) -> bytes | None:
        kvs = self._post("/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def ranges(self, prefixes: list[str]) -> tuple[int, list[dict[str, bytes]]]:
        """The keys under each prefix, each batch of up to 128 read at one revision (one
        request per batch); the oldest revision read."""
        found, revisions = [], []
        for start in range(0, len(prefixes), MAX_TXN_OPS):
            answer = self._post("/kv/txn", {"success": [
                {"request_range": {"key": _b64(p), "range_end": _b64(prefix_end(p))}}
                for p in prefixes[start:start + MAX_TXN_OPS]]})
            revisions.append(int(answer["header"]["revision"]))
            for response in answer.get("responses", []):
                kvs = response.get("response_range", {}).get("kvs", [])
                found.append({_unb64(kv["key"]).decode(): _unb64(kv.get("value", ""))
                              for kv in kvs})
        return min(revisions), found

    def range(self, prefix: str) -> tuple[int, dict[str, bytes]]:
        revision, (found,) = self.ranges([prefix])
        return revision, found

    def watch(self, prefix: str, start_revision: int, on_events, stopped: threading.Event):
        """Streams the changes under ``prefix`` from ``start_revision`` to
        ``on_events([(key, value or None for a delete)], revision)`` until the stream
        breaks or ``stopped`` is set; returns then (the caller re-reads and watches
        again: changes may have been missed, or compacted away)."""
        payload = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                      "start_revision": start_revision}}
        for client in self._clients:
            try:
                response = client.session.post(client.get_url("/watch"), json=payload,
                                               stream=True, timeout=(self._timeout, None))
            except requests.RequestException:
                continue
            with self._lock:
                self._watches.add(response)
            try:
                self._stream(response, on_events, stopped)
            finally:
                with self._lock:
                    self._watches.discard(response)
                response.close()
            return

    def close(self) -> None:
        """Ends every open watch stream (their threads return). The socket is shut
        down, not closed: closing it waits for the lock its reading thread holds."""
        with self._lock:
            open_streams = list(self._watches)
        for response in open_streams:
            try:
                with socket.fromfd(response.raw.fileno(), socket.AF_INET,
                                   socket.SOCK_STREAM) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except (OSError, ValueError, AttributeError):
                pass  # already closed

    @staticmethod
    def _stream(response, on_events, stopped: threading.Event) -> None:
        try:
            for line in response.iter_lines():
                if stopped.is_set():
                    return
                if not line.strip():
                    continue
                result = json.loads(line).get("result", {})
                if result.get("canceled") or result.get("compact_revision"):
                    return
                events = [(_unb64(e["kv"]["key"]).decode(),
                           None if e.get("type") == "DELETE" else _unb64(e["kv"].get("value", "")))
                          for e in result.get("events", [])]
                if events:
                    on_events(events, int(result["header"]["revision"]))
        except (requests.RequestException, ValueError, AttributeError) as err:
            # AttributeError: the stream was closed under the reading thread (close()).
            if not stopped.is_set():
                log.info("etcd watch on %s broke off: %s", response.url,
                         type(err).__name__)
