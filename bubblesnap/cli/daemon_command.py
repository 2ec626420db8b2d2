"""``bubblesnap daemon``: its flags (defaults from the options dataclasses), the options
they make, and running the daemon with them."""

import argparse
import logging
import os
import sys

from bubblesnap.shared.sizes import human_bytes, parse_bytes
from bubblesnap.shared.trainer_api import TOKEN_ENV


def add_parser(sub) -> None:
    """Adds ``bubblesnap daemon``: every flag takes its default from the options."""
    from bubblesnap.service import DaemonOptions, DiscoveryOptions
    from bubblesnap.service.durable.policy import COMPRESSIONS
    d, found = DaemonOptions(), DiscoveryOptions()
    s, planner, peer, durable_d = d.store, d.bubbles.planner, d.peers, d.durable
    p = sub.add_parser(
        "daemon", help="run the per-host snapshot daemon",
        description="Run the per-host bubblesnap daemon. It holds training snapshots in shared "
                    "memory (so they outlive a crashed trainer) and serves them back on restore. "
                    "Prints one JSON line with its addresses when ready; SIGTERM stops it "
                    "gracefully and frees its shared memory.")
    p.add_argument("--listen", default=d.listen, metavar="unix:PATH|HOST:PORT",
                   help="gRPC address for trainers and tools: a Unix socket only this user "
                        "can open (its folder is made 0700 if missing), or TCP (port 0 picks "
                        "a free one), where any local user can connect and Restore (not "
                        "alone) and DeleteSnapshots need --trainer-token-file "
                        f"(default {d.listen}, where clients look by default)")
    p.add_argument("--trainer-token-file", default="", metavar="FILE",
                   help="file holding the token that trainer calls over TCP must carry to "
                        "drop snapshots (Restore not alone, DeleteSnapshots; clients: "
                        f"ClientOptions.token or {TOKEN_ENV}); without one those calls are "
                        f"refused over TCP with UNAUTHENTICATED. {TOKEN_ENV} works too")
    p.add_argument("--rpc-threads", type=int, default=d.rpc_threads, metavar="N",
                   help="threads doing the work of trainer calls; restores and waits for a "
                        f"commit have as many again (default {d.rpc_threads}; a Bubbles "
                        "stream holds none between its messages)")
    p.add_argument("--max-streams", type=int, default=d.max_streams, metavar="N",
                   help="Bubbles streams (one per pipeline stage) open at once; more are "
                        f"refused with RESOURCE_EXHAUSTED (default {d.max_streams})")
    p.add_argument("--memory-budget", type=parse_bytes, default=s.memory_budget_bytes,
                   metavar="SIZE", help="shared memory the daemon may hold, e.g. 16GiB; new "
                   "snapshots beyond it are refused with RESOURCE_EXHAUSTED (default "
                   f"{human_bytes(s.memory_budget_bytes)}; capped to the free space of --shm-dir)")
    p.add_argument("--warm-pool-bytes", type=parse_bytes, default=s.warm_pool_bytes,
                   metavar="SIZE", help="pre-faulted shared memory kept ready for copies that "
                   "arrive (a peer's, a restore's), inside --memory-budget; size it to one "
                   "rank's state for restores at the wire's speed (default "
                   f"{human_bytes(s.warm_pool_bytes)}: none)")
    p.add_argument("--shm-dir", default=d.shm_dir, metavar="DIR",
                   help=f"tmpfs directory for snapshot memory (default {d.shm_dir})")
    p.add_argument("--keep", type=int, default=s.keep_steps, metavar="N",
                   help=f"committed steps kept per job (default {s.keep_steps})")
    p.add_argument("--training-log-budget", type=parse_bytes, default=d.logs.max_rank_bytes,
                   metavar="SIZE", help="training-log records kept per job and rank, oldest "
                   f"dropped first (default {human_bytes(d.logs.max_rank_bytes)})")
    p.add_argument("--boundary-log-budget", type=parse_bytes,
                   default=d.logs.max_boundary_rank_bytes, metavar="SIZE",
                   help="boundary-log records (the tensors a pipeline stage sent) kept per job "
                   "and rank over all its streams, oldest steps dropped first; the records of "
                   "the oldest kept snapshot's step and older are dropped anyway (no stage "
                   "replays them). Held apart from --memory-budget "
                   f"(default {human_bytes(d.logs.max_boundary_rank_bytes)})")
    p.add_argument("--log-budget", type=parse_bytes, default=d.logs.max_total_bytes,
                   metavar="SIZE", help="log records of every job, rank and stream together "
                   "(process memory, apart from --memory-budget); records that would pass it "
                   "are refused with RESOURCE_EXHAUSTED and what is held is kept (default "
                   f"{human_bytes(d.logs.max_total_bytes)})")
    p.add_argument("--metrics", default=d.metrics, metavar="HOST:PORT",
                   help=f"Prometheus endpoint; port 0 picks one; '' disables (default {d.metrics})")
    p.add_argument("--max-message", type=parse_bytes, default=d.max_message_bytes,
                   metavar="SIZE", help=f"largest gRPC message accepted (default "
                   f"{human_bytes(d.max_message_bytes)})")
    p.add_argument("--checksum-threads", type=int, default=s.checksum_threads, metavar="N",
                   help=f"threads hashing shards, cutting the regions of a restore "
                        f"onto another mesh and pre-faulting fresh segments the daemon fills "
                        f"(default {s.checksum_threads})")
    p.add_argument("--max-interval", type=int, default=planner.max_interval,
                   metavar="N", help="longest snapshot interval the bubble planner may choose; "
                   "what does not fit into N iterations' bubbles is copied at the end of the "
                   "interval while training waits. 1: a snapshot every iteration "
                   f"(default {planner.max_interval})")
    p.add_argument("--nice", type=int, default=d.nice, metavar="N",
                   help="raise the daemon's niceness by N (0..19) so training processes win "
                        "every contended core and the daemon runs in their idle time (default "
                        f"{d.nice}; 0 keeps the inherited priority)")
    p.add_argument("--verify-on-commit", action="store_true",
                   help="re-hash committed bytes even when the client sent checksums (by default "
                        "client checksums are trusted at commit and every copy is verified "
                        "before it is served)")
    peers = p.add_argument_group(
        "peers", "Replicate every committed copy to the next daemons in a ring so a lost host "
        "is restored from a neighbour. Every daemon of the group gets the same --peers list "
        "(peer addresses, ring order) and its own --index; a replacement host takes the dead "
        "one's index with its new address and announces itself.")
    peers.add_argument("--peers", default="", metavar="ADDR,ADDR,...",
                       help="peer addresses of all daemons in ring order, this one's included")
    peers.add_argument("--peers-file", default="", metavar="FILE",
                       help="the same, one address per line ('#' starts a comment)")
    # None: not given, which --peers-from-dns needs to know (it derives the index).
    peers.add_argument("--index", type=int, default=None, metavar="N",
                       help=f"this daemon's position in the peer list (default {peer.index})")
    peers.add_argument("--peers-from-dns", default=found.service, metavar="NAME:PORT",
                       help="instead of --peers and --index: the daemons are the addresses "
                            "DNS lists for NAME (a Kubernetes headless Service), all on the "
                            "peer port PORT, in ring order by IP address; this daemon's index "
                            "is its --own-address's place among them")
    peers.add_argument("--own-address", default=found.own_address, metavar="IP",
                       help="with --peers-from-dns: this daemon's IP as DNS lists it (in "
                            "Kubernetes the pod's status.podIP)")
    peers.add_argument("--peers-expected", type=int, default=found.expected, metavar="N",
                       help="with --peers-from-dns: the number of daemons; the daemon waits "
                            "until DNS lists exactly N, itself among them, unchanged for "
                            f"{found.settle_seconds:g} s, so that all decide on one ring")
    peers.add_argument("--discovery-timeout", type=float, default=found.timeout_seconds,
                       metavar="T", help="with --peers-from-dns: seconds to wait for that "
                       f"before giving up (default {found.timeout_seconds:g})")
    etcd = peer.coordination
    peers.add_argument("--coordination", default=etcd.url, metavar="etcd://HOST:PORT[,...]",
                       help="instead of --peers: the group meets in this etcd cluster. Each "
                            "daemon takes a ring position under a lease (a dead daemon's "
                            "frees when the lease runs out, --dead-after), publishes what it "
                            "holds as keys and learns the group from watches; needs "
                            "--group-size and --peer-listen (the address peers dial). "
                            "Default: the static ring of --peers, no server needed")
    peers.add_argument("--coordination-prefix", default=etcd.prefix, metavar="KEY",
                       help=f"the group's keys in etcd; one prefix per group (default "
                            f"{etcd.prefix})")
    peers.add_argument("--group-size", type=int, default=etcd.group_size, metavar="N",
                       help="with --coordination: the ring's positions, one per daemon")
    peers.add_argument("--name", default=etcd.name, metavar="NAME",
                       help="with --coordination: this daemon's stable name; a daemon that "
                            "restarts under it takes its old ring position (default: its "
                            "--peer-listen address)")
    peers.add_argument("--dead-after", type=float, default=peer.dead_after_seconds,
                       metavar="T", help="seconds of silence (the static ring) or of a lapsed "
                       f"etcd lease after which a peer is dead and its copies are made again "
                       f"elsewhere (default {peer.dead_after_seconds:g})")
    peers.add_argument("--peer-call-timeout", type=float, default=peer.call_timeout_seconds,
                       metavar="T", help="seconds a small peer call (a Join, log records, a "
                       "holdings query) waits for its answer before the peer counts as having "
                       "missed it; raise it on a slow or distant network (default "
                       f"{peer.call_timeout_seconds:g})")
    peers.add_argument("--replicas", type=int, default=peer.replicas, metavar="K",
                       help="copies pushed to the next K daemons; a step is committed when "
                            f"every rank has 1+K copies (default {peer.replicas})")
    peers.add_argument("--spread-restores", action=argparse.BooleanOptionalAction,
                       default=peer.spread_restores,
                       help="pull a copy that several live peers hold from all of them at "
                            "once; --no-spread-restores: from one (default "
                            f"{'on' if peer.spread_restores else 'off'})")
    pacing = peer.pacing
    peers.add_argument("--pace-replication", action=argparse.BooleanOptionalAction,
                       default=pacing.in_bubbles,
                       help="push each new copy while every pipeline stage reporting bubbles "
                            "to this daemon is in one, so replication does not compete with "
                            "activations (BAFT); jobs without bubbles are not held (default "
                            f"{'on' if pacing.in_bubbles else 'off'}: push at the commit)")
    peers.add_argument("--pace-max-wait", type=float, default=pacing.max_wait_seconds,
                       metavar="SECONDS",
                       help="with --pace-replication: the longest a new copy waits for a "
                            f"bubble before it is pushed anyway (default "
                            f"{pacing.max_wait_seconds:g})")
    peers.add_argument("--group-name", default=peer.group_name, metavar="NAME",
                       help="the name every peer call carries; calls naming another group "
                            "are refused. Give each group its own where groups can reach "
                            "each other's addresses (default: the --coordination-prefix "
                            "with etcd, else 'bubblesnap')")
    peers.add_argument("--peer-listen", default=peer.listen, metavar="HOST:PORT",
                       help="bind the peer port here instead of at this daemon's --peers entry")
    peers.add_argument("--data-listen", default=peer.data_listen, metavar="HOST:PORT",
                       help="bulk data channel (default: the peer host, a free port)")
    peers.add_argument("--peer-token-file", default="", metavar="FILE",
                       help="file holding the shared token every peer call must carry; calls "
                            "without it get UNAUTHENTICATED. The environment variable "
                            "BUBBLESNAP_PEER_TOKEN works too (a file keeps it out of ps)")
    peers.add_argument("--peer-tls-cert", default="", metavar="PEM",
                       help="this daemon's certificate: peer calls and data use TLS")
    peers.add_argument("--peer-tls-key", default="", metavar="PEM", help="its private key")
    peers.add_argument("--peer-tls-ca", default="", metavar="PEM",
                       help="CA certificate that signed every daemon's certificate")
    peers.add_argument("--peer-tls-client-auth", action="store_true",
                       help="mutual TLS: peers must present a certificate signed by the CA")
    durable = p.add_argument_group(
        "durable tier", "Write committed steps as standard Orbax checkpoints, in the "
        "background: a CheckpointManager's steps as its own policy says, into its directory "
        "(which must lie inside --durable-dir); bubblesnap's own clients' steps as "
        "--durable-every-steps/--durable-every-seconds say, into <durable-dir>/<job>/step_N "
        "(loadable with orbax.checkpoint.StandardCheckpointer().restore(path), no daemon "
        "needed); the last resort of a restore.")
    durable.add_argument("--durable-dir", default=durable_d.directory, metavar="DIR",
                         help="where to write (shared storage every host sees): a folder, "
                         "s3://BUCKET/PREFIX (endpoint and keys from AWS_ENDPOINT_URL, "
                         "AWS_ACCESS_KEY_ID, ... or IRSA) or gs://BUCKET/PREFIX (Google's "
                         "application default credentials); empty: off")
    durable.add_argument("--durable-every-steps", type=int, default=durable_d.every_steps,
                         metavar="N",
                         help="bubblesnap's own clients: write steps that are multiples of N "
                         "(all hosts pick the same; default 0: none)")
    durable.add_argument("--durable-every-seconds", type=float,
                         default=durable_d.every_seconds, metavar="T",
                         help="bubblesnap's own clients: also write the next committed step "
                         "once T seconds passed (default 0: never)")
    durable.add_argument("--durable-keep", type=int, default=durable_d.keep, metavar="N",
                         help=f"durable steps kept per rank (default {durable_d.keep})")
    durable.add_argument("--durable-write-batch", type=parse_bytes,
                         default=durable_d.write_batch_bytes, metavar="SIZE",
                         help="bytes written between commits to the checkpoint's database: "
                         "what bounds the memory a write takes beside what the daemon holds "
                         "(a few times this); raise it where each commit is slow, NFS or a "
                         f"bucket mount (default {human_bytes(durable_d.write_batch_bytes)})")
    durable.add_argument("--durable-compression", choices=COMPRESSIONS,
                         default=durable_d.compression,
                         help="how chunks are stored: none, or zstd (Orbax's default: fewer "
                         "bytes stored for the host's CPU on every write and restore; float "
                         f"weights shrink little) (default {durable_d.compression})")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=_run_daemon)


