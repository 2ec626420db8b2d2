"""The test harness: real daemons, rings, etcd, hosts in network namespaces and object
stores started as child processes, as tests, examples and benchmarks launch them.

A daemon runs as ``python -m bubblesnap daemon`` in a process of its own, exactly as
a host would run it, and is talked to only through what it offers the outside: the
JSON "ready" line it prints on stdout, its gRPC services (the standard
``grpc.health.v1`` health service among them) and its signals (SIGTERM stops it and
frees its shared memory, SIGKILL is a lost host); etcd, the object stores and a
jax.distributed job's processes are real processes too. Nothing started here
outlives the process that started it: should that process die without stopping
them (even by SIGKILL), its reaper (:mod:`bubblesnap.testing.reaper`) kills what it
started and removes their shared-memory and socket folders (and the folders made
with :func:`reaped_tempdir`).

    from bubblesnap.testing import DaemonProcess, Ring, wait_for

    with DaemonProcess("--memory-budget", "1GiB") as daemon:
        client = SnapshotClient("job", options=ClientOptions(daemon=daemon.address))
        ...

    ring = Ring(3, "--replicas", "1")           # --peers a,b,c --index i
    ring.daemons[1].kill()                      # host 1 is gone
    ring.replace(1)                             # a new host takes its place
    wait_for(lambda: held_twice(ring), "re-replication")
    ring.stop()

    with EtcdServer(tmp_path) as etcd:          # a real etcd on loopback
        ring = Ring(3, "--replicas", "1", etcd=etcd)   # --coordination etcd://...

    with Cluster(3, "--replicas", "1", rate="1gbit") as cluster:   # hosts in namespaces
        cluster.partition([0], [1, 2])          # see bubblesnap.testing.cluster

The rooms: daemons.py (one daemon), ring.py (a static ring), etcd.py, processes.py
(ports, freezing, waiting, reaped folders), cluster.py (hosts in network namespaces),
object_stores.py (SeaweedFS S3 and the GCS emulator), multihost.py (a jax.distributed
job of N processes), history.py (what a fault test saw, and the contract checked on
it), reaper.py (what kills the rest when its starter dies).
"""

from bubblesnap.testing.cluster import Cluster
from bubblesnap.testing.daemons import DAEMON_SERVICE, DaemonError, DaemonProcess
from bubblesnap.testing.etcd import EtcdServer
from bubblesnap.testing.processes import free_port, freeze, in_netns, reaped_tempdir, wait_for
from bubblesnap.testing.ring import Ring, wait_connected

__all__ = ["DAEMON_SERVICE", "Cluster", "DaemonError", "DaemonProcess", "EtcdServer", "Ring",
           "free_port", "freeze", "in_netns", "reaped_tempdir", "wait_connected", "wait_for"]
