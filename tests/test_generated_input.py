"""Generated hostile but well-formed input to every RPC of both services, against real daemons.

Each barrage sends requests built by hypothesis strategies that aim at the
edges (int64 and int32 bounds, huge and negative numbers, NaN, inf, 1e308 and
5e-324, long and unicode strings, empty fields, many repeated entries, valid
layouts under the wrong job) and checks every answer: never UNKNOWN or
INTERNAL, RESOURCE_EXHAUSTED only for a budget, error details of a few KiB
at most. Afterwards the daemon is alive, answers health, and a snapshot it
held before is restored bit for bit. The runs are derandomized (the same
calls every time); ``BUBBLESNAP_GENERATED_EXAMPLES=N`` sends more. The
count of answers by status code is printed (``pytest -s``).
"""

import collections
import math
import os

import grpc
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.protos import peer_pb2 as ppb
from bubblesnap.protos import peer_pb2_grpc
from bubblesnap.service.checks import ITEMSIZE, MAX_RANKS, MAX_SLOTS, MAX_TENSORS
from tests.helpers import tensor_spec

#: Hypothesis examples per barrage; each sends one to four calls.
EXAMPLES = int(os.environ.get("BUBBLESNAP_GENERATED_EXAMPLES", "150"))
HELD = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
HELD_STEP = 5
#: Budgets small enough that generated layouts and records reach them.
FLAGS = ("--memory-budget", "64MiB", "--log-budget", "256KiB")
WORST_DETAILS_BYTES = 4096
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


def _ints(bits: int, signed: bool = True):
    low, high = (-(1 << bits - 1), (1 << bits - 1) - 1) if signed else (0, (1 << bits) - 1)
    edges = [v for v in (0, 1, -1, 2, 3, 5, 6, 63, 64, 1 << 16, (1 << 16) + 1, 1 << 20,
                         (1 << 31) - 1, -(1 << 31), 1 << 53, (1 << 62) - 1, 1 << 62,
                         (1 << 63) - 1, -(1 << 63), (1 << 64) - 1) if low <= v <= high]
    return st.one_of(st.sampled_from(edges), st.integers(low, high),
                     st.integers(max(low, -2), 8))


INT32, INT64, UINT64 = _ints(32), _ints(64), _ints(64, signed=False)
SMALL = st.integers(0, 6)
FLOATS = st.one_of(st.sampled_from([0.0, -0.0, 1e-3, 0.01, 0.5, 1e6, 1e6 + 1, -1.0, 1e308,
                                    -1e308, 5e-324, math.inf, -math.inf, math.nan]),
                   st.floats(allow_nan=True, allow_infinity=True))
GOOD_SECONDS = st.sampled_from([0.0, 1e-3, 0.01, 0.2])
LONG = "x" * 20_000
NAMES = st.one_of(st.sampled_from(["held", "scratch", "nope"]),
                  st.sampled_from(["", "../etc", "a/b", "a\x00b", "x" * 129, LONG,
                                   "\u00e9\u2603", " held"]),
                  st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,12}", fullmatch=True),
                  st.text(max_size=20))
#: Jobs whose generated calls may change what is held: not the held snapshot's.
MUTABLE = NAMES.filter(lambda job: job != "held")
TENSOR_NAMES = st.one_of(st.sampled_from(["w", "b", "params/dense/kernel", "", ".", "a/../b",
                                          "/abs", "w\x00", "x" * 1025, "\u00e9\u2603"]),
                         st.text(max_size=12))
DTYPES = st.one_of(st.sampled_from(sorted(ITEMSIZE)),
                   st.sampled_from(["", "float31", "Float32", "x" * 5000]))
STREAMS = st.one_of(st.sampled_from(["", "act/mb0", "grad/mb1", "../up", "a" * 65, "sp ace",
                                     LONG, "\u2603"]), st.text(max_size=10))
PAYLOADS = st.sampled_from([b"", b"r", bytes(100), bytes(64 << 10), bytes((64 << 10) + 1)])
ADDRESSES = st.one_of(st.sampled_from([
    "127.0.0.1:1", "localhost:1", "[::1]:1", "a" * 64 + ".x:1", "h:\u00b2", "", ":80",
    "127.0.0.1:0", "127.0.0.1:65536", "[zz]:1", "x" * 300, "\u00e9:1"]),
    st.text(max_size=20))
