"""The client's end of the Bubbles stream: events go out, plans come back, nobody waits.

One long-lived bidirectional stream per rank. Sending is a queue put; the
daemon's answers (a new plan for the rank) are picked up by a thread and kept
as :attr:`BubbleStream.latest`, which the snapshotter reads at its next
bubble. A failed stream is reopened by a later send, at most once per
``retry_seconds``; events sent while it is down are dropped.
"""

import logging
import queue
import threading
import time

import grpc

from bubblesnap.protos import daemon_pb2 as pb

log = logging.getLogger("bubblesnap.client")
_CLOSE = object()


class BubbleStream:
    """Sends bubble events over one stream and keeps the latest plan received."""

    def __init__(self, stub, retry_seconds: float = 10.0):
        self._stub = stub
        self._retry_seconds = retry_seconds
        self._requests: queue.SimpleQueue | None = None
        self._down_until = 0.0
        self.latest: pb.FetchPlan | None = None

    def send(self, event: pb.BubbleEvent) -> None:
        """Queues ``event``; never blocks and never raises."""
        requests = self._requests
        if requests is None:
            if time.monotonic() < self._down_until:
                return
            requests = self._requests = queue.SimpleQueue()
            call = self._stub.Bubbles(iter(requests.get, _CLOSE))
            threading.Thread(target=self._pump, args=(call, requests), daemon=True,
                             name="bubble-plans").start()
        requests.put(event)

    def _pump(self, call, requests) -> None:
        try:
            for plan in call:
                self.latest = plan
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                log.warning("bubble stream failed (%s: %s); no bubble plans for %.0f s",
                            err.code().name, err.details(), self._retry_seconds)
            self._down_until = time.monotonic() + self._retry_seconds
            if self._requests is requests:
                self._requests = None

    def close(self) -> None:
        requests, self._requests = self._requests, None
        if requests is not None:
            requests.put(_CLOSE)
