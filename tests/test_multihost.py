"""Multi-host JAX: real processes under ``jax.distributed`` (2 CPU devices each), real daemons.

Each job runs ``tests/programs/multihost_cases.py`` in N processes
(``bubblesnap.testing.multihost.JaxJob``). A job is trained a few steps, every
process is SIGKILLed, and new processes (as many, fewer or more, on
another mesh or with other partition specs) restore it and compare every
local shard with the step's values.
"""

from pathlib import Path

import grpc
import numpy as np
import pytest

from bubblesnap.clients import ClientOptions, NumpyClient, RestoreError
from bubblesnap.clients._regions import in_request_order
from bubblesnap.clients.results import RawStep
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.testing import DaemonProcess, Ring
from bubblesnap.testing.multihost import JaxJob
from tests.helpers import run_example

CASES = str(Path(__file__).resolve().parent / "programs" / "multihost_cases.py")
GLOBAL_BYTES = {"f32": 8 * 6 * 4, "bf16": 8 * 6 * 2, "i32": 8 * 4 * 4, "scalar": 4,
                "partly/a": 4 * 4, "partly/b": 8 * 4}
VARIANTS = ["same", "transposed", "1d"]
STEPS = 3


def _run(function: str, processes: int, args: dict, devices: int = 2) -> list:
    return JaxJob(f"{CASES}:{function}", processes, args, devices=devices).results()


def _train_and_kill(daemons: list[str], jobs: list[dict], processes: int = 2) -> list[dict]:
    """Trains ``jobs`` STEPS steps in ``processes`` processes, then SIGKILLs every one."""
    args = {"daemons": daemons, "jobs": jobs, "steps": STEPS, "then_wait_for_kill": True}
    with JaxJob(f"{CASES}:train", processes, args) as job:
        trained = job.wait_event(lambda e: e["event"] == "trained")
        job.kill()
    return trained


def test_a_job_that_crashes_dies_of_sigkill_whichever_process_gets_there_last():
    # Processes that SIGKILLed themselves died of SIGABRT when process 0, the coordination
    # service's host, went first (3 runs of 4 with 2 processes, process 1 behind).
    job = JaxJob(f"{CASES}:crash_one_after_another", 3, {"lag": 1.0})
    assert job.wait_crash() == [-9, -9, -9]


def _targets(job: str, mesh: str, variants=VARIANTS, kind: str = "global", **extra) -> list:
    return [{"label": f"{job}/{v}", "job": job, "kind": kind, "mesh": mesh, "variant": v,
             **extra} for v in variants]


def _outcomes(results: list) -> dict:
    """label -> the outcome of every process, in process order."""
    found: dict = {}
    for result in results:
        for outcome in result["outcomes"]:
            found.setdefault(outcome["label"], []).append(outcome)
    return found


def _assert_restored(outcomes: list, step: int = STEPS - 1) -> None:
    for process, outcome in enumerate(outcomes):
        assert "error" not in outcome, f"process {process}: {outcome['error']}"
        assert outcome["step"] == step and outcome["mismatches"] == [], (process, outcome)


# -- without a daemon: who copies what -------------------------------------------------


def test_each_region_is_copied_by_the_process_holding_replica_zero():
    found = _run("layouts", 2, {"meshes": ["diagonal", "default"]})
    assert all(f[mesh]["fast_path_matches"] for f in found for mesh in f)
    p0, p1 = ({mesh: f[mesh]["copied"] for mesh in f} for f in found)
    # Diagonal mesh [[p0d0, p1d0], [p1d1, p0d1]]: each process holds rows 0:4 and 4:8 of
    # P("x"), but replica 0 of rows 0:4 is on p0's device and of rows 4:8 on p1's.
    assert p0["diagonal"]["bf16"]["regions"] == [[[0, 4], [0, 6]]]
    assert p1["diagonal"]["bf16"]["regions"] == [[[4, 8], [0, 6]]]
    for mesh in ("diagonal", "default"):
        assert p0[mesh]["scalar"]["regions"] == [[]] and p1[mesh]["scalar"]["regions"] == []
        assert p0[mesh]["partly/a"]["regions"] == [[[0, 4]]]
        assert p1[mesh]["partly/a"]["regions"] == []
        for name in GLOBAL_BYTES:  # every region exactly once in the job
            regions = p0[mesh][name]["regions"] + p1[mesh][name]["regions"]
            assert len({str(r) for r in regions}) == len(regions), (mesh, name)
            assert p0[mesh][name]["job_wide"] and p1[mesh][name]["job_wide"]
    assert p1["default"]["i32"]["regions"] == []  # P(None, "y"): both columns are p0's


def _rows(a: int, b: int) -> list[pb.Slice]:
    return [pb.Slice(start=a, stop=b), pb.Slice(start=0, stop=8)]