#: Repeated fields past the daemon's bounds (built once: they are large).
MANY_CHECKSUMS = list(range(MAX_SLOTS + 1))
MANY_RANKS = list(range(MAX_RANKS + 1))
MANY_TENSORS = [tensor_spec(f"t{i}", (1,)) for i in range(MAX_TENSORS + 1)]
#: Every shard fits, their 64-byte aligned sum passes int64.
PAST_INT64 = [tensor_spec(f"t{i}", (1 << 59,)) for i in range(4)]


def _lists(elements, max_size: int = 3, many=None):
    lists = st.lists(elements, max_size=max_size)
    return lists if many is None else st.one_of(lists, st.just(many))


SLICES = st.builds(pb.Slice, start=INT64, stop=INT64)


@st.composite
def tensor_specs(draw):
    """A tensor of a layout: consistent (whole or split shards, the right byte count) or
    anything at all."""
    name, dtype = draw(TENSOR_NAMES), draw(DTYPES)
    if draw(st.booleans()):
        shape = draw(st.lists(st.one_of(SMALL, st.sampled_from([1 << 20, 1 << 40])),
                              max_size=3))
        itemsize = ITEMSIZE.get(dtype, 4)
        cuts = [(0, d) for d in shape]
        if shape and shape[0] > 1 and draw(st.booleans()):  # two shards along the first axis
            half = shape[0] // 2
            boxes = [[(0, half), *cuts[1:]], [(half, shape[0]), *cuts[1:]]]
        else:
            boxes = [cuts]
        shards = [pb.ShardSpec(index=[pb.Slice(start=a, stop=b) for a, b in box],
                               nbytes=int(np.prod([b - a for a, b in box])) * itemsize)
                  for box in boxes if draw(st.integers(0, 5))]
        return pb.TensorSpec(name=name, dtype=dtype, global_shape=shape, shards=shards,
                             job_wide=draw(st.booleans()))
    return pb.TensorSpec(name=name, dtype=dtype, global_shape=draw(_lists(INT64, 4)),
                         job_wide=draw(st.booleans()), shards=draw(_lists(st.builds(
                             pb.ShardSpec, index=_lists(SLICES, 4), nbytes=INT64), 2)))


#: Well-formed layouts of a few small tensors: calls with them get past the checks.
GOOD_LAYOUTS = st.lists(st.builds(
    lambda name, dtype, shape: tensor_spec(name, shape, dtype),
    st.sampled_from(["w", "b", "params/dense/kernel"]), st.sampled_from(sorted(ITEMSIZE)),
    st.lists(st.integers(0, 6), max_size=3)), min_size=1, max_size=3,
    unique_by=lambda spec: spec.name)
#: A layout whose steps pass the memory budget of FLAGS.
BIG = [tensor_spec("big", (1 << 25,))]
LAYOUTS = st.one_of(_lists(tensor_specs(), 3), GOOD_LAYOUTS, st.just(BIG),
                    st.just([tensor_spec("w", (8, 8))]),  # the held layout, under any job
                    st.just(PAST_INT64), st.just(MANY_TENSORS))
GROUPS = _lists(INT32, 4, MANY_RANKS)
RECORDS = _lists(st.builds(pb.LogRecord, step=st.one_of(SMALL, INT64), payload=PAYLOADS), 3)
USAGE = st.builds(pb.BubbleUsage, offered_seconds=FLOATS, used_seconds=FLOATS,
                  spilled_seconds=FLOATS, spilled_bytes=INT64, bubbles=INT32,
                  iterations=INT32, overrun_seconds=FLOATS)
REPORTS = _lists(st.builds(pb.BubbleReport, position=st.one_of(SMALL, INT32),
                           measured_seconds=FLOATS, copied_bytes=INT64, copy_seconds=FLOATS),
                 3)
STEPS = st.one_of(SMALL, INT64)
#: Where the daemon's durable tier is, in a Persist's folder (the test's own, put in when
#: the call is sent).
DURABLE = "{durable}"
FOLDERS = st.one_of(st.sampled_from([
    "", "relative/item", "/", "/etc", "/etc/passwd/x", "/a/../b", "/a//b", "/a/./b", "/a/b/",
    "/a\x00b", "/" + "x" * 5000, DURABLE, f"{DURABLE}/step/item", f"{DURABLE}/../outside",
    f"{DURABLE}/missing/item", f"{DURABLE}/step", "\u2603"]), st.text(max_size=20))


def _optional(**fields):
    """Builds with each of ``fields`` (an optional proto field) present or absent."""
    return st.fixed_dictionaries({}, optional=fields)


