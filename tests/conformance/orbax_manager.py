"""Orbax's CheckpointManager test file, unchanged, against bubblesnap's manager.

Usage::

    python -m tests.conformance.orbax_manager --orbax-src ORBAX_CHECKOUT [--target orbax]
        [-k EXPR] [--daemon-flags "..."] [--json]

``ORBAX_CHECKOUT``: a google/orbax source tree at the release matching the installed
orbax-checkpoint (its ``checkpoint/orbax/checkpoint/checkpoint_manager_test.py``; the
test-only modules the wheel lacks are taken from it). The file is copied, unchanged,
into a work folder and run by pytest in one process with 8 forced CPU devices,
``CheckpointManager`` and ``CheckpointManagerOptions`` bound to bubblesnap's and a
daemon per test (``tests/conformance/orbax_plugin.py``); ``--target orbax`` runs plain
Orbax the same way. It prints each failure's reason class and the counts (``--json``:
one JSON document).
"""

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_FILE = os.path.join("checkpoint", "orbax", "checkpoint", "checkpoint_manager_test.py")

#: What the plugin counts of the paths pytree items took (orbax_plugin.COUNTS).
PATHS = ("daemon_saves", "orbax_saves", "memory_restores", "orbax_restores")
#: Reason classes, tried in order on a failure's report: (class, pattern).
CLASSES = [
    ("private attribute", re.compile(
        r"AttributeError: '(?:CheckpointManager|CheckpointManagerOptions)' object has no "
        r"attribute '_")),
    ("mocked internal", re.compile(r"unittest/mock\.py|mock\.patch|assert_called|call_count")),
    ("exception type", re.compile(r"AssertionError: \w+ not raised|Raises(?:Regex)?|"
                                  r"\"[^\"]*\" does not match")),
    ("assertion", re.compile(r"AssertionError|assert ")),
]


def classify(error: str) -> str:
    """The reason class of a failure's report, or the exception that ended it."""
    for name, pattern in CLASSES:
        if pattern.search(error):
            return name
    raised = re.findall(r"^E\s+(\w+(?:\.\w+)*(?:Error|Exception|Exit))\b", error, re.M)
    return f"error: {raised[-1]}" if raised else "error"


def last_line(error: str) -> str:
    lines = [ln[1:].strip() for ln in error.splitlines() if ln.startswith("E ")]
    return (lines[0] if lines else error.strip().splitlines()[-1] if error.strip() else "")[:200]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orbax-src", required=True,
                        help="a google/orbax source tree (the checkout's root)")
    add_run_arguments(parser, "manager")
    args = parser.parse_args(argv)
    source = os.path.join(os.path.abspath(args.orbax_src), TEST_FILE)
    if not os.path.isfile(source):
        parser.error(f"{source} does not exist: --orbax-src names the root of a google/orbax "
                     "checkout")
    with work_folder(args, "bubblesnap-orbax-conformance-") as work:
        return _run(args, source, work)


@contextlib.contextmanager
def work_folder(args, prefix: str):
    """``args.work`` (made if missing, kept), else a fresh folder removed after."""
    work = args.work or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(work, exist_ok=True)
    try:
        yield work
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


