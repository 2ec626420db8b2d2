"""``bubblesnap status`` (what a daemon holds, once or as it changes) and ``bubblesnap
health`` (whether it serves)."""

import json
import signal
import sys
import threading

from bubblesnap.shared.sizes import human_bytes


def add_status_parser(sub):
    from bubblesnap.clients import ClientOptions
    c = ClientOptions()
    p = sub.add_parser(
        "status", help="show what a daemon holds",
        description="Show the snapshots a daemon holds: per job, step and rank, whether the "
                    "step is committed (every rank holds it) and how much memory it uses.")
    p.add_argument("--daemon", default=c.daemon, metavar="unix:PATH|HOST:PORT",
                   help=f"daemon address (default {c.daemon}: this user's daemon)")
    p.add_argument("--job", default="", help="only this job")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--timeout", type=float, default=c.rpc_timeout_seconds,
                   help=f"seconds to wait (default {c.rpc_timeout_seconds:g})")
    p.add_argument("--watch", type=float, nargs="?", const=1.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 1) until interrupted (Ctrl-C)")
    p.set_defaults(func=_run_status)


def add_health_parser(sub):
    from bubblesnap.clients import ClientOptions
    from bubblesnap.service.daemon import SERVICE_NAME
    c = ClientOptions()
    p = sub.add_parser(
        "health", help="exit 0 if a daemon serves, 1 if not (for probes)",
        description="Ask a daemon's gRPC health service whether it serves (the check a "
                    "Kubernetes or systemd probe runs over the daemon's Unix socket, which a "
                    "gRPC probe of the kubelet cannot dial). Prints the status.")
    p.add_argument("--daemon", default=c.daemon, metavar="unix:PATH|HOST:PORT",
                   help=f"daemon address (default {c.daemon}: this user's daemon)")
    p.add_argument("--service", default=SERVICE_NAME,
                   help=f"the service asked about (default {SERVICE_NAME}; '' the server)")
    p.add_argument("--timeout", type=float, default=c.rpc_timeout_seconds,
                   help=f"seconds to wait (default {c.rpc_timeout_seconds:g})")
    p.set_defaults(func=_run_health)