def _ring(args) -> tuple[tuple[str, ...], int]:
    """The peer addresses and this daemon's index: given, or found from DNS."""
    from bubblesnap.service import DiscoveryError, DiscoveryOptions, PeerOptions, discover
    if args.peers and args.peers_file:
        raise SystemExit("give --peers or --peers-file, not both")
    if args.peers_from_dns:
        if args.peers or args.peers_file or args.index is not None:
            raise SystemExit("--peers-from-dns finds the peers and this daemon's index: give "
                             "no --peers, --peers-file or --index with it")
        options = DiscoveryOptions(service=args.peers_from_dns, own_address=args.own_address,
                                   expected=args.peers_expected,
                                   timeout_seconds=args.discovery_timeout)
        try:
            return discover(options)
        except DiscoveryError as err:
            raise SystemExit(f"--peers-from-dns {args.peers_from_dns}: {err}") from None
    addresses = [a.strip() for a in args.peers.split(",") if a.strip()]
    if args.peers_file:
        lines = _read_text(args.peers_file, "--peers-file").splitlines()
        addresses = [a for a in (line.split("#", 1)[0].strip() for line in lines) if a]
    return tuple(addresses), PeerOptions().index if args.index is None else args.index


def _peer_options(args):
    from bubblesnap.service import CoordinationOptions, PacingOptions, PeerOptions, PeerSecurity
    if args.coordination:
        if args.peers or args.peers_file or args.peers_from_dns:
            raise SystemExit("--coordination finds the peers in etcd: give no --peers, "
                             "--peers-file or --peers-from-dns with it")
        addresses, index = (), -1 if args.index is None else args.index
    else:
        addresses, index = _ring(args)
    token = os.environ.get("BUBBLESNAP_PEER_TOKEN", "")
    if args.peer_token_file:
        token = _read_text(args.peer_token_file, "--peer-token-file").strip()
        if not token:
            raise SystemExit(f"--peer-token-file {args.peer_token_file} is empty")
    for path, flag in ((args.peer_tls_cert, "--peer-tls-cert"),
                       (args.peer_tls_key, "--peer-tls-key"), (args.peer_tls_ca, "--peer-tls-ca")):
        if path:
            _read_text(path, flag)
    security = PeerSecurity(token=token, tls_cert=args.peer_tls_cert, tls_key=args.peer_tls_key,
                            tls_ca=args.peer_tls_ca,
                            require_client_cert=args.peer_tls_client_auth)
    etcd = CoordinationOptions(url=args.coordination, prefix=args.coordination_prefix,
                               group_size=args.group_size, name=args.name)
    pacing = PacingOptions(in_bubbles=args.pace_replication, max_wait_seconds=args.pace_max_wait)
    return PeerOptions(peers=addresses, index=index, listen=args.peer_listen,
                       data_listen=args.data_listen, replicas=args.replicas, security=security,
                       group_name=args.group_name,
                       coordination=etcd, dead_after_seconds=args.dead_after,
                       call_timeout_seconds=args.peer_call_timeout,
                       spread_restores=args.spread_restores, pacing=pacing)


