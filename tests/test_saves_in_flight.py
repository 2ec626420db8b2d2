"""A step a daemon holds whole survives its trainer (DESIGN's contract): a loop killed
right after ``save(K)`` of a step its policy keeps returned (the daemon holds K
committed, Orbax never finalized the folder) finds K finalized in Orbax's layout within
seconds, by the daemon; plain Orbax lists and restores it, and so does a resumed v0
manager, v1 Checkpointer and emergency manager, bit for bit. In two processes the same;
a process killed before its part reached its daemon leaves K unlisted everywhere. A
daemon that was not watching (restarted) finishes the step when the resumed manager asks.
And the rule that decides (service/durable/finish_rule.py), state in, verdict out."""

import fcntl
import json
import os

import grpc
import pytest

from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.durable import finish_rule
from bubblesnap.shared import checkpoint_record, save_in_flight
from bubblesnap.shared.save_in_flight import Item, Record
from bubblesnap.testing import DaemonProcess, wait_for
from bubblesnap.testing.multihost import JaxJob
from tests.helpers import ROOT

PROGRAM = str(ROOT / "tests" / "programs" / "kill_in_save.py") + ":run"
K = 15
ITEM = {"v0": "state", "v1": "state", "emergency": "state"}


def finalized(directory, step: int) -> bool:
    names = os.listdir(directory)
    return str(step) in names and not any(n.startswith(f"{step}.orbax-checkpoint-tmp")
                                          for n in names)


def committed(daemon, job: str) -> set[int]:
    status = daemon.stub.Status(pb.StatusRequest(job=job), timeout=10)
    return {s.step for s in status.jobs[0].steps if s.committed} if status.jobs else set()


def killed_after_saving(loop: str, directory, daemons, processes: int = 1, crashed=None,
                        **more) -> None:
    """The loop's processes SIGKILLed once each got to its crash (``crashed``: those do;
    the others may be stuck in Orbax's barriers, waiting for them)."""
    args = {"loop": loop, "directory": str(directory), "kill_at": K,
            "daemons": [d.address for d in daemons], **more}
    job = JaxJob(PROGRAM, processes, args, timeout=300)
    assert job.wait_crash(processes=crashed) == [-9] * processes


def resumed(loop: str, directory, daemons, processes: int = 1, how: str = "bubblesnap"):
    args = {"loop": loop, "directory": str(directory), "resume": how,
            "daemons": [d.address for d in daemons]}
    return JaxJob(PROGRAM, processes, args, timeout=300).results()


def assert_orbax_s_own(directory, step: int) -> None:
    """The step holds what Orbax writes (nothing of bubblesnap's in it), its save in flight
    is forgotten (beside it: the folder of steps held in memory only, if any)."""
    for path, dirs, _ in os.walk(directory / str(step)):
        assert ".bubblesnap" not in dirs, path
    assert not os.path.exists(os.path.join(directory, save_in_flight.FOLDER))
    with open(directory / str(step) / "_CHECKPOINT_METADATA") as f:
        metadata = json.load(f)
    assert metadata["commit_timestamp_nsecs"] and metadata["item_handlers"]


@pytest.mark.parametrize("loop", ["v0", "v1", "emergency"])
def test_a_step_the_daemon_holds_whole_survives_its_trainer(start_daemon, tmp_path, loop):
    tier = tmp_path / "tier"
    directory = tier / "run"
    daemon = start_daemon("--durable-dir", str(tier), log_level="INFO")
    killed_after_saving(loop, directory, [daemon])
    assert K in committed(daemon, f"{directory}/{ITEM[loop]}")  # what it held at the kill
    wait_for(lambda: finalized(directory, K), f"step {K} finalized by the daemon")
    assert "finalized step 15" in daemon.stderr_text()
    assert_orbax_s_own(directory, K)
    (plain,) = resumed(loop, directory, [daemon], how="orbax")
    assert (plain["latest"], plain["bit_for_bit"], plain["items_match"]) == (K, True, True)
    (ours,) = resumed(loop, directory, [daemon])
    assert (ours["latest"], ours["bit_for_bit"], ours["items_match"]) == (K, True, True)
    assert K in ours["all_steps"] and plain["all_steps"][-1] == K


