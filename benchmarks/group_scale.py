"""Group protocol at scale: what each backend costs at 100, 1,000 and 10,000 daemons.

Nothing crosses a network: both backends run their real code against a fake
transport in this one process, which counts every message and its bytes.

  static   the ``--peers`` ring: real ``PeerGroup`` holdings gathering and
           ``GroupLayouts`` (every daemon asks every peer for its holdings and
           its layouts once a ``refresh_seconds``), the peers answered by fake
           stubs that build the same protobuf answers a daemon would. Every
           daemon does the same, so one daemon's round is measured and the
           total is N times it.
  etcd     the ``--coordination`` backend: real ``EtcdGroup`` objects on a fake
           etcd (keys, revisions, leases, prefix watches; a message's bytes
           are its JSON-gateway payload, base64 and all). Every daemon claims
           its slot and publishes its holdings with the real code; two run
           their watches and threads for real, the aggregator (index 0) and a
           typical daemon (the dead one's successor later on); the others'
           watches are counted as copies of the typical one's.

The job: one rank per daemon, ``--replicas 1``, two kept steps, one step per
second (a snapshot each ``refresh_seconds``), one layout of 8 tensors per rank.
Per backend and group size the report gives, in steady state, messages and
bytes per second for a typical daemon, the busiest one (static: all alike;
etcd: the aggregator) and the whole group; per step, what the protocol fixes
for a typical daemon (``typical_per_step``: the messages and bytes of the
calls it makes and answers, and the watch events it is sent: with etcd one to
four summaries, as many as the distinct values the aggregator saw while the
step's holdings arrived, which depends on timing); the latency until a new step counts
as committed (static: the pusher's gathering round, measured, and the others'
next refresh; etcd: from the last publish to the typical daemon seeing the
summary, measured, which includes the aggregator judging every holding);
detection of a dead daemon and the time until its copies are pushed again
(configured timeouts plus the measured work: static, ``dead_after_seconds``
plus a refresh and a gathering round; etcd, the lease TTL plus the measured
watch delivery and the successor's one read and decision). The Replicate
calls and the bytes on the data channel are the same for both and left out.

Usage: python benchmarks/group_scale.py [--json] [--quick] [--sizes 100,1000,10000]
       [--steps 5]
"""

import argparse
import base64
import bisect
import json
import statistics
import threading
import time

import bench_common as common

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.service.coordination.etcd_group import CoordinationOptions, EtcdGroup
from bubblesnap.service.peers import group_view
from bubblesnap.service.peers.group import PeerGroup
from bubblesnap.service.peers.layouts import GroupLayouts
from bubblesnap.service.peers.peer_options import PeerOptions

JOB = "job"
REPLICAS = 1
KEEP = 2
TENSORS = 8