def _register(job, world):
    return st.builds(pb.RegisterRequest, job=job, rank=st.one_of(SMALL, INT32),
                     world_size=world, tensors=LAYOUTS, replica_group=GROUPS)


@st.composite
def _good_register(draw):
    """A registration that may well be accepted: a known job, a rank inside its world."""
    world = draw(st.integers(1, 4))
    return pb.RegisterRequest(job=draw(st.sampled_from(["scratch", "nope", "fresh"])),
                              rank=draw(st.integers(0, world - 1)), world_size=world,
                              tensors=draw(st.one_of(GOOD_LAYOUTS, st.just(BIG))),
                              replica_group=draw(st.lists(st.integers(0, world - 1),
                                                          max_size=2)))


def _restore(job, world):
    tensors = _lists(st.builds(pb.TensorRequest, name=TENSOR_NAMES, dtype=DTYPES,
                               global_shape=_lists(st.one_of(SMALL, INT64), 3),
                               regions=_lists(st.builds(pb.Region, index=_lists(SLICES, 3)),
                                              2)), 2)
    return st.tuples(st.builds(pb.RestoreRequest, job=job, rank=st.one_of(SMALL, INT32),
                               replica_group=GROUPS, alone=st.booleans(), world_size=world,
                               tensors=tensors), _optional(step=STEPS))


@st.composite
def _held_regions(draw):
    """A restore of the held snapshot by regions: boxes inside its (8, 8) array, or past it."""
    def box():
        bounds = [sorted(draw(st.lists(st.integers(0, 9), min_size=2, max_size=2)))
                  for _ in range(2)]
        return pb.Region(index=[pb.Slice(start=a, stop=b) for a, b in bounds])
    tensor = pb.TensorRequest(name="w", dtype=draw(st.sampled_from(["float32", "int32"])),
                              global_shape=[8, 8],
                              regions=[box() for _ in range(draw(st.integers(0, 3)))])
    return pb.RestoreRequest(job="held", rank=0, world_size=draw(st.sampled_from([0, 1])),
                             tensors=[tensor], alone=draw(st.booleans()))


def _with_optional(pair):
    request, present = pair
    for field, value in present.items():
        setattr(request, field, value)
    return request


def _bubble_events():
    event = st.builds(pb.BubbleEvent, job=NAMES, rank=st.one_of(SMALL, INT32), stage=INT32,
                      step=INT64, kind=st.sampled_from([0, 1, 2, 3, 7]),
                      expected_seconds=FLOATS, plan_version=st.one_of(SMALL, INT64),
                      iteration=st.one_of(SMALL, INT64), position=st.one_of(SMALL, INT32),
                      measured_seconds=FLOATS, copied_bytes=st.one_of(SMALL, INT64),
                      copy_seconds=FLOATS, iteration_seconds=FLOATS, reports=REPORTS)
    plausible = st.builds(pb.BubbleEvent, job=st.sampled_from(["held", "scratch"]),
                          rank=st.just(0), kind=st.sampled_from([1, 2, 3]),
                          iteration=SMALL, plan_version=SMALL, position=SMALL,
                          measured_seconds=st.one_of(FLOATS, GOOD_SECONDS),
                          copied_bytes=st.sampled_from([0, 1 << 20, 1 << 30]),
                          copy_seconds=st.one_of(FLOATS, GOOD_SECONDS),
                          iteration_seconds=st.one_of(FLOATS, GOOD_SECONDS),
                          reports=st.lists(st.builds(pb.BubbleReport, position=SMALL,
                                                     measured_seconds=GOOD_SECONDS),
                                           max_size=3))
    return st.lists(st.one_of(event, plausible), min_size=1, max_size=4)


@st.composite
def _good_replicate(draw):
    """A replica offered well-formed, from a data address where nothing answers (or the
    held copy's own step, which a failed offer must not cost)."""
    tensors = draw(st.one_of(GOOD_LAYOUTS, st.just([tensor_spec("w", (8, 8))])))
    slots = sum(len(t.shards) for t in tensors)
    return ppb.ReplicateRequest(
        job=draw(st.sampled_from(["held", "scratch", "fresh"])), world_size=1, rank=0,
        step=draw(SMALL), tensors=tensors, checksums=draw(st.lists(
            UINT64, min_size=slots, max_size=slots)), data_address="127.0.0.1:1",
        ticket=bytes(16))