def test_a_resumed_manager_has_its_daemon_finish_what_no_daemon_watched(tmp_path, shm_dirs):
    """The trainer dies while its daemon is frozen; a live trainer's lock (held here)
    keeps the thawed daemon from finalizing; that daemon is killed after its write, and a
    new one on its shared memory knows nothing of the save: the resumed manager asks it
    to finish the step before listing, and restores it from memory."""
    tier, shm = tmp_path / "tier", shm_dirs()
    directory = tier / "run"
    flags = ("--durable-dir", str(tier), "--shm-dir", shm)
    socket = f"unix://{tmp_path}/daemon.sock"
    with DaemonProcess(*flags, "--listen", socket, stderr=tmp_path / "first.log") as daemon:
        job = JaxJob(PROGRAM, 1, {"loop": "v0", "directory": str(directory), "kill_at": K,
                                  "daemons": [socket]}, timeout=300)
        job.wait_crash(kill=False)
        daemon.freeze()
        job.kill()
        lock = os.open(save_in_flight.folder(str(directory), K) + "/" + save_in_flight.LOCK,
                       os.O_RDWR)
        fcntl.lockf(lock, fcntl.LOCK_EX)  # stands for a trainer that still lives
        daemon.thaw()
        item = directory / f"{K}.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp"
        wait_for((item / ".bubblesnap" / "rank_0.json").exists, "the daemon's write")
        daemon.kill()
    os.close(lock)
    assert not finalized(directory, K)
    with DaemonProcess(*flags, "--listen", socket, metrics="127.0.0.1:0",
                       stderr=tmp_path / "restarted.log") as restarted:
        (ours,) = resumed("v0", directory, [restarted])
        assert (ours["latest"], ours["bit_for_bit"], ours["items_match"]) == (K, True, True)
        assert finalized(directory, K)
        assert restarted.restores_served().get("memory", 0) >= 1
    assert_orbax_s_own(directory, K)


def test_two_processes_killed_after_the_save_find_the_step_whole(start_daemon, tmp_path):
    tier = tmp_path / "tier"
    directory = tier / "run"
    daemons = [start_daemon("--durable-dir", str(tier), name=f"host{i}") for i in range(2)]
    killed_after_saving("v0", directory, daemons, processes=2)
    wait_for(lambda: finalized(directory, K), f"step {K} finalized by process 0's daemon")
    assert_orbax_s_own(directory, K)
    for result in resumed("v0", directory, daemons, processes=2):
        assert (result["latest"], result["bit_for_bit"], result["items_match"]) == \
            (K, True, True)


def test_a_process_killed_before_its_part_was_whole_leaves_the_step_unlisted(start_daemon,
                                                                             tmp_path):
    tier = tmp_path / "tier"
    directory = tier / "run"
    daemons = [start_daemon("--durable-dir", str(tier), log_level="INFO", name=f"host{i}")
               for i in range(2)]
    item = directory / f"{K}.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp"
    # process 0's save returns and waits in Orbax's barrier for process 1, which crashed in
    # its save: the job is killed once process 0's daemon wrote its part
    killed_after_saving("v0", directory, daemons, processes=2, crash_in_save=[1, K],
                        crashed=[1], part_written=str(item / ".bubblesnap" / "rank_0.json"))
    wait_for(lambda: not os.path.exists(save_in_flight.folder(str(directory), K)),
             f"step {K} given up by process 0's daemon")
    assert f"dropped step {K}" in daemons[0].stderr_text()
    assert not (directory / str(K)).exists()
    for result in resumed("v0", directory, daemons, processes=2):
        assert (result["latest"], result["bit_for_bit"]) == (10, True)
        assert K not in result["all_steps"]
    (plain,) = resumed("v0", directory, daemons[:1], how="orbax")
    assert plain["latest"] == 10 and K not in plain["all_steps"]


def test_the_record_a_daemon_reads_names_only_folders_of_its_manager(start_daemon, tmp_path):
    """A record that is not one, or names a folder elsewhere, is refused with a precise
    status, and nothing is watched."""
    tier = tmp_path / "tier"
    directory = str(tier / "run")
    daemon = start_daemon("--durable-dir", str(tier))
    good = record(directory)
    bad = {
        "another directory": good.__class__(**{**good.__dict__, "directory": "/etc"}),
        "a step folder outside": good.__class__(**{**good.__dict__, "final": "/etc/15"}),
        "an item elsewhere": good.__class__(**{**good.__dict__, "items": (
            Item("state", f"{directory}/x/state.orbax-checkpoint-tmp",
                 good.items[0].final, "ocdbt"),)}),
    }
    for name, wrong in bad.items():
        path = write_record(wrong, directory)
        with pytest.raises(grpc.RpcError) as raised:
            daemon.stub.FinishSave(pb.FinishSaveRequest(record=path), timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert len(raised.value.details()) <= 1024
    for path, code in (("relative/record.json", grpc.StatusCode.INVALID_ARGUMENT),
                       (f"{tmp_path}/elsewhere/.bubblesnap/pending/15/record.json",
                        grpc.StatusCode.FAILED_PRECONDITION),
                       (f"{directory}/.bubblesnap/pending/16/record.json",
                        grpc.StatusCode.NOT_FOUND)):
        with pytest.raises(grpc.RpcError) as raised:
            daemon.stub.FinishSave(pb.FinishSaveRequest(record=path), timeout=10)
        assert raised.value.code() == code, path
    assert daemon.healthy()  # still serving


# -- the rule -----------------------------------------------------------------------------


def record(directory: str = "/run", world: int = 2) -> Record:
    tmp = f"{directory}/15.orbax-checkpoint-tmp"
    return Record(directory=directory, step=15, world_size=world, tmp=tmp,
                  final=f"{directory}/15",
                  items=(Item("state", f"{tmp}/state.orbax-checkpoint-tmp", f"{tmp}/state",
                              "ocdbt"),
                         Item("meta", f"{tmp}/meta.orbax-checkpoint-tmp", f"{tmp}/meta")),
                  metadata={})


def write_record(rec: Record, directory: str) -> str:
    folder = save_in_flight.folder(directory, rec.step)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, save_in_flight.RECORD)
    with open(path, "w") as f:
        f.write(rec.to_json())
    return path


