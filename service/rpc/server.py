"""The trainer API's gRPC server: ``grpc.aio`` on one event-loop thread, blocking work in
bounded pools.

With grpc's threaded server every call held a pool thread until it ended,
and a Bubbles stream lives as long as its pipeline stage: 96 stages' streams
took all 96 threads, and every other call, health checks included, waited
until its deadline (the daemon looked dead to its supervisor). Here a call is
a coroutine on the loop. It holds a thread only while its servicer method
runs (for a stream: one request at a time), in the pool of its lane, so long
waits (restores, waits for a commit) never hold up stagings and commits, and
Status has threads of its own. The health service runs on the loop itself:
it answers however busy the pools are.
"""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from bubblesnap.service.rpc import local_socket
from bubblesnap.service.rpc.handlers import StreamLimit, aio_handler
from bubblesnap.shared.trainer_api import socket_path


class TrainerServer:
    """A ``grpc.aio`` server on its own event-loop thread, driven from ordinary threads.

    ``threads`` maps each lane to the size of its pool ("calls" is the lane of
    every method no lane names); ``max_streams`` bounds the streams open at
    once, ``max_streams_option`` is what a refusal names.
    """

    def __init__(self, max_message_bytes: int, threads: dict[str, int], max_streams: int,
                 max_streams_option: str):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rpc-loop",
                                        daemon=True)
        self._thread.start()
        self._pools = {lane: ThreadPoolExecutor(n, thread_name_prefix=f"rpc-{lane}")
                       for lane, n in threads.items()}
        self._streams = StreamLimit(max_streams, max_streams_option)
        self._server = self._run(self._make(max_message_bytes))
        self._health = health.aio.HealthServicer()
        self._run(self._on_loop(health_pb2_grpc.add_HealthServicer_to_server, self._health,
                                self._server))

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _on_loop(self, function, *args):
        return function(*args)

    async def _make(self, max_message_bytes: int) -> grpc.aio.Server:
        return grpc.aio.server(options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0)])  # a second daemon on a taken port must fail, not share it

    def add_port(self, address: str) -> int:
        """Binds ``address`` (host:port, or a ``unix:`` socket made owner-only); the port
        (1 for a socket). Raises RuntimeError (or local_socket.SocketError) when it cannot."""
        path = socket_path(address)
        if path is None:
            return self._run(self._on_loop(self._server.add_insecure_port, address))
        local_socket.prepare(path)
        with local_socket.owner_only():
            return self._run(self._on_loop(self._server.add_insecure_port, address))

    def add_service(self, descriptor, servicer, lanes: dict[str, str]) -> None:
        """Serves ``descriptor``'s methods with ``servicer``; ``lanes`` names the lane of
        the methods that do not run in "calls"."""
        self._run(self._on_loop(self._server.add_generic_rpc_handlers, (aio_handler(
            descriptor, servicer, self._pools, lanes, self._streams),)))

    def enable_reflection(self, service_names: tuple[str, ...]) -> None:
        """Server reflection of ``service_names``, the health service and itself."""
        self._run(self._on_loop(reflection.enable_server_reflection,
                                (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                self._server))

    def start(self) -> None:
        self._run(self._server.start())

    def serving(self, names: tuple[str, ...]) -> None:
        """Health reports each of ``names`` ("" is the whole server) SERVING."""
        for name in names:
            self._run(self._health.set(name, health_pb2.HealthCheckResponse.SERVING))

    def stop(self, grace: float) -> None:
        """Health turns NOT_SERVING; in-flight calls get ``grace`` seconds, then the loop
        and the pools end (work already running in a pool thread finishes there)."""
        self._run(self._health.enter_graceful_shutdown())
        self._run(self._server.stop(grace))
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