#: (method, request) of the Daemon service; the held job's snapshot stays (its
#: world size is never changed, none of its steps is written or deleted).
DAEMON_CALLS = st.one_of(
    st.tuples(st.just("Register"), st.one_of(
        _register(MUTABLE, st.one_of(SMALL, INT32)), _register(st.just("held"), st.just(1)),
        _good_register())),
    st.tuples(st.just("Bubbles"), _bubble_events()),
    st.tuples(st.just("BeginStep"), st.builds(pb.BeginStepRequest, job=MUTABLE,
                                              rank=st.one_of(SMALL, INT32), step=STEPS)),
    st.tuples(st.just("CommitStep"), st.tuples(st.builds(
        pb.CommitStepRequest, job=MUTABLE, rank=st.one_of(SMALL, INT32), step=STEPS,
        checksums=_lists(UINT64, 2, MANY_CHECKSUMS), usage=USAGE),
        _optional(next_step=STEPS)).map(_with_optional)),
    st.tuples(st.just("AbortStep"), st.builds(pb.AbortStepRequest, job=NAMES,
                                              rank=st.one_of(SMALL, INT32), step=STEPS)),
    st.tuples(st.just("Status"), st.builds(pb.StatusRequest, job=NAMES)),
    st.tuples(st.sampled_from(["Restore", "RestoreStream"]), st.one_of(
        _restore(MUTABLE, st.one_of(SMALL, INT32)),
        _restore(st.just("held"), st.sampled_from([0, 1]))).map(_with_optional)
        | _held_regions()),
    st.tuples(st.just("WaitCommitted"), st.one_of(
        st.builds(pb.WaitCommittedRequest, job=NAMES, step=STEPS, timeout_seconds=st.sampled_from(
            [0.0, -0.0, 0.02, 5e-324, -1.0, -5e-324, math.inf, -math.inf, math.nan])),
        st.builds(pb.WaitCommittedRequest, job=st.just("held"), step=st.just(HELD_STEP),
                  timeout_seconds=FLOATS))),
    st.tuples(st.just("Persist"), st.one_of(
        st.builds(pb.PersistRequest, job=NAMES, rank=st.one_of(SMALL, INT32), step=STEPS,
                  directory=FOLDERS),
        st.builds(pb.PersistRequest, job=st.just("held"), rank=st.just(0),
                  step=st.just(HELD_STEP), directory=FOLDERS))),
    st.tuples(st.just("DropAfter"), st.builds(pb.DropAfterRequest, job=MUTABLE,
                                              step=st.one_of(st.integers(-2, 6), INT64))),
    st.tuples(st.just("ListSnapshots"), st.builds(pb.ListSnapshotsRequest, job=NAMES)),
    st.tuples(st.just("DeleteSnapshots"), st.builds(
        pb.DeleteSnapshotsRequest, job=MUTABLE, steps=_lists(STEPS, 3, MANY_CHECKSUMS))),
    st.tuples(st.just("AppendLog"), st.builds(pb.AppendLogRequest, job=NAMES,
                                              rank=st.one_of(SMALL, INT32), records=RECORDS,
                                              stream=STREAMS)),
    st.tuples(st.just("AppendLogs"), st.builds(pb.AppendLogsRequest, logs=_lists(st.builds(
        pb.AppendLogRequest, job=NAMES, rank=SMALL, records=RECORDS, stream=STREAMS), 3))),
    st.tuples(st.just("ReadLog"), st.tuples(st.builds(
        pb.ReadLogRequest, job=NAMES, rank=st.one_of(SMALL, INT32),
        after_step=st.one_of(st.integers(-2, 6), INT64), stream=STREAMS),
        _optional(until_step=STEPS)).map(_with_optional)),
)