class Counter:
    """Messages and bytes one daemon sent and received: in all, and those of its calls
    (requests and answers) apart from the watch events delivered to it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def add(self, messages: int, nbytes: int, event: bool = False) -> None:
        with self._lock:
            self.messages += messages
            self.bytes += nbytes
            if event:
                self.events += messages
            else:
                self.calls, self.call_bytes = self.calls + messages, self.call_bytes + nbytes

    def reset(self) -> None:
        with self._lock:
            self.messages = self.bytes = self.calls = self.call_bytes = self.events = 0

    def per_step(self, steps: int, scale: int = 1) -> dict:
        """What the protocol fixes, per step: the messages of the calls and their bytes,
        and the watch events (``scale``: times as many, for one counted in halves)."""
        return {"call_messages": scale * self.calls / steps,
                "call_bytes": scale * self.call_bytes / steps,
                "watch_events": scale * self.events / steps}


def _size(payload) -> int:
    return len(json.dumps(payload))


def _b64(text) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


# -- the etcd backend ---------------------------------------------------------


class FakeEtcd:
    """Keys (sorted, for ranges), revisions, leases and prefix watches, in memory."""

    def __init__(self):
        self._lock = threading.Lock()
        self._keys: list[str] = []
        self._values: dict[str, tuple[bytes, int]] = {}
        self._leases: dict[int, set[str]] = {}
        self._watchers: list[tuple[str, object, Counter]] = []
        self._copies: list[tuple[str, int, Counter]] = []  # watches counted, not run
        self._history: list[tuple[int, list]] = []  # (revision, events): watches replay it
        self.revision = 0
        self._next_lease = 1

    def client(self, counter: Counter) -> "FakeKV":
        return FakeKV(self, counter)

    def count_watch(self, prefix: str, copies: int, counter: Counter) -> None:
        self._copies.append((prefix, copies, counter))

    def grant(self) -> int:
        with self._lock:
            self._next_lease += 1
            self._leases[self._next_lease] = set()
            return self._next_lease

    def alive(self, lease: int) -> bool:
        with self._lock:
            return lease in self._leases

    def expire(self, lease: int) -> None:
        with self._lock:
            gone = self._leases.pop(lease, set())
        self.write({}, sorted(gone), 0)

    def write(self, puts: dict[str, bytes], deletes, lease: int, only_new: bool = False) -> bool:
        events = []
        with self._lock:
            if only_new and any(k in self._values for k in puts):
                return False
            self.revision += 1
            for key in deletes:
                if key in self._values:
                    _, owner = self._values.pop(key)
                    self._leases.get(owner, set()).discard(key)
                    del self._keys[bisect.bisect_left(self._keys, key)]
                    events.append((key, None))
            for key, value in puts.items():
                if key not in self._values:
                    bisect.insort(self._keys, key)
                self._values[key] = (value, lease)
                if lease:
                    self._leases[lease].add(key)
                events.append((key, value))
            self._history.append((self.revision, events))
            watchers, copies = list(self._watchers), list(self._copies)
        self._deliver(events, watchers, copies)
        return True

    def _deliver(self, events, watchers, copies) -> None:
        for prefix, on_events, counter in watchers:
            mine = [e for e in events if e[0].startswith(prefix)]
            if mine:
                counter.add(1, _events_bytes(mine), event=True)
                on_events(mine, self.revision)
        for prefix, count, counter in copies:
            mine = [e for e in events if e[0].startswith(prefix)]
            if mine:
                counter.add(count, count * _events_bytes(mine), event=True)

    def range(self, prefix: str) -> tuple[int, dict[str, bytes]]:
        with self._lock:
            start = bisect.bisect_left(self._keys, prefix)
            found = {}
            for key in self._keys[start:]:
                if not key.startswith(prefix):
                    break
                found[key] = self._values[key][0]
            return self.revision, found

    def watch(self, prefix: str, start_revision: int, on_events, counter: Counter,
              stopped: threading.Event):
        entry = (prefix, on_events, counter)
        with self._lock:
            self._watchers.append(entry)
            missed = [events for revision, events in self._history if revision >= start_revision]
        for events in missed:
            self._deliver(events, [entry], [])
        stopped.wait()
        with self._lock:
            self._watchers.remove(entry)


def _events_bytes(events) -> int:
    return _size({"result": {"header": {"revision": 1}, "events": [
        {"kv": {"key": _b64(k), **({"value": _b64(v)} if v is not None else {})}}
        for k, v in events]}})


class FakeKV:
    """``EtcdKV``'s interface over a FakeEtcd, counting this client's messages."""

    def __init__(self, etcd: FakeEtcd, counter: Counter):
        self._etcd, self._counter = etcd, counter

    def _call(self, request, answer) -> None:
        self._counter.add(2, _size(request) + _size(answer))

    def grant(self, ttl_seconds: int) -> int:
        lease = self._etcd.grant()
        self._call({"TTL": ttl_seconds, "ID": 0}, {"ID": lease, "TTL": ttl_seconds})
        return lease

    def keepalive(self, lease: int) -> int:
        # Not counted: renewals run on wall-clock time, not the simulation's seconds;
        # KEEPALIVE's modeled cost is added to every daemon instead.
        return 2 if self._etcd.alive(lease) else -1

    def revoke(self, lease: int) -> None:
        self._call({"ID": lease}, {})
        self._etcd.expire(lease)

    def create(self, key: str, value: bytes, lease: int = 0) -> bool:
        ok = self._etcd.write({key: value}, (), lease, only_new=True)
        self._call({"compare": [{"key": _b64(key)}], "success": [
            {"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease}}]},
            {"succeeded": ok})
        return ok

    def apply(self, puts: dict[str, bytes], deletes=(), lease: int = 0) -> None:
        self._etcd.write(puts, deletes, lease)
        self._call({"success": [{"request_put": {"key": _b64(k), "value": _b64(v),
                                                 "lease": lease}} for k, v in puts.items()]
                    + [{"request_delete_range": {"key": _b64(k)}} for k in deletes]},
                   {"succeeded": True})

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.apply({key: value}, lease=lease)

    def get(self, key: str) -> bytes | None:
        found = self._etcd.range(key)[1].get(key)
        self._call({"key": _b64(key)}, {"kvs": [] if found is None else [
            {"key": _b64(key), "value": _b64(found)}]})
        return found

    def ranges(self, prefixes):
        read = [self._etcd.range(p) for p in prefixes]
        found = [f for _, f in read]
        self._call({"success": [{"request_range": {"key": _b64(p)}} for p in prefixes]},
                   {"responses": [{"kvs": [{"key": _b64(k), "value": _b64(v)}
                                           for k, v in f.items()]} for f in found]})
        return min(r for r, _ in read), found

    def range(self, prefix: str):
        revision, (found,) = self.ranges([prefix])
        return revision, found

    def watch(self, prefix: str, start_revision: int, on_events, stopped) -> None:
        self._counter.add(1, _size({"create_request": {"key": _b64(prefix)}}))
        self._etcd.watch(prefix, start_revision, on_events, self._counter, stopped)

    def close(self) -> None:
        pass


def rank_layout(index: int, size: int) -> ppb.RankLayout:
    """Rank ``index``'s layout: TENSORS float32 arrays of 1024 x 1024, its own."""
    return ppb.RankLayout(rank=index, world_size=size, tensors=[pb.TensorSpec(
        name=f"t{t}", dtype="float32", global_shape=[1024, 1024], shards=[pb.ShardSpec(
            index=[pb.Slice(start=0, stop=1024)] * 2, nbytes=4 << 20, device="host")])
        for t in range(TENSORS)])


