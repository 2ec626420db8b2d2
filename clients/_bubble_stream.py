"""The client's end of the Bubbles stream: bubble starts that wait briefly for a plan.

One long-lived bidirectional stream per rank. A START waits for the daemon's
answer at most ``timeout`` seconds (the bubble is idle time, but not much of
it); answers that arrive late are recognised by their echoed (iteration,
position) and dropped. END events are queued and never waited for.
"""

import queue
import threading

import grpc

from bubblesnap.protos import daemon_pb2 as pb

_CLOSE = object()


class BubbleStream:
    """Sends bubble events over one stream; reopened lazily after a failure."""

    def __init__(self, stub, timeout: float):
        self._stub = stub
        self._timeout = timeout
        self._requests: queue.SimpleQueue | None = None
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self.error: grpc.RpcError | None = None

    def _open(self) -> None:
        if self._requests is not None:
            return
        self.error = None
        self._requests = requests = queue.SimpleQueue()
        self._answers = answers = queue.SimpleQueue()
        call = self._stub.Bubbles(iter(lambda: requests.get(), _CLOSE))
        threading.Thread(target=self._pump, args=(call, answers), daemon=True,
                         name="bubble-answers").start()

    def _pump(self, call, answers) -> None:
        try:
            for answer in call:
                answers.put(answer)
        except grpc.RpcError as err:
            answers.put(err)

    def start(self, event: pb.BubbleEvent) -> pb.FetchPlan | None:
        """Announces a bubble; the daemon's plan for it, or None if it did not answer in time.

        Raises grpc.RpcError if the stream failed (and forgets it, so the next
        call reopens it).
        """
        self._open()
        self._requests.put(event)
        while True:
            try:
                answer = self._answers.get(timeout=self._timeout)
            except queue.Empty:
                return None
            if isinstance(answer, grpc.RpcError):
                self._requests = None
                raise answer
            if (answer.iteration, answer.position) == (event.iteration, event.position):
                return answer

    def end(self, event: pb.BubbleEvent) -> None:
        """Reports a finished bubble without waiting."""
        self._open()
        self._requests.put(event)

    def close(self) -> None:
        if self._requests is not None:
            self._requests.put(_CLOSE)
            self._requests = None