def add_run_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """The options of a conformance run: whose ``what`` the tests run against, which
    tests, each daemon's flags, the work folder, JSON output."""
    parser.add_argument("--target", choices=("bubblesnap", "orbax"), default="bubblesnap",
                        help=f"whose {what} the tests run against (default bubblesnap)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest's -k: some tests")
    parser.add_argument("--daemon-flags", default="",
                        help="extra flags for each test's daemon (default: none, its defaults)")
    parser.add_argument("--work", default=None,
                        help="the work folder (default: a fresh one, removed after)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def _run(args, source: str, work: str) -> int:
    shutil.copy(source, os.path.join(work, os.path.basename(source)))
    return run_tests(args, os.path.basename(source), work,
                     {"BUBBLESNAP_CONFORMANCE_ORBAX_SRC": os.path.dirname(source)})


def run_tests(args, test_files, work: str, env: dict, processes: int = 1) -> int:
    """Runs ``test_files`` (a name or a list of names, in ``work``) under the plugin,
    ``args.target`` against ``args.keyword``; prints the failures and counts
    (``args.json``: one document).

    ``processes`` > 1: that many pytest processes joined by ``jax.distributed`` (8 CPU
    devices among them), as Orbax's run_multihost.py starts a multi-process test, each
    with its own daemon of one static ring started here for the whole run (its
    ``--durable-dir`` the tests' temp root); a test failed in any process failed."""
    with open(os.path.join(work, "pytest.ini"), "w") as f:
        f.write("[pytest]\naddopts = -p no:cacheprovider\n")
    tmp = os.path.join(work, "tmp")
    os.makedirs(tmp, exist_ok=True)
    reports = [os.path.join(work, f"report-{i}.jsonl") for i in range(processes)]
    env = {**os.environ,
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // processes}",
           "TEST_TMPDIR": tmp,
           "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
           "BUBBLESNAP_CONFORMANCE_TARGET": args.target,
           "BUBBLESNAP_CONFORMANCE_DAEMON_FLAGS": args.daemon_flags, **env}
    command = [sys.executable, "-m", "pytest", "-q", "--import-mode=importlib",
               "-p", "tests.conformance.orbax_plugin", "-c", os.path.join(work, "pytest.ini"),
               "--rootdir", work,
               *([test_files] if isinstance(test_files, str) else test_files)]
    if args.keyword:
        command += ["-k", args.keyword]
    if processes > 1:  # a test one process failed leaves the others at its barriers
        command += ["--timeout", "300"]
    with contextlib.ExitStack() as stack:
        each = [{"BUBBLESNAP_CONFORMANCE_REPORT": report} for report in reports]
        if processes > 1:
            from bubblesnap.testing import DaemonProcess, Ring, free_port
            coordinator = f"127.0.0.1:{free_port()}"
            for i, extra in enumerate(each):
                extra["BUBBLESNAP_CONFORMANCE_PROCESS"] = f"{i}/{processes}@{coordinator}"
            if args.target == "bubblesnap":
                started = iter(range(1000))

                def start(*flags, **options):  # each daemon's log a file of its own
                    log = os.path.join(work, f"daemon-{next(started)}.log")
                    return DaemonProcess(*flags, stderr=log, log_level="INFO", **options)
                ring = Ring(processes, "--durable-dir", tmp, *args.daemon_flags.split(),
                            start=start)
                stack.callback(ring.stop)
                for extra, daemon in zip(each, ring.daemons, strict=True):
                    extra["BUBBLESNAP_DAEMON"] = daemon.address
        logs = [open(os.path.join(work, f"pytest-{i}.log"), "w+") for i in range(processes)]
        for log in logs:
            stack.enter_context(log)
        procs = [subprocess.Popen(command, cwd=work, env={**env, **extra}, stdout=log,
                                  stderr=subprocess.STDOUT, text=True)
                 for extra, log in zip(each, logs, strict=True)]
        for proc in procs:
            proc.wait()
        outcomes = read_outcomes(reports)
        if not outcomes:
            logs[0].seek(0)
            print(logs[0].read()[-5000:], file=sys.stderr)
            return 2
    return summarize(args, outcomes)


def read_outcomes(reports: list[str]) -> dict:
    """Each test's outcome, from the plugin's reports (one per process): failed where any
    process failed it, with that process's report."""
    outcomes = {}
    for report in reports:
        if not os.path.exists(report):
            continue
        with open(report) as f:
            for line in f:
                entry = json.loads(line)
                known = outcomes.get(entry["test"])
                if known is None or (entry["outcome"] == "failed" and
                                     known["outcome"] != "failed"):
                    outcomes[entry["test"]] = entry
    return outcomes


def summarize(args, outcomes: dict) -> int:
    """Prints the failures, their classes and the counts (``args.json``: one document);
    0 when none failed."""
    failures = {name: {"class": classify(e.get("error", "")),
                       "why": last_line(e.get("error", ""))}
                for name, e in outcomes.items() if e["outcome"] == "failed"}
    counts = collections.Counter(e["outcome"] for e in outcomes.values())
    paths = {key: sum(e.get(key, 0) for e in outcomes.values()) for key in PATHS}
    result = {"target": args.target, "tests": len(outcomes), "passed": counts["passed"],
              "failed": counts["failed"], "skipped": counts["skipped"],
              "by_class": dict(collections.Counter(f["class"] for f in failures.values())),
              "items": paths, "failures": failures}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name, failure in sorted(failures.items()):
            print(f"FAILED {name}  [{failure['class']}]  {failure['why']}")
        print(f"{args.target}: {result['passed']} passed, {result['failed']} failed, "
              f"{result['skipped']} skipped of {result['tests']}; by class: "
              f"{result['by_class']}")
        if args.target == "bubblesnap":
            print("pytree items: {daemon_saves} saved through the daemon, {orbax_saves} by "
                  "Orbax itself; {memory_restores} restored from the daemons' memory, "
                  "{orbax_restores} read by Orbax".format(**paths))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