def keepalive_rate(lease_seconds: float) -> dict:
    """A lease renewed every third of its TTL: request and answer, as the gateway's JSON."""
    per_second = 3 / max(2, round(lease_seconds))
    nbytes = _size({"ID": 7587869186012345678}) + _size(
        {"result": {"ID": 7587869186012345678, "TTL": 5}})
    return {"messages_per_s": 2 * per_second, "bytes_per_s": nbytes * per_second}


def _plus(a: dict, b: dict, times: float = 1.0) -> dict:
    return {k: a[k] + times * b[k] for k in a}


def own_copies(index: int, size: int, steps) -> list[group_view.Holding]:
    """What daemon ``index`` holds: its rank's steps and its predecessor's replicas."""
    return [group_view.Holding(index, rank, step, rank != index, size)
            for rank in (index, (index - 1) % size) for step in steps]


def wait_until(check, timeout: float = 120.0) -> float:
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > timeout:
            raise TimeoutError("the simulated group did not get there")
        time.sleep(0.0005)
    return time.perf_counter() - start


def etcd_backend(size: int, steps: int, refresh: float, lease_seconds: float) -> dict:
    etcd = FakeEtcd()
    options = CoordinationOptions(url="etcd://fake:2379", group_size=size)
    counters = [Counter() for _ in range(size)]
    typical = size // 2
    groups = []
    for index in range(size):
        group = EtcdGroup(options, f"10.0.{index // 250}.{index % 250}:7000", 1 + REPLICAS,
                          lease_seconds, kv=etcd.client(counters[index]))
        group.claim(index)
        groups.append(group)
    others = Counter()  # the watches of every daemon that does not run its own
    for prefix in (groups[0].keys.slots(), groups[0].keys.summaries(),
                   groups[0].keys.layouts()):
        etcd.count_watch(prefix, size - 2, others)
    groups[0].watch()
    groups[typical].watch()
    for index, group in enumerate(groups):
        group.publish_layout(JOB, index, rank_layout(index, size).SerializeToString())

    def publish_step(step: int) -> None:
        for index, group in enumerate(groups):
            group.publish(JOB, own_copies(index, size, range(max(0, step - KEEP + 1), step + 1)))

    def seen(step: int):
        return lambda: (groups[typical].summary(JOB) or ([],))[0][-1:] == [step]

    publish_step(1)
    wait_until(seen(1))
    for c in [*counters, others]:
        c.reset()
    latencies = []
    started = time.perf_counter()
    for step in range(2, 2 + steps):
        publish_step(step)
        latencies.append(wait_until(seen(step)))
        for index, group in enumerate(groups):  # each replicator's refresh: one read
            group.holdings_of(JOB, {index, (index - 1) % size})
    wall = time.perf_counter() - started
    seconds = steps * refresh  # one step and one refresh each simulated second
    renewals = keepalive_rate(lease_seconds)
    typical_rate = _plus(_rate(counters[typical], seconds), renewals)
    typical_per_step = counters[typical].per_step(steps)
    aggregator_rate = _plus(_rate(counters[0], seconds), renewals)
    total = _plus(_rate_sum([*counters, others], seconds), renewals, size)

    # A loss: the daemon before the typical one stops renewing its lease.
    dead = typical - 1
    expired = time.perf_counter()
    etcd.expire(groups[dead]._lease)
    delivery = wait_until(lambda: dead not in groups[typical].members()[1])
    last = 1 + steps
    holdings = groups[typical].holdings_of(JOB, {typical, dead})
    work = group_view.re_replication(typical, size, groups[typical].members()[1], holdings,
                                     1 + REPLICAS, floor=last - KEEP + 1)
    decided = time.perf_counter() - expired
    for group in (groups[0], groups[typical]):
        group.stop()
    assert {(rank, step) for rank, step, _ in work} == \
        {(dead, s) for s in range(last - KEEP + 1, last + 1)}, work
    ttl = max(2, round(lease_seconds))
    return {"daemons": size, "typical": typical_rate, "busiest": aggregator_rate,
            "busiest_is": "the aggregator (index 0)", "total": total,
            "typical_per_step": typical_per_step,
            "commit_seconds": statistics.median(latencies),
            "detect_seconds": ttl + delivery,
            "re_replicate_seconds": ttl + decided + refresh,
            "simulation_wall_seconds": wall}