def seen(**more) -> finish_rule.Seen:
    return finish_rule.Seen(**{"tmp_exists": True, "final_exists": False, **more})


WHOLE = {"sidecars": {"state": {0, 1}}, "done": {0: ("meta",), 1: ("meta",)}}


def test_a_whole_step_is_finalized_once_its_trainer_is_gone():
    assert finish_rule.judge(record(), seen(**WHOLE), gone_for=None).action == "wait"
    assert finish_rule.judge(record(), seen(**WHOLE), gone_for=0.0).action == "finalize"
    assert finish_rule.judge(record(), seen(finalizing=True), gone_for=0.0).action == \
        "finalize"  # its answers are gone while it is being finalized
    done = finish_rule.judge(record(), seen(tmp_exists=False, final_exists=True), 0.0)
    assert done.action == "finalized"
    assert finish_rule.judge(record(), seen(tmp_exists=False), 0.0).action == "drop"


def test_a_part_that_never_reached_a_daemon_drops_the_step_after_the_grace():
    part_missing = seen(sidecars={"state": {0}}, done=WHOLE["done"])
    timing = finish_rule.Timing(grace=5, parts_wait=120)
    assert finish_rule.judge(record(), part_missing, 1.0, timing=timing).action == "wait"
    verdict = finish_rule.judge(record(), part_missing, 5.0, timing=timing)
    assert verdict.action == "drop" and "process 1's part of 'state'" in verdict.why
    assert finish_rule.judge(record(), part_missing, 0.0, finish_now=True).action == "drop"
    no_marker = seen(sidecars={"state": {0, 1}}, done={0: ("meta",)})
    assert finish_rule.judge(record(), no_marker, 0.0, finish_now=True).action == "drop"


def test_a_part_being_written_is_waited_for_then_given_up():
    writing = seen(sidecars={"state": {0}}, writing={"state": {1}}, done=WHOLE["done"])
    timing = finish_rule.Timing(grace=5, parts_wait=120)
    assert finish_rule.judge(record(), writing, 60.0, finish_now=True,
                             timing=timing).action == "wait"
    assert finish_rule.judge(record(), writing, 120.0, timing=timing).action == "drop"
    failed = seen(**WHOLE, failed={"state": {1}})
    assert finish_rule.judge(record(), failed, 0.0).action == "drop"


def test_a_record_naming_folders_elsewhere_is_refused():
    rec = record()
    assert Record.from_json(rec.to_json(), "/run") == rec
    for broken in ('{"format": "x"}', "[]", rec.to_json().replace('"world_size": 2',
                                                                   '"world_size": 0')):
        with pytest.raises(ValueError):
            Record.from_json(broken, "/run")
    with pytest.raises(ValueError):
        Record.from_json(rec.to_json(), "/elsewhere")
    escaping = rec.to_json().replace("15.orbax-checkpoint-tmp/meta.orbax-checkpoint-tmp",
                                     "../meta")
    with pytest.raises(ValueError):
        Record.from_json(escaping, "/run")


def test_a_part_whose_writer_died_is_not_waited_for(tmp_path, monkeypatch):
    """A write in progress keeps its ``.writing`` marker fresh; one whose daemon was
    killed (the soak's seed 1017: the primary's daemon died mid-write, and the resumed
    job waited the whole parts_wait for it) leaves it stale, and the step's parts count
    it as never coming: a resumed job drops the step at once."""
    from bubblesnap.service.durable import persist, save_finisher

    rec = record(str(tmp_path / "run"))
    state = rec.items[0].tmp
    os.makedirs(os.path.join(state, ".bubblesnap"))
    monkeypatch.setattr(persist, "WRITING_REFRESH_SECONDS", 0.05)
    marker = os.path.join(state, checkpoint_record.writing_file(1))
    with persist.writing(state, 1):
        os.utime(marker, (0, 0))  # as old as can be: the refresh makes it fresh again
        wait_for(lambda: persist.writing_alive(marker), "the marker refreshed")
        assert save_finisher._seen(rec, str(tmp_path)).writing["state"] == {1}
    os.utime(marker, (0, 0))  # its writer gone for long
    seen_now = save_finisher._seen(rec, str(tmp_path))
    assert seen_now.writing["state"] == frozenset()
    assert finish_rule.judge(rec, seen_now, 0.0, finish_now=True).action == "drop"
