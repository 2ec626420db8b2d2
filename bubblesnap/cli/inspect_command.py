"""``bubblesnap inspect DIR``: the durable tier as an operator sees it, verified on demand.

Lists every job folder under DIR (a daemon's ``--durable-dir``), each step
(finalized or still being written), and for every rank written: its world
size, replica group and tensors (dtype, shape, regions, bytes, checksums).
``--verify`` reads every region back through TensorStore, as a restore does,
and checks it against the checksum it was written with, showing progress
(bytes, rate, time left). Exit status 1 when a step is damaged or the
directory holds no job, 0 otherwise.
"""

import argparse
import json
import os
import sys

from tqdm import tqdm

from bubblesnap.service.durable import format as fmt
from bubblesnap.service.durable import storage
from bubblesnap.service.durable.reader import DurableReader
from bubblesnap.service.errors import DaemonError
from bubblesnap.service.store import regions
from bubblesnap.shared.sizes import human_bytes


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="list (and verify) the steps of a durable tier",
                       description=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", help="a daemon's --durable-dir (a folder, s3://… or gs://…; "
                   "the environment names the store's endpoint and keys)")
    p.add_argument("--job", action="append", default=[],
                   help="only this job (repeatable; default every job folder)")
    p.add_argument("--verify", action="store_true",
                   help="read every region back and check its checksum")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar while verifying")
    p.set_defaults(func=run)


def survey(directory: str, jobs: list[str] | None = None) -> list[dict]:
    """What the durable tier under ``directory`` holds: per job, per step, per rank."""
    names = jobs or [n for n in fmt.jobs(directory) if fmt.step_numbers(directory, n)]
    reader = DurableReader(directory)
    found = []
    for job in names:
        steps = []
        for step in fmt.step_numbers(directory, job):
            ranks = []
            for rank, written in sorted(reader.sidecars(job, step).items()):
                ranks.append({"rank": rank, "world_size": written.world_size,
                              "group": list(written.group), "tensors": [
                                  {"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                                   "job_wide": t.job_wide, "regions": len(t.regions),
                                   "bytes": sum(regions.volume(box) for box in t.regions)
                                   * fmt.numpy_dtype(t.dtype).itemsize,
                                   "checksums": [f"{c:016x}" for c in t.checksums]}
                                  for t in written.tensors]})
            steps.append({"step": step,
                          "finalized": fmt.is_finalized(fmt.step_path(directory, job, step)),
                          "bytes": sum(t["bytes"] for r in ranks for t in r["tensors"]),
                          "ranks": ranks})
        found.append({"job": job, "steps": steps})
    return found


def verify(directory: str, jobs: list[dict], progress: bool) -> list[str]:
    """Reads back every region of every finalized step in ``jobs`` (from
    :func:`survey`) and checks it; the problems found (empty: all intact). Marks each
    step ``verified`` (True, or the first problem)."""
    reader = DurableReader(directory)
    total = sum(s["bytes"] for j in jobs for s in j["steps"] if s["finalized"])
    problems = []
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify",
              disable=not progress, file=sys.stderr) as bar:
        for job in jobs:
            for step in (s for s in job["steps"] if s["finalized"]):
                step["verified"] = True
                for rank in step["ranks"]:
                    for t_index, tensor in enumerate(rank["tensors"]):
                        try:
                            reader.read_shards(job["job"], step["step"], rank["rank"],
                                               [(t_index, r) for r in range(tensor["regions"])])
                        except DaemonError as err:
                            problem = (f"job {job['job']!r} step {step['step']} rank "
                                       f"{rank['rank']}: {err}")
                            problems.append(problem)
                            if step["verified"] is True:
                                step["verified"] = problem
                        bar.update(tensor["bytes"])
    return problems


def run(args) -> int:
    try:
        on_a_filesystem = storage.at(args.directory).renames  # (a prefix has no folder)
    except ValueError as err:
        print(f"bubblesnap inspect: {err}", file=sys.stderr)
        return 1
    if on_a_filesystem and not os.path.isdir(args.directory):
        print(f"bubblesnap inspect: {args.directory} is not a directory", file=sys.stderr)
        return 1
    jobs = survey(args.directory, args.job)
    problems = verify(args.directory, jobs, not args.no_progress) if args.verify else []
    if args.json:
        print(json.dumps({"directory": args.directory, "jobs": jobs, "problems": problems}))
    else:
        print(format_survey(args.directory, jobs))
        for problem in problems:
            print(f"DAMAGED: {problem}")
    if not jobs:
        print(f"bubblesnap inspect: no job folder with steps under {args.directory}",
              file=sys.stderr)
    return 1 if problems or not jobs else 0


def format_survey(directory: str, jobs: list[dict]) -> str:
    """The survey as a person reads it: a line per step, a line per rank's tensors."""
    lines = [f"durable tier {directory}"]
    for job in jobs:
        lines.append(f"job {job['job']}: {len(job['steps'])} steps")
        for step in job["steps"]:
            state = "finalized" if step["finalized"] else "being written (not restorable)"
            check = step.get("verified")
            if check is not None:
                state += ", verified" if check is True else ", DAMAGED"
            lines.append(f"  step {step['step']}: {human_bytes(step['bytes'])}, "
                         f"{len(step['ranks'])} ranks written, {state}")
            for rank in step["ranks"]:
                tensors = ", ".join(f"{t['name']} {t['dtype']}{t['shape']} x{t['regions']}"
                                    for t in rank["tensors"][:6])
                more = len(rank["tensors"]) - 6
                lines.append(f"    rank {rank['rank']}/{rank['world_size']}: {tensors}"
                             + (f" (+{more} more)" if more > 0 else ""))
    return "\n".join(lines)