def _trainer_token(args) -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if args.trainer_token_file:
        token = _read_text(args.trainer_token_file, "--trainer-token-file").strip()
        if not token:
            raise SystemExit(f"--trainer-token-file {args.trainer_token_file} is empty")
    return token


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as err:
        raise SystemExit(f"{flag} {path}: {err.strerror}") from err


def daemon_options(args):
    """The DaemonOptions the parsed ``daemon`` flags ask for; ValueError if they are bad."""
    from bubblesnap.service import (
        BubbleOptions,
        DaemonOptions,
        DurableOptions,
        LogOptions,
        PlannerOptions,
        StoreOptions,
    )
    return DaemonOptions(
        listen=args.listen, trainer_token=_trainer_token(args), metrics=args.metrics,
        shm_dir=args.shm_dir, nice=args.nice, rpc_threads=args.rpc_threads,
        max_streams=args.max_streams,
        store=StoreOptions(memory_budget_bytes=args.memory_budget, keep_steps=args.keep,
                           checksum_threads=args.checksum_threads,
                           verify_on_commit=args.verify_on_commit,
                           warm_pool_bytes=args.warm_pool_bytes),
        bubbles=BubbleOptions(planner=PlannerOptions(max_interval=args.max_interval)),
        max_message_bytes=args.max_message,
        logs=LogOptions(max_rank_bytes=args.training_log_budget,
                        max_boundary_rank_bytes=args.boundary_log_budget,
                        max_total_bytes=args.log_budget),
        peers=_peer_options(args),
        durable=DurableOptions(directory=args.durable_dir, every_steps=args.durable_every_steps,
                               every_seconds=args.durable_every_seconds,
                               keep=args.durable_keep,
                               write_batch_bytes=args.durable_write_batch,
                               compression=args.durable_compression))


def _run_daemon(args) -> int:
    from bubblesnap.run import orbax_patch
    from bubblesnap.shared import huge_malloc
    huge_malloc.reexec()  # once, before any thread or buffer: the flags parsed, the rest not
    from bubblesnap.service import DaemonStartError, run
    orbax_patch.uninstall()  # a switch inherited from a launcher is the trainers', not ours
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return run(daemon_options(args))
    except (ValueError, DaemonStartError) as err:
        raise SystemExit(f"bubblesnap daemon: {err}") from None
