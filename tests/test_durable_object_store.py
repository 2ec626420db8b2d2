"""The durable tier on object storage (``--durable-dir s3://…``, ``gs://…``), against a
real S3 server (SeaweedFS from its wheel) and a GCS emulator (fake-gcs-server from its
wheel), both started by the tests: the storage's contract on all three storages, steps
written at their final name and listed only once marked whole, read back by a new
daemon and by plain Orbax, and what the store's faults leave."""

import os
import re
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from bubblesnap.clients import RestoreError
from bubblesnap.clients.jax import ClientOptions, SnapshotClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable import storage
from bubblesnap.service.durable.reader import DurableReader
from bubblesnap.testing import wait_for
from bubblesnap.testing.object_stores import S3_KEYS, SeaweedS3
from tests import test_multihost as multihost
from tests.programs.trainer import state_at
from tests.test_durable import assert_state, other_target

ROWS = 32


def status(daemon, job=""):
    return daemon.stub.Status(pb.StatusRequest(job=job), timeout=10)


def durable_steps(daemon, job):
    return list(status(daemon, job).jobs[0].durable_steps)


def download(url: str, into) -> None:
    """Every object under ``url`` copied into the folder ``into`` (as ``aws s3 sync``)."""
    import obstore

    where = storage.at(url)
    for chunk in obstore.list(where._store, storage.split_url(url)[2] + "/"):
        for entry in chunk:
            relative = entry["path"][len(storage.split_url(url)[2]) + 1:]
            target = os.path.join(into, relative)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(where.read(f"{where.scheme}://{where.bucket}/{entry['path']}"))


@pytest.fixture(params=["posix", "s3", "gs"])
def any_storage(request, tmp_path):
    """A folder of each kind of storage the durable tier has."""
    if request.param == "posix":
        return str(tmp_path / "tier")
    return request.getfixturevalue(f"{'gcs' if request.param == 'gs' else 's3'}_url")


def test_every_storage_keeps_the_same_contract(any_storage):
    where, root = storage.at(any_storage), any_storage
    where.make_folder(root)
    assert where.names(root) == [] and not where.holds_any(f"{root}/a")
    assert where.modified(f"{root}/a/x") is None and not where.exists(f"{root}/a/x")
    with pytest.raises(FileNotFoundError):
        where.read(f"{root}/a/x")
    before = time.time()
    where.write(f"{root}/a/x", b"one")
    where.write(f"{root}/a/x", b"two")  # replaced whole
    assert where.read(f"{root}/a/x") == b"two"
    assert before - 2 <= where.modified(f"{root}/a/x") <= time.time() + 2
    # created only if absent: exactly one of two creators gets the lock
    assert where.create(f"{root}/a/lock", b"first") is True
    assert where.create(f"{root}/a/lock", b"second") is False
    assert where.read(f"{root}/a/lock") == b"first"
    where.write(f"{root}/a/b/y", b"y")
    assert where.names(root) == ["a"] and where.names(root, folders=True) == ["a"]
    assert sorted(where.names(f"{root}/a")) == ["b", "lock", "x"]
    assert where.names(f"{root}/a", folders=True) == ["b"]
    where.remove(f"{root}/a/lock")
    assert not where.exists(f"{root}/a/lock") and where.holds_any(f"{root}/a")
    where.remove(f"{root}/a")  # a folder and everything in it
    assert not where.holds_any(f"{root}/a") and not where.exists(f"{root}/a/b/y")
    assert where.kvstore(f"{root}/a")["path"].rstrip("/").endswith("a")


def five_steps_keeping_one(start_daemon, server, url):
    """Steps 0-4 of job "dur" snapshotted into a daemon writing every second step to
    ``url``, keeping one: returns once step 4 alone is there, steps 0 and 2 retired
    (their marker first, then every object), nothing ever written under a temporary name
    to be renamed. (daemon, its flags, the storage, the job's folder.)"""
    flags = ("--durable-dir", url, "--durable-every-steps", "2", "--durable-keep", "1")
    daemon = start_daemon(*flags, env=server.env)
    client = SnapshotClient("dur", options=ClientOptions(daemon=daemon.address))
    for step in range(5):
        assert client.snapshot(step, state_at(step, ROWS), wait=True).taken
    client.close()
    store, job = storage.at(url), f"{url}/dur"
    wait_for(lambda: durable_steps(daemon, "dur") == [4]
             and not store.holds_any(f"{job}/step_0") and not store.holds_any(f"{job}/step_2"),
             f"step 4 alone in {url}", timeout=60)
    assert not store.holds_any(f"{job}/.bubblesnap")
    return daemon, flags, store, job