# -- the static ring ------------------------------------------------------------


class FakePeerStub:
    """A peer's Holdings and Layouts answers, as its daemon would build them."""

    def __init__(self, index: int, size: int, counter: Counter):
        self._index, self._size, self._counter = index, size, counter

    def Holdings(self, request, timeout=None, metadata=None):
        answer = ppb.HoldingsResponse(index=self._index, copies=[
            ppb.HeldCopy(job=JOB, rank=h.rank, step=h.step,
                         role=ppb.REPLICA if h.replica else ppb.PRIMARY, world_size=self._size)
            for h in own_copies(self._index, self._size, self._steps)])
        self._counter.add(2, request.ByteSize() + answer.ByteSize())
        return answer

    def Layouts(self, request, timeout=None, metadata=None):
        answer = ppb.LayoutsResponse(ranks=[rank_layout(self._index, self._size)])
        self._counter.add(2, request.ByteSize() + answer.ByteSize())
        return answer

    _steps = range(2)


class SimulatedRing(PeerGroup):
    """The real PeerGroup whose peers are fake stubs."""

    def __init__(self, options: PeerOptions, counter: Counter):
        super().__init__(options, 64 << 20)
        self._fakes = {i: FakePeerStub(i, self.size, counter) for i in range(self.size)}

    def _stub(self, index: int):
        return self._fakes[index]