def test_an_answer_without_the_regions_asked_is_refused():
    # A daemon that predates restores by region answers with the rank's own copy.
    own = RawStep(3, (pb.TensorSpec(name="w", dtype="float32", global_shape=[8, 8],
                                    shards=[pb.ShardSpec(index=_rows(0, 4))]),),
                  {(0, 0): np.zeros(128, np.uint8)})
    asked = pb.TensorRequest(name="w", dtype="float32", global_shape=[8, 8],
                             regions=[pb.Region(index=_rows(4, 8)), pb.Region(index=_rows(0, 4))])
    with pytest.raises(RestoreError, match=r"lacks 'w' \[4:8, 0:8\]"):
        in_request_order([asked], own)
    both = RawStep(3, (pb.TensorSpec(name="w", dtype="float32", global_shape=[8, 8], shards=[
        pb.ShardSpec(index=_rows(0, 4)), pb.ShardSpec(index=_rows(4, 8))]),),
        {(0, 0): np.zeros(128, np.uint8), (0, 1): np.ones(128, np.uint8)})
    ordered = in_request_order([asked], both)  # any order in, request order out
    assert ordered.shards[(0, 0)][0] == 1 and ordered.shards[(0, 1)][0] == 0
    wrong = pb.TensorRequest(name="w", dtype="int32", global_shape=[8, 8], regions=[])
    with pytest.raises(RestoreError, match="saved as float32"):
        in_request_order([wrong], both)


# -- one daemon ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lone_daemon():
    daemon = DaemonProcess("--memory-budget", "256MiB", "--keep", "4", own_shm_dir=True)
    yield daemon
    daemon.stop()


@pytest.fixture(scope="module")
def killed_job(lone_daemon):
    """Jobs "diag" and "grid" (global state on the diagonal and the default mesh),
    "own" (each rank's own arrays) and "epoch", trained and SIGKILLed."""
    return _train_and_kill([lone_daemon.address], [
        {"name": "diag", "kind": "global", "mesh": "diagonal"},
        {"name": "grid", "kind": "global", "mesh": "default"},
        {"name": "own", "kind": "own", "mesh": "local"},
        {"name": "epoch", "kind": "global", "mesh": "default"}])


def test_every_step_is_committed_for_the_job_and_each_region_held_once(killed_job):
    for trained in killed_job:
        for job, snapshots in trained["snapshots"].items():
            assert [s["committed"] for s in snapshots] == [True] * STEPS, (job, snapshots)
            assert {s["waited_for"] for s in snapshots} == {"job"}
        for job in ("diag", "grid", "epoch"):
            assert trained["held"][job] == GLOBAL_BYTES, job  # once per job, not per process
        assert trained["held"]["own"] == {"w": 2 * 8 * 4 * 4}  # one copy per rank
        assert trained["copied"]["own"]["w"]["job_wide"] is False


@pytest.fixture(scope="module")
def restored_in_two(killed_job, lone_daemon):
    return _outcomes(_run("restore", 2, {"daemons": [lone_daemon.address], "targets": [
        *_targets("diag", "diagonal"), *_targets("grid", "default"),
        *_targets("own", "local", ["same"], kind="own")]}))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("job", ["diag", "grid"])
def test_new_processes_restore_into_the_same_or_another_sharding(restored_in_two, job,
                                                                 variant):
    _assert_restored(restored_in_two[f"{job}/{variant}"])


def test_rank_own_state_restores_into_the_same_world_size(restored_in_two):
    _assert_restored(restored_in_two["own/same"])


@pytest.fixture(scope="module")
def restored_in_one(killed_job, lone_daemon):
    """One process of 4 devices restores the 2-process jobs, then snapshots "epoch" on."""
    return _outcomes(_run("restore", 1, {"daemons": [lone_daemon.address], "targets": [
        *_targets("diag", "default", ["same", "1d"]),
        *_targets("epoch", "default", ["transposed"], snapshot_on=True),
        *_targets("own", "local", ["same"], kind="own")]}, devices=4))


@pytest.mark.parametrize("label", ["diag/same", "diag/1d", "epoch/transposed"])
def test_two_processes_restore_into_one(restored_in_one, label):
    _assert_restored(restored_in_one[label])


def test_the_restored_job_snapshots_on_under_its_new_world_size(restored_in_one):
    (outcome,) = restored_in_one["epoch/transposed"]
    assert outcome.get("snapshot_on", {}).get("committed") is True, outcome


def test_rank_own_state_is_refused_into_another_world_size(restored_in_one):
    (outcome,) = restored_in_one["own/same"]
    assert "FAILED_PRECONDITION" in outcome.get("error", ""), outcome
    assert "'w'" in outcome["error"] and "only into 2 ranks" in outcome["error"], outcome


