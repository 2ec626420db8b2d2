"""The client's end of the Bubbles stream: events go out, plans come back, nobody waits.

One long-lived bidirectional stream per rank. Sending is a queue put; the
daemon's answers (a new plan for the rank) are picked up by a thread and kept
as :attr:`BubbleStream.latest`, which the snapshotter reads at its next
bubble. A failed stream is reopened on the next send.
"""

import queue
import threading

import grpc
from bubblesnap.protos import daemon_pb2 as pb

_CLOSE = object()


class BubbleStream:
    """Sends bubble events over one stream and keeps the latest plan received."""

    def __init__(self, stub):
        self._stub = stub
        self._requests: queue.SimpleQueue | None = None
        self.latest: pb.FetchPlan | None = None
        self.error: grpc.RpcError | None = None

    def send(self, event: pb.BubbleEvent) -> None:
        if self._requests is None:
            self._requests = requests = queue.SimpleQueue()
            call = self._stub.Bubbles(iter(requests.get, _CLOSE))
            threading.Thread(target=self._pump, args=(call,), daemon=True,
                             name="bubble-plans").start()
        self._requests.put(event)

    def _pump(self, call) -> None:
        try:
            for plan in call:
                self.latest = plan
        except grpc.RpcError as err:
            self.error = err
            self._requests = None

    def close(self) -> None:
        if self._requests is not None:
            self._requests.put(_CLOSE)
            self._requests = None