def _run_health(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(args.daemon) as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"bubblesnap health: {args.daemon}: {err.code().name}: {err.details()}",
                  file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    print(status)
    return 0 if answer.status == health_pb2.HealthCheckResponse.SERVING else 1


def _run_status(args) -> int:
    import grpc

    from bubblesnap.protos import daemon_pb2_grpc
    if args.watch is not None and args.watch <= 0:
        print("bubblesnap status: --watch takes a number of seconds > 0", file=sys.stderr)
        return 2
    interrupted = threading.Event()
    if args.watch is not None:
        # Ctrl-C ends the watch between redraws. A KeyboardInterrupt raised wherever the
        # main thread is could land inside gRPC's own code holding one of its locks, and
        # closing the channel then waited on it for ever (seen: no output, no exit).
        signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    with grpc.insecure_channel(args.daemon) as channel:
        return _show_status(daemon_pb2_grpc.DaemonStub(channel), args, interrupted)


def _show_status(stub, args, interrupted: threading.Event) -> int:
    """Prints the daemon's status once, or every ``--watch`` seconds until
    ``interrupted``."""
    import grpc
    from google.protobuf import json_format

    from bubblesnap.protos import daemon_pb2
    while not interrupted.is_set():
        try:
            status = stub.Status(daemon_pb2.StatusRequest(job=args.job), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"bubblesnap status: {args.daemon}: {err.code().name}: {err.details()}",
                  file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(json_format.MessageToDict(
                status, always_print_fields_with_no_presence=True),
                indent=None if args.watch else 2), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                print("\x1b[H\x1b[J", end="")  # the table redrawn in place
            print(format_status(status), flush=True)
        if args.watch is None:
            return 0
        interrupted.wait(args.watch)
    return 0


def _pages(mem) -> str:
    """", 2 MiB pages (tmpfs huge=within_size)": the pages segments get (nothing from a
    daemon that predates the fields)."""
    if not mem.shm_page_bytes:
        return ""
    from bubblesnap.service.store.pages import SharedPages
    return ", " + SharedPages(mem.shm_filesystem, mem.shm_huge, mem.shm_page_bytes).describe()


def format_status(status) -> str:
    """A readable table of a StatusResponse."""
    from bubblesnap.protos import daemon_pb2
    mem = status.memory
    warm = f" ({human_bytes(mem.warm_bytes)} warm of {human_bytes(mem.warm_pool_bytes)})" \
        if mem.warm_pool_bytes else ""
    lines = [f"memory: {human_bytes(mem.used_bytes)} used, "
             f"{human_bytes(mem.pooled_bytes)} pooled{warm}, "
             f"budget {human_bytes(mem.budget_bytes)}; {mem.shm_dir} has "
             f"{human_bytes(mem.shm_free_bytes)} free{_pages(mem)}; logs hold "
             f"{human_bytes(mem.log_bytes)}"
             + (f" of {human_bytes(mem.log_budget_bytes)}" if mem.log_budget_bytes else "")]
    lines += _adoption_lines(status.adoption)
    lines += [in_flight_line(w) for w in status.in_flight]
    if status.durable_error:
        lines.append(f"durable tier {status.durable_directory}: {status.durable_error}")
    lines += [f"save in flight: {note}" for note in status.durable_notes]
    if not status.jobs:
        lines.append("no jobs registered")
    for job in status.jobs:
        latest = job.latest_committed_step if job.latest_committed_step >= 0 else "none"
        lines.append("")
        lines.append(f"job {job.job}: {len(job.registered_ranks)}/{job.world_size} ranks "
                     f"registered, latest committed step {latest}")
        if job.plan.version:
            lines.append(f"  bubble plan: a snapshot every {job.plan.interval} step(s), "
                         f"predicted overhead {100 * job.plan.predicted_overhead:.2f}%")
        if job.replicas:
            lines.append(f"  peers: {1 + job.replicas} copies wanted per step and rank")
        if job.replication:
            lines.append(_replication_line(job.replication))
        if job.durable_steps:
            lines.append(f"  durable tier holds steps {list(job.durable_steps)}")
        if job.coverage.missing:
            lines.append(f"  job-wide arrays NOT covered (no step can commit): "
                         f"{'; '.join(job.coverage.missing)}")
        elif not job.coverage.known:
            lines.append("  job-wide arrays: coverage not judged yet (some ranks' layouts "
                         "unknown here)")
        lines.append(f"  {'step':>8}  {'committed':<9}  {'rank':>4}  {'state':<8}  "
                     f"{'copies':>6}  {'shards':>6}  {'bytes':>10}  "
                     f"{'bubble ms offered/used/spilled':>30}")
        for step in job.steps:
            for rank in step.ranks:
                u = rank.usage
                usage = (f"{1e3 * u.offered_seconds:.1f}/{1e3 * u.used_seconds:.1f}/"
                         f"{1e3 * u.spilled_seconds:.1f}" if u.bubbles or u.spilled_bytes
                         else "-")
                state = daemon_pb2.CopyState.Name(rank.state) + ("*" if rank.replica else "")
                lines.append(f"  {step.step:>8}  {'yes' if step.committed else 'no':<9}  "
                             f"{rank.rank:>4}  {state:<8}  {rank.copies or '-':>6}  "
                             f"{len(rank.shards):>6}  {human_bytes(rank.nbytes):>10}  {usage:>30}")
        if any(r.replica for st in job.steps for r in st.ranks):
            lines.append("  (* a replica held for a peer's rank)")
        for rank, others in sorted({(r.rank, tuple(r.held_for))
                                    for st in job.steps for r in st.ranks if r.held_for}):
            lines.append(f"  ranks {list(others)} are held through rank {rank}'s copies "
                         "(data-parallel replicas, copied once)")
        for c in job.corrupt_copies:
            lines.append(f"  corrupt copy skipped: step {c.step} rank {c.rank} from {c.source}: "
                         f"{c.detail}")
    return "\n".join(lines)


def in_flight_line(work) -> str:
    """'persist of step 4 of rank 0 of j: 120.0 MiB of 256.0 MiB (47%), 510 MB/s, 0.3 s left'."""
    rate = work.done_bytes / work.seconds if work.seconds > 0 else 0.0
    left = f", {(work.total_bytes - work.done_bytes) / rate:.1f} s left" if rate > 0 else ""
    share = 100 * work.done_bytes / work.total_bytes if work.total_bytes else 100.0
    return (f"in flight: {work.kind} of step {work.step} of rank {work.rank} of {work.job}: "
            f"{human_bytes(work.done_bytes)} of {human_bytes(work.total_bytes)} "
            f"({share:.0f}%), {rate / 1e6:.0f} MB/s{left}")


def _replication_line(pushes) -> str:
    """The latest pushes of a job's new copies in one line: in bubbles, waits, commit latency."""
    sent = sum(p.nbytes for p in pushes)
    idle = 100 * sum(p.idle_bytes for p in pushes) / sent if sent else 0.0
    paced = "paced into bubbles" if pushes[-1].paced else "not paced"
    return (f"  replication ({paced}), last {len(pushes)} pushes: {idle:.0f}% of the bytes sent "
            f"in bubbles, waited {max(p.waited_seconds for p in pushes) * 1e3:.0f} ms at most, "
            f"1 + k copies {max(p.copies_seconds for p in pushes) * 1e3:.0f} ms after the "
            "commit at most")

def _adoption_lines(adoption) -> list[str]:
    """What the daemon took over from a killed one at its start (nothing: no lines)."""
    if not adoption.directories:
        return []
    lines = [f"adopted at start: {len(adoption.adopted)} copies "
             f"({human_bytes(adoption.adopted_bytes)}) in {adoption.seconds:.3f} s from "
             f"{', '.join(adoption.directories)}; dropped {len(adoption.dropped)} files "
             f"({human_bytes(adoption.dropped_bytes)})"]
    lines += [f"  dropped {f.path}: {f.reason}" for f in adoption.dropped[:10]]
    if len(adoption.dropped) > 10:
        lines.append(f"  ... and {len(adoption.dropped) - 10} more dropped (see --json)")
    lines += [f"  kept {f.path}: {f.reason}" for f in adoption.kept]
    return lines