def static_backend(size: int, steps: int, refresh: float, dead_after: float) -> dict:
    counter = Counter()
    options = PeerOptions(peers=tuple(f"10.0.{i // 250}.{i % 250}:7000" for i in range(size)),
                          index=0, replicas=REPLICAS, refresh_seconds=refresh,
                          dead_after_seconds=dead_after)
    ring = SimulatedRing(options, counter)
    layouts = GroupLayouts(None, ring)
    rounds, judging = [], []
    for _ in range(steps):
        start = time.perf_counter()
        holdings = ring.holdings(JOB, lambda: own_copies(0, size, range(2)))
        rounds.append(time.perf_counter() - start)
        start = time.perf_counter()
        group_view.committed_steps(size, holdings, 1 + REPLICAS)
        judging.append(time.perf_counter() - start)
        layouts.others(JOB, size)
    ring.close()
    seconds = steps * refresh
    made = _rate(counter, seconds)  # the calls one daemon makes; it answers as many
    one = {k: 2 * v for k, v in made.items()}
    round_seconds = statistics.median(rounds)
    return {"daemons": size, "typical": one, "busiest": one, "busiest_is": "every daemon",
            "total": {k: v * size for k, v in made.items()},
            "typical_per_step": counter.per_step(steps, scale=2),
            "commit_seconds": round_seconds + statistics.median(judging),
            "commit_seconds_elsewhere": round_seconds + refresh,
            "detect_seconds": dead_after + refresh,
            "re_replicate_seconds": dead_after + refresh + round_seconds,
            "gather_round_seconds": round_seconds}


def _rate(counter: Counter, seconds: float) -> dict:
    return {"messages_per_s": counter.messages / seconds, "bytes_per_s": counter.bytes / seconds}


def _rate_sum(counters, seconds: float) -> dict:
    return {"messages_per_s": sum(c.messages for c in counters) / seconds,
            "bytes_per_s": sum(c.bytes for c in counters) / seconds}


def print_table(report: dict) -> None:
    print(f"{'backend':8} {'daemons':>8} {'msg/s/daemon':>13} {'B/s/daemon':>12} "
          f"{'busiest msg/s':>14} {'total msg/s':>13} {'total B/s':>12} {'commit s':>9} "
          f"{'detect s':>9} {'re-repl s':>9}")
    for row in report["results"]:
        print(f"{row['backend']:8} {row['daemons']:>8} "
              f"{row['typical']['messages_per_s']:>13.1f} {row['typical']['bytes_per_s']:>12.0f} "
              f"{row['busiest']['messages_per_s']:>14.1f} {row['total']['messages_per_s']:>13.0f} "
              f"{row['total']['bytes_per_s']:>12.3g} {row['commit_seconds']:>9.4f} "
              f"{row['detect_seconds']:>9.2f} {row['re_replicate_seconds']:>9.2f}")
    print(report["static_limit"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000",
                        help="group sizes to simulate, comma-separated")
    parser.add_argument("--steps", type=int, default=5, help="steps (seconds) of steady state")
    args = common.parse_args(parser, {"sizes": "10,40", "steps": 2}, argv)
    defaults = PeerOptions()
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        common.log(f"{size} daemons: static ring")
        results.append({"backend": "static", **static_backend(
            size, args.steps, defaults.refresh_seconds, defaults.dead_after_seconds)})
        common.log(f"{size} daemons: etcd")
        results.append({"backend": "etcd", **etcd_backend(
            size, args.steps, defaults.refresh_seconds, defaults.dead_after_seconds)})
    static = [r for r in results if r["backend"] == "static"]
    per_peer = static[-1]["typical"]["bytes_per_s"] / max(1, static[-1]["daemons"] - 1)
    etcd_rows = [r for r in results if r["backend"] == "etcd"]
    growth = etcd_rows[-1]["typical"]["bytes_per_s"] / etcd_rows[0]["typical"]["bytes_per_s"]
    report = {"benchmark": "group_scale", "replicas": REPLICAS, "kept_steps": KEEP,
              "etcd_typical_bytes_growth": growth,
              "refresh_seconds": defaults.refresh_seconds, "results": results,
              "static_limit": (
                  f"static ring: each daemon makes and answers N-1 Holdings and N-1 Layouts "
                  f"calls per {defaults.refresh_seconds:g} s, about {per_peer:.0f} B/s per "
                  "peer; so N is limited by what one daemon may spend on coordination, "
                  "e.g. 1 MB/s per daemon allows N of about "
                  f"{1e6 / per_peer:.0f}, and the group's total grows as N^2")}
    common.report_out(report, args.json, print_table)


if __name__ == "__main__":
    main()