def assert_a_new_daemon_restores_step_4(start_daemon, server, flags) -> None:
    """A new daemon (the host rebooted: nothing in memory) restores step 4 from the store
    onto two devices instead of four."""
    fresh = start_daemon(*flags, env=server.env)
    restored = SnapshotClient("dur", options=ClientOptions(daemon=fresh.address)).restore(
        other_target())
    assert (restored.step, restored.source) == (4, "durable")
    assert_state(restored.state, 4)


def test_steps_are_written_at_their_name_marked_last_and_restored_from_the_store(
        start_daemon, s3_server, s3_url, tmp_path):
    daemon, flags, store, job = five_steps_keeping_one(start_daemon, s3_server, s3_url)
    assert store.exists(f"{job}/step_4/commit_success.txt")
    assert store.exists(f"{job}/step_4/.bubblesnap/complete.json")

    # Plain Orbax reads it once the step's folder is copied out of the bucket.
    download(f"{job}/step_4", tmp_path / "step_4")
    assert_state(ocp.StandardCheckpointer().restore(tmp_path / "step_4", other_target()), 4)

    daemon.kill()
    assert_a_new_daemon_restores_step_4(start_daemon, s3_server, flags)


def test_an_unmarked_step_is_not_listed_and_a_later_write_replaces_it(
        start_daemon, s3_server, s3_url):
    """What a daemon killed mid-write leaves (a step's objects, no marker) counts for
    nothing: not listed, not restored; written again whole by the next daemon."""
    daemon = start_daemon("--durable-dir", s3_url, "--durable-every-steps", "1",
                          env=s3_server.env)
    client = SnapshotClient("torn", options=ClientOptions(daemon=daemon.address))
    assert client.snapshot(0, state_at(0, ROWS), wait=True).taken
    wait_for(lambda: durable_steps(daemon, "torn") == [0], "step 0 on S3", timeout=60)
    client.close()
    daemon.kill()
    store, step_dir = storage.at(s3_url), f"{s3_url}/torn/step_0"
    store.remove(f"{step_dir}/.bubblesnap/complete.json")  # as if killed before its marker
    assert fmt.finalized_steps(s3_url, "torn") == {}

    again = start_daemon("--durable-dir", s3_url, "--durable-every-steps", "1",
                         env=s3_server.env)
    client = SnapshotClient("torn", options=ClientOptions(daemon=again.address))
    with pytest.raises(RestoreError, match=r"NOT_FOUND|no step"):
        client.restore(other_target())  # nothing whole anywhere
    assert client.snapshot(0, state_at(0, ROWS), wait=True).taken
    wait_for(lambda: durable_steps(again, "torn") == [0], "step 0 written again", timeout=60)
    assert_state(ocp.StandardCheckpointer().restore(_copied(step_dir), other_target()), 0)


def _copied(url):
    import tempfile

    folder = tempfile.mkdtemp(prefix="bubblesnap-s3-copy-")
    download(url, folder)
    return folder


@pytest.mark.parametrize("fault", ["wrong secret key", "missing bucket"])
def test_a_store_that_refuses_the_daemon_is_said_in_status_and_backed_off(
        start_daemon, s3_server, s3_url, fault):
    env = dict(s3_server.env)
    url = s3_url
    if fault == "wrong secret key":
        env["AWS_SECRET_ACCESS_KEY"] = "not-" + S3_KEYS["AWS_SECRET_ACCESS_KEY"]
        expected = r"403|Forbidden|SignatureDoesNotMatch|AccessDenied"
    else:
        url = s3_url.replace(s3_server.url, "s3://no-such-bucket")
        expected = r"404|NoSuchBucket|not found"
    daemon = start_daemon("--durable-dir", url, "--durable-every-steps", "1", env=env,
                          log_level="INFO")
    client = SnapshotClient("refused", options=ClientOptions(daemon=daemon.address))
    started = time.monotonic()
    for step in range(20):  # training goes on, in memory, a step every 0.3 s
        assert client.snapshot(step, state_at(step, ROWS), wait=True).taken
        time.sleep(0.3)
    elapsed = time.monotonic() - started
    wait_for(lambda: status(daemon).durable_error, "the failure in Status", timeout=60)
    said = status(daemon).durable_error
    assert re.search(expected, said), said
    assert url in said or "refused" in said or "failed" in said, said
    assert durable_steps(daemon, "refused") == []
    # Back-off: tried again, a few times in the seconds the 20 steps took (the waits
    # double from 2 s), not once per step.
    tries = daemon.stderr_text().count("bubblesnap.daemon ERROR durable: ")
    assert 2 <= tries <= 1 + int(elapsed / 2), (tries, elapsed, daemon.stderr_text()[-3000:])