#: (method, request) of the Peer service (daemon 1 of a ring; the held job is its).
PEER_CALLS = st.one_of(
    st.tuples(st.just("Join"), st.builds(ppb.JoinRequest, index=st.one_of(SMALL, INT32),
                                         address=ADDRESSES)),
    st.tuples(st.just("Holdings"), st.builds(ppb.HoldingsRequest, job=NAMES)),
    st.tuples(st.just("Replicate"), st.builds(
        ppb.ReplicateRequest, job=NAMES, world_size=st.one_of(SMALL, INT32),
        rank=st.one_of(SMALL, INT32), step=STEPS, tensors=LAYOUTS,
        checksums=_lists(UINT64, 2, MANY_CHECKSUMS), data_address=ADDRESSES,
        ticket=st.sampled_from([b"", bytes(16), b"t" * 16, b"t" * 17]),
        replica_group=GROUPS) | _good_replicate()),
    st.tuples(st.just("OpenRead"), st.builds(ppb.OpenReadRequest, job=NAMES,
                                             rank=st.one_of(SMALL, INT32), step=STEPS,
                                             slots=_lists(INT32, 3, MANY_CHECKSUMS[:1 << 16]))),
    st.tuples(st.just("Describe"), st.builds(ppb.DescribeRequest, job=NAMES,
                                             rank=st.one_of(SMALL, INT32), step=STEPS)),
    st.tuples(st.just("Layouts"), st.builds(ppb.LayoutsRequest, job=NAMES)),
    st.tuples(st.just("Rollback"), st.builds(ppb.RollbackRequest, job=MUTABLE, step=STEPS,
                                             world_size=st.one_of(SMALL, INT32))),
    st.tuples(st.just("AppendLogReplica"), st.builds(
        ppb.LogReplicaRequest, job=NAMES, rank=st.one_of(SMALL, INT32), records=RECORDS)),
    st.tuples(st.just("ReadLogReplica"), st.tuples(st.builds(
        pb.ReadLogRequest, job=NAMES, rank=st.one_of(SMALL, INT32),
        after_step=st.one_of(st.integers(-2, 6), INT64)),
        _optional(until_step=STEPS)).map(_with_optional)),
)


def _answer(stub, method: str, request, durable: str = "") -> tuple[grpc.StatusCode, str]:
    """The status code and details of one call (a stream: of the whole stream)."""
    if method == "Persist":
        request.directory = request.directory.replace(DURABLE, durable)
    try:
        if method == "Bubbles":
            list(stub.Bubbles(iter(request), timeout=20))
        elif method == "RestoreStream":
            list(stub.RestoreStream(request, timeout=20))
        else:
            getattr(stub, method)(request, timeout=20)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _barrage(stub, calls, counts: collections.Counter, durable: str = "") -> None:
    @SETTINGS
    @given(st.lists(calls, min_size=1, max_size=4))
    def send(batch):
        for method, request in batch:
            code, details = _answer(stub, method, request, durable)
            counts[code.name] += 1
            counts[f"{method} {code.name}"] += 1
            assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), \
                (method, code, details[:500])
            assert code is not grpc.StatusCode.DEADLINE_EXCEEDED, method
            assert len(details.encode()) <= WORST_DETAILS_BYTES, (method, len(details))
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert "budget" in details or "shared-memory directory" in details, details
    send()


def _report(service: str, counts: collections.Counter) -> None:
    codes = {k: v for k, v in sorted(counts.items()) if " " not in k}
    print(f"\n{service}: {sum(codes.values())} generated calls by status code: {codes}")
    print(f"{service} by method: " + ", ".join(
        f"{k}={v}" for k, v in sorted(counts.items()) if " " in k))


def _held_snapshot(daemon) -> NumpyClient:
    client = NumpyClient("held", options=ClientOptions(daemon=daemon.address))
    assert client.snapshot(HELD_STEP, HELD, wait="job").committed
    return client


def _still_serves(daemon, client: NumpyClient) -> None:
    assert daemon.alive() and daemon.healthy()
    step, restored = client.restore()
    assert step == HELD_STEP and restored["w"].tobytes() == HELD["w"].tobytes()
    client.close()


def test_generated_calls_to_the_daemon_service(start_daemon, tmp_path):
    durable = tmp_path / "durable"
    (durable / "step").mkdir(parents=True)
    daemon = start_daemon(*FLAGS, "--durable-dir", str(durable))
    client = _held_snapshot(daemon)
    NumpyClient("scratch", options=ClientOptions(daemon=daemon.address)).register(HELD)
    counts = collections.Counter()
    _barrage(daemon.stub, DAEMON_CALLS, counts, str(durable))
    _report("Daemon", counts)
    _still_serves(daemon, client)


def test_generated_calls_to_the_peer_service(start_ring):
    ring = start_ring(2, "--replicas", "1", *FLAGS)
    target = ring.daemons[1]
    client = _held_snapshot(target)
    counts = collections.Counter()
    with grpc.insecure_channel(ring.peers[1]) as channel:
        _barrage(peer_pb2_grpc.PeerStub(channel), PEER_CALLS, counts)
    _report("Peer", counts)
    _still_serves(target, client)