@pytest.fixture(scope="module")
def one_to_two(lone_daemon):
    """A job of one process (4 devices, a 2x2 mesh), restored by two processes."""
    args = {"daemons": [lone_daemon.address], "steps": STEPS,
            "jobs": [{"name": "solo", "kind": "global", "mesh": "default"}]}
    (trained,) = _run("train", 1, args, devices=4)
    restored = _run("restore", 2, {"daemons": [lone_daemon.address],
                                   "targets": _targets("solo", "diagonal")})
    return trained, _outcomes(restored)


def test_one_process_restores_into_two(one_to_two):
    trained, restored = one_to_two
    assert trained["copied"]["solo"]["f32"]["job_wide"]  # the whole job's arrays
    for variant in VARIANTS:
        _assert_restored(restored[f"solo/{variant}"])


# -- a ring of two daemons, one per host --------------------------------------------------


@pytest.fixture(scope="module")
def ring_job():
    ring = Ring(2, "--memory-budget", "256MiB", "--keep", "4", own_shm_dir=True)
    try:
        trained = _train_and_kill(ring.addresses, [
            {"name": "ring", "kind": "global", "mesh": "diagonal"}])
        two = _run("restore", 2, {"daemons": ring.addresses,
                                  "targets": _targets("ring", "diagonal")})
        one = _run("restore", 1, {"daemons": ring.addresses[:1],
                                  "targets": _targets("ring", "default", ["same", "1d"])},
                   devices=4)
        yield trained, _outcomes(two), _outcomes(one)
    finally:
        ring.stop()


def test_a_ring_commits_each_step_with_its_replicas(ring_job):
    trained, _, _ = ring_job
    for process in trained:
        assert [s["committed"] for s in process["snapshots"]["ring"]] == [True] * STEPS


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_ring_restores_regions_held_by_the_other_host(ring_job, variant):
    _, two, _ = ring_job
    _assert_restored(two[f"ring/{variant}"])


@pytest.mark.parametrize("variant", ["same", "1d"])
def test_a_ring_restores_two_hosts_into_one(ring_job, variant):
    _, _, one = ring_job
    _assert_restored(one[f"ring/{variant}"])


# -- what the daemon refuses, and what waiting means ---------------------------------------


def _job_wide(rows: tuple[int, int]) -> pb.TensorSpec:
    return pb.TensorSpec(name="w", dtype="float32", global_shape=[8, 8], job_wide=True, shards=[
        pb.ShardSpec(index=[pb.Slice(start=rows[0], stop=rows[1]), pb.Slice(start=0, stop=8)],
                     nbytes=(rows[1] - rows[0]) * 8 * 4)])


def test_layouts_that_cannot_cover_a_job_wide_array_are_refused(daemon):
    daemon.stub.Register(pb.RegisterRequest(job="gap", rank=0, world_size=2,
                                            tensors=[_job_wide((0, 4))]), timeout=10)
    with pytest.raises(grpc.RpcError) as refused:  # rank 1 copies rows 0:4 again, not 4:8
        daemon.stub.Register(pb.RegisterRequest(job="gap", rank=1, world_size=2,
                                                tensors=[_job_wide((0, 4))]), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'w'" in refused.value.details() and "4:8" in refused.value.details()


def test_wait_says_what_it_waited_for(daemon):
    options = ClientOptions(daemon=daemon.address, commit_timeout_seconds=0.5)
    rank0 = NumpyClient("waits", 0, 2, options)
    rank1 = NumpyClient("waits", 1, 2, options)
    arrays = {"x": np.arange(16.0)}
    unwaited = rank0.snapshot(0, arrays, wait=False)
    assert unwaited.taken and unwaited.committed is None and unwaited.waited_for == ""
    rank0.wait()
    alone = rank0.snapshot(1, arrays, wait="job")  # rank 1 has not copied step 1
    assert alone.taken and alone.committed is False and alone.waited_for == "job"
    assert "did not commit step 1" in alone.reason
    last = rank1.snapshot(1, arrays, wait=True)
    assert last.committed is True and last.waited_for == "rank"  # rank 1 completed it
    assert rank0.snapshot(2, arrays, wait="rank").committed is False  # only "not yet"
    job = rank1.snapshot(2, arrays, wait="job")
    assert job.committed is True and job.waited_for == "job" and job.reason == ""
    with pytest.raises(ValueError, match="wait="):
        rank0.snapshot(3, arrays, wait="host")


def test_the_example_resumes_two_processes_in_one_on_another_mesh():
    code, report = run_example("multihost.py", "--steps", "8", "--kill-at", "4",
                               "--resume-mesh", "1x4", timeout=300)
    assert code == 0, report
    assert report["state_matches_snapshot"] is True and report["restored_step"] == 4
    assert (report["processes_before"], report["processes_after"]) == (2, 1)
    assert report["world_size_of_the_step"] == 2 and report["last_snapshot_committed"]
    assert all(n > 0 for n in report["bytes_copied_per_process"])  # both hold model halves
    assert report["restore_seconds"] > 0 and report["final_step"] == 7