def test_the_store_killed_during_a_write_leaves_no_step_listed_that_is_not_whole(
        start_daemon, tmp_path, monkeypatch):
    """SeaweedFS SIGKILLed while a daemon writes a step to it, then started again: no
    step is ever listed that does not read back whole; training never waits; a later
    step is written whole; the torn step is gone or whole."""
    rows = 32768  # 84 MB a step: a write lasts long enough to be cut
    server = SeaweedS3(str(tmp_path / "s3"))
    try:
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)
        url = f"{server.url}/killed"
        daemon = start_daemon("--durable-dir", url, "--durable-every-steps", "1",
                              "--durable-keep", "2", env=server.env)
        client = SnapshotClient("kill", options=ClientOptions(daemon=daemon.address))
        reader = DurableReader(url)
        seen: set[int] = set()

        def listed():  # unbounded (the reader's own listing gives up after 2 s)
            return sorted(fmt.finalized_steps(url, "kill"))

        def check_listed():
            for step in listed():
                if step not in seen:  # every region read back, checksums verified
                    copies = reader.step_layouts("kill", step)
                    for rank, copy in copies.items():
                        reader.read_shards("kill", step, rank, [
                            (t, s) for t, tensor in enumerate(copy.layout.tensors)
                            for s in range(len(tensor.shards))])
                    seen.add(step)

        step = 0
        assert client.snapshot(step, state_at(step, rows), wait=True).taken
        cut = wait_for(lambda: status(daemon).in_flight, "a durable write in flight",
                       timeout=60, interval=0.005)[0].step
        server.kill()
        for step in range(1, 4):  # the store is down: training goes on, in memory
            assert client.snapshot(step, state_at(step, rows), wait=True).taken
        server.start()
        for step in range(4, 12):
            assert client.snapshot(step, state_at(step, rows), wait=True).taken
            check_listed()
            if any(s > cut for s in listed()):
                break
            time.sleep(1.0)  # the writer's back-off: steps keep coming, as in training
        wait_for(lambda: check_listed() or any(s > cut for s in listed()),
                 "a step after the cut written whole", timeout=120)
        check_listed()
        store = storage.at(url)
        assert cut in seen or not store.exists(f"{url}/kill/step_{cut}/.bubblesnap/complete.json")
        # restored from the store alone, bit for bit
        daemon.kill()
        fresh = start_daemon("--durable-dir", url, env=server.env)
        restored = SnapshotClient("kill", options=ClientOptions(daemon=fresh.address)).restore(
            {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
             for k, v in state_at(0, rows).items()})
        assert restored.source == "durable"
        expected = state_at(restored.step, rows)
        for name, array in restored.state.items():
            assert np.asarray(array).tobytes() == np.asarray(expected[name]).tobytes(), name
    finally:
        server.kill()


def test_a_two_process_job_saved_to_s3_restores_onto_one_process_after_memory_is_lost(
        start_daemon, s3_server, s3_url):
    """jax.distributed, two processes of two devices each (a diagonal mesh: neither
    process's devices contiguous), written to S3; the daemon killed (its memory gone);
    one process of four devices restores from the store, bit for bit."""
    flags = ("--durable-dir", s3_url, "--durable-every-steps", "1")
    daemon = start_daemon(*flags, env=s3_server.env)
    multihost._train_and_kill([daemon.address],
                              [{"name": "diag", "kind": "global", "mesh": "diagonal"}])
    wait_for(lambda: multihost.STEPS - 1 in durable_steps(daemon, "diag"),
             "the last step on S3", timeout=120)
    daemon.kill()
    fresh = start_daemon(*flags, env=s3_server.env)
    restored = multihost._outcomes(multihost._run("restore", 1, {
        "daemons": [fresh.address],
        "targets": multihost._targets("diag", "default", ["same", "1d"])}, devices=4))
    for label in ("diag/same", "diag/1d"):
        multihost._assert_restored(restored[label])
        assert [o["source"] for o in restored[label]] == ["durable"], restored[label]


def test_on_gcs_plain_orbax_restores_a_step_in_place_and_a_new_daemon_from_the_store(
        start_daemon, gcs_server, gcs_url):
    daemon, flags, _, job = five_steps_keeping_one(start_daemon, gcs_server, gcs_url)
    # Orbax's own reader, on the gs:// path (its GCS TensorStore driver and gcsfs)
    assert_state(ocp.StandardCheckpointer().restore(f"{job}/step_4", other_target()), 4)
    daemon.kill()
    assert_a_new_daemon_restores_step_4(start_daemon, gcs_server, flags)


def test_a_host_cut_off_from_the_store_says_so_the_others_write_on_and_it_catches_up(
        start_cluster, monkeypatch):
    """The cluster lab: two hosts (network namespaces) and an S3 server on a third. Host
    0 is partitioned from the store, then healed; then the store's link is slowed.
    Training never waits; host 1 writes on; host 0 says why in Status, writes nothing
    torn, and writes again once healed; every step listed reads back whole."""
    url = "s3://bubblesnap/lab"
    cluster = start_cluster(2, "--replicas", "1", "--durable-dir", url,
                            "--durable-every-steps", "1", s3=True)
    for name, value in cluster.s3.env.items():
        monkeypatch.setenv(name, value)
    reader = DurableReader(url)
    clients = {job: SnapshotClient(job, options=ClientOptions(daemon=daemon.address))
               for job, daemon in zip("ab", cluster.daemons, strict=True)}
    step = 0

    def snapshot():
        nonlocal step
        for client in clients.values():
            assert client.snapshot(step, state_at(step, ROWS), wait=True).taken
        step += 1

    def newest(job):  # unbounded (the reader's own listing gives up after 2 s)
        return max(fmt.finalized_steps(url, job), default=-1)

    snapshot()
    wait_for(lambda: newest("a") == newest("b") == 0, "step 0 of both jobs on S3", timeout=60)
    cluster.partition([0], ["s3"])
    while not status(cluster.daemons[0]).durable_error:  # training goes on meanwhile
        snapshot()
        time.sleep(0.5)
        assert step < 400, "host 0 never said it cannot write"
    assert newest("b") >= 1 and newest("a") == 0  # the other host wrote on; host 0 nothing
    cut_at = step
    cluster.heal()
    while newest("a") < cut_at:  # its back-off ends; the next step it writes is whole
        snapshot()
        time.sleep(0.5)
        assert step < cut_at + 400, status(cluster.daemons[0]).durable_error
    wait_for(lambda: not status(cluster.daemons[0]).durable_error, "the failure cleared")

    cluster.slow("s3", "40mbit")  # a slow store: slower writes, training as before
    slow_from = step
    snapshot()
    wait_for(lambda: min(newest("a"), newest("b")) >= slow_from, "a step through the slow link",
             timeout=120)
    for job in "ab":  # every step listed reads back whole, verified against its checksums
        assert fmt.finalized_steps(url, job)
        for listed in sorted(fmt.finalized_steps(url, job)):
            for rank, copy in reader.step_layouts(job, listed).items():
                reader.read_shards(job, listed, rank, [
                    (t, s) for t, tensor in enumerate(copy.layout.tensors)
                    for s in range(len(tensor.shards))])


def test_our_manager_lists_and_restores_orbax_steps_on_gcs(start_daemon, gcs_server, gcs_url):
    """Steps plain Orbax's CheckpointManager saved to gs://, listed and restored by
    bubblesnap's (Orbax writes the bucket: the daemons write only into a local
    --durable-dir); its own saves held in the daemon's memory too (a step whose arrays
    are gone from the bucket restores from memory), listed by plain Orbax."""
    import jax.numpy as jnp

    from bubblesnap.clients.jax import CheckpointManager, CheckpointManagerOptions, ClientOptions

    daemon = start_daemon(env=gcs_server.env)
    with ocp.CheckpointManager(gcs_url) as theirs:
        for step in range(3):
            theirs.save(step, args=ocp.args.StandardSave({"x": jnp.full((4,), 10.0 + step)}))
        theirs.wait_until_finished()
    options = CheckpointManagerOptions(client=ClientOptions(daemon=daemon.address))
    with CheckpointManager(gcs_url, options=options) as ours:
        assert list(ours.all_steps()) == [0, 1, 2]
        assert float(np.asarray(ours.restore(2)["x"])[0]) == 12.0
        ours.save(3, args=ocp.args.StandardSave({"x": jnp.full((4,), 13.0)}))
        ours.wait_until_finished()
    with ocp.CheckpointManager(gcs_url) as theirs:
        assert list(theirs.all_steps()) == [0, 1, 2, 3]
        assert float(np.asarray(theirs.restore(3)["x"])[0]) == 13.0
    held = {job.job: job.latest_committed_step for job in status(daemon).jobs}
    assert held == {f"{gcs_url}/default": 3}, held
    store = storage.at(gcs_url)  # step 3's arrays gone from the bucket: only memory has them
    for name in store.names(f"{gcs_url}/3/default"):
        if name.startswith("ocdbt.process_") or name == "d":
            store.remove(f"{gcs_url}/3/default/{name}")
    with CheckpointManager(gcs_url, options=options) as ours:
        assert float(np.asarray(ours.restore(3)["x"])[0]) == 13.0
    with pytest.raises(Exception), ocp.CheckpointManager(gcs_url) as theirs:  # noqa: B017
        theirs.restore(3)  # (Orbax's own error, whichever it is: the arrays are gone)
