"""Every benchmark still runs: each one, as a program, with --quick --json.

The reports carry the keys docs/development/benchmarks.md documents, every
ratio is a finite number and every correctness check inside a benchmark
holds. No timing is asserted: --quick numbers mean nothing. Some benchmarks
also run a variant (``VARIANTS``: overhead.py on a Cluster with --link-rate),
where this machine can run it.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
PROGRAMS = ("adoption", "datapath", "durable_write", "gpu", "group_scale", "load", "log_cost",
            "manager", "overhead", "plan_scale", "restore", "sick_daemon")
#: Runs beyond each program's plain --quick: name -> (program, its extra flags).
VARIANTS = {"overhead_link_rate": ("overhead", ("--link-rate", "1gbit")),
            "durable_write_s3": ("durable_write", ("--store", "s3")),
            "durable_write_gcs": ("durable_write", ("--store", "gcs")),
            "restore_gcs": ("restore", ("--store", "gcs"))}


def variant_unavailable(name: str) -> str | None:
    """Why variant ``name`` cannot run here (one line), or None."""
    if name != "overhead_link_rate":
        return None  # the stores are the dev dependencies' servers
    from bubblesnap.testing import cluster
    return cluster.unavailable()


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory, request):
    """Every benchmark whose test runs (all, unless some were deselected) started at once
    with --quick --json, as a user would run it.

    A quick run is mostly process start-up and compilation, largely on one
    core, so side by side they take little longer than the slowest alone.
    Yields name -> (process, stdout path, stderr path); stops what still runs.
    """
    out = tmp_path_factory.mktemp("benchmarks")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # conftest forces 4
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    wanted = {name: (name, ()) for name in PROGRAMS if name in selected}
    wanted.update((name, run) for name, run in VARIANTS.items()
                  if name in selected and variant_unavailable(name) is None)
    runs = {}
    for name, (program, flags) in wanted.items():
        stdout, stderr = out / f"{name}.out", out / f"{name}.err"
        with open(stdout, "w") as o, open(stderr, "w") as e:
            runs[name] = (subprocess.Popen(
                [sys.executable, str(BENCHMARKS / f"{program}.py"), "--quick", "--json",
                 *flags], stdout=o, stderr=e, env=env), stdout, stderr)
    yield runs
    for proc, _, _ in runs.values():
        if proc.poll() is None:
            proc.terminate()  # a benchmark that started daemons stops them on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def report_of(run) -> dict:
    """The benchmark's report: the JSON object on the last line of its stdout."""
    proc, stdout, stderr = run
    proc.wait(timeout=300)
    errors = stderr.read_text()[-5000:]
    assert proc.returncode == 0, errors
    lines = stdout.read_text().strip().splitlines()
    assert lines, errors
    return json.loads(lines[-1])


def assert_finite(values, what: str) -> None:
    for key, value in values.items():
        assert isinstance(value, (int, float)) and math.isfinite(value), f"{what}.{key}: {value}"


def assert_bandwidth_modes(report: dict, modes) -> None:
    assert list(report["modes"]) == list(modes)
    for mode, row in report["modes"].items():
        assert set(row) == {"median_gbps", "min_gbps", "max_gbps", "median_ms"}, mode
        assert_finite(row, mode)
        assert 0 < row["min_gbps"] <= row["median_gbps"] <= row["max_gbps"], (mode, row)


def check_datapath(report: dict) -> None:
    assert_bandwidth_modes(report, ("memcpy_warm", "memcpy_fresh", "stage_stall",
                                    "stage_commit", "restore_local", "orbax_save",
                                    "orbax_restore"))
    assert set(report["ratios"]) == {
        "staging_vs_memcpy_warm", "stall_vs_memcpy_warm", "restore_vs_memcpy_fresh",
        "restore_vs_memcpy_warm", "restore_vs_orbax_restore", "staging_vs_orbax_save"}
    assert_finite(report["ratios"], "ratios")
    assert all(isinstance(met, bool) for met in report["meets_targets"].values())
    assert report["restore_matches"] is True
    assert list(report["phases"]) == ["stage_stall", "stage_commit", "restore_local"]
    # a save copies into the segment the last commit reserved (clients/save_lane.py), or
    # begins one (BeginStep) where another mode's save took the reservation
    assert "copy" in report["phases"]["stage_stall"]
    assert set(report["phases"]["stage_stall"]) <= {"begin", "copy"}
    assert {"copy", "commit"} <= set(report["phases"]["stage_commit"]) <= {
        "begin", "copy", "commit"}
    assert {"call", "map", "place", "ready", "daemon.holdings"} <= set(
        report["phases"]["restore_local"])


def check_restore(report: dict) -> None:
    modes = ("raw_tcp", "raw_tcp_parallel", "peer_transfer", "restore_local",
             "restore_local_resharded", "restore_local_2to1", "restore_peer",
             "restore_peer_2holders", "restore_peer_resharded", "restore_peer_2to1",
             "restore_durable", "orbax_restore", "orbax_restore_resharded")
    assert "error" not in report, report
    assert_bandwidth_modes(report, modes)
    assert_machine_memory(report)
    assert set(report["ratios"]) == {
        "peer_transfer_vs_raw_tcp", "restore_peer_vs_orbax", "restore_peer_vs_peer_transfer",
        "restore_peer_vs_raw_tcp_parallel", "restore_peer_2holders_vs_raw_tcp_parallel",
        "restore_peer_2holders_vs_restore_peer", "restore_local_vs_orbax",
        "restore_durable_vs_orbax", "resharded_vs_same_local",
        "resharded_vs_same_peer", "2to1_vs_same_local", "2to1_vs_same_peer",
        "restore_local_resharded_vs_orbax", "restore_peer_resharded_vs_orbax",
        "restore_local_2to1_vs_orbax", "restore_peer_2to1_vs_orbax"}
    assert_finite(report["ratios"], "ratios")
    assert set(report["meets_targets"]) == {
        "peer_transfer_ge_50pct_raw_tcp", "restore_peer_ge_5x_orbax_restore",
        "resharded_local_ge_50pct_same", "resharded_peer_ge_50pct_same",
        "2to1_local_ge_50pct_same", "2to1_peer_ge_50pct_same",
        "restore_peer_ge_80pct_raw_tcp_parallel", "restore_durable_ge_orbax",
        "restore_local_ge_20x_orbax"}
    assert all(isinstance(met, bool) for met in report["meets_targets"].values())
    assert report["matches"] == dict.fromkeys(modes, True)
    restoring = [m for m in modes if m.startswith("restore_")]
    assert list(report["phases"]) == restoring
    for mode in restoring:  # the client's phases, and the daemon's under its own names
        assert {"call", "map", "place", "ready", "daemon.holdings"} <= set(report["phases"][mode])
        assert_finite(report["phases"][mode], mode)
    # every restore, Orbax's too, ran on some CPU of this process or a daemon
    assert set(report["cpu"]) == set(restoring) | {"orbax_restore", "orbax_restore_resharded"}
    assert all(row["median_ms"] > 0 and row["cores_busy"] > 0 for row in report["cpu"].values())
    # a peer restore pulls a copy; one from the durable tier reads regions
    for mode in ("restore_peer", "restore_peer_2holders"):
        assert {"daemon.open", "daemon.receive", "daemon.land"} <= set(report["phases"][mode])
    # C pulled from A alone, E from both holders (what their data channels sent, in MB)
    assert all(a > 0 and b == 0 for a, b in report["holder_mb"]["restore_peer"])
    assert all(a > 0 and b > 0 for a, b in report["holder_mb"]["restore_peer_2holders"])
    assert "daemon.read" in report["phases"]["restore_durable"]
    # C pulls a copy into a warm segment every round (the warm-up's too)
    assert report["warm_pool"]["bytes"] > 0
    assert report["warm_pool"]["segments_taken"]["C"] >= 2
    # warm-up and timed rounds, each from the tier the mode is named after
    assert report["sources"] == {
        **{f"restore_local{kind}": ["memory"] * 2 for kind in ("", "_resharded", "_2to1")},
        **{f"restore_peer{kind}": ["peer"] * 2
           for kind in ("", "_2holders", "_resharded", "_2to1")},
        "restore_durable": ["durable"] * 2}
    assert report["problems"] == []
    assert isinstance(report["daemon_log"], dict)
    check_restore_groups(report, modes)


def check_restore_groups(report: dict, modes) -> None:
    """--quick runs the split layout: every mode in exactly one group, each group at most
    4 states of memory with its daemons' and this process's peaks; the ratios named as
    across groups are exactly those whose modes ran in different groups."""
    groups = report["groups"]
    assert sorted(m for g in groups for m in g["modes"]) == sorted(modes)
    assert len(groups) == 8
    group_of = {m: i for i, g in enumerate(groups) for m in g["modes"]}
    assert group_of["raw_tcp_parallel"] == group_of["restore_peer"]
    assert group_of["restore_local"] == group_of["restore_local_resharded"]
    daemons_seen = set()
    for group in groups:
        assert set(group) == {"modes", "footprint_states", "daemons", "client_peak_rss_bytes"}
        assert 3 <= group["footprint_states"] <= 5, group
        assert group["client_peak_rss_bytes"] > 0
        for name, row in group["daemons"].items():
            daemons_seen.add(name)
            assert set(row) == {"peak_rss_bytes", "peak_held_bytes", "rss_vs_held"}, name
            # every daemon held at least one state-sized segment (a copy, or the warm pool)
            assert row["peak_held_bytes"] >= report["state_bytes"], (name, row)
            assert row["peak_rss_bytes"] > 0 and math.isfinite(row["rss_vs_held"])
    assert daemons_seen == {"A", "B", "C", "D", "E"}
    assert not groups[-1]["daemons"]  # Orbax's group starts none
    assert set(report["ratios_across_groups"]) <= set(report["ratios"])
    assert "restore_peer_vs_raw_tcp_parallel" not in report["ratios_across_groups"]
    assert "resharded_vs_same_local" not in report["ratios_across_groups"]
    assert "2to1_vs_same_local" in report["ratios_across_groups"]
    memory = report["memory"]
    assert memory["layout"] == "split" and memory["state_bytes"] == report["state_bytes"]
    assert memory["client_peak_rss_bytes"] == max(g["client_peak_rss_bytes"] for g in groups)
    assert memory["client_peak_rss_bytes"] >= memory["client_baseline_rss_bytes"] > 0
    assert memory["daemon_peak_rss_bytes"] == max(
        r["peak_rss_bytes"] for g in groups for r in g["daemons"].values())
    assert_finite({k: memory[k] for k in ("client_extra_states", "daemon_rss_vs_held_max",
                                          "cap_states")}, "memory")
    # every restore, bubblesnap's and Orbax's, measured what it cost this process
    peaks = memory["client_restore_peak_states"]
    assert list(peaks) == [m for m in modes if m.startswith(("restore_", "orbax_"))]
    assert_finite(peaks, "client_restore_peak_states")
    assert set(memory["meets_targets"]) == {"daemon_rss_within_5pct_of_held",
                                            "client_restore_within_one_copy"}
    assert all(isinstance(met, bool) for met in memory["meets_targets"].values())


def check_gpu(report: dict) -> None:
    """gpu.py --quick: its CPU run (benchmarks/gpu.sh runs the same on a CUDA host)."""
    assert report["device"] == {"platform": "cpu", "kind": "cpu", "count": 1}
    assert_bandwidth_modes(report, ("pinned_d2h", "orbax_fetch", "snapshot", "pinned_h2d",
                                    "restore_local"))
    assert set(report["ratios"]) == {"orbax_fetch_vs_pinned_d2h", "snapshot_vs_pinned_d2h",
                                     "restore_local_vs_pinned_h2d"}
    assert_finite(report["ratios"], "ratios")
    assert report["matches"] == dict.fromkeys(report["modes"], True), report["problems"]
    assert report["problems"] == [] and report["rounds"] == 1 and report["state_bytes"] > 0
    pipeline = report["pipeline"]
    assert list(pipeline["modes"]) == ["none", "bubblesnap", "eager"]
    for mode, row in pipeline["modes"].items():
        assert row["measured_steps"] == 2, mode
        assert_finite({k: row[k] for k in ("median_step_seconds", "overhead_pct")}, mode)
    assert pipeline["modes"]["none"]["snapshots"] == 0
    assert [s["stage"] for s in pipeline["per_stage"]] == [0, 1]
    assert all(s["state_bytes"] > 0 for s in pipeline["per_stage"])
    assert report["seconds"] > 0


def check_overhead(report: dict) -> None:
    assert list(report["modes"]) == ["none", "bubblesnap", "eager", "orbax_async",
                                     "unreplicated", "replicated", "paced"]
    for mode, row in report["modes"].items():
        assert row["measured_steps"] == 3, mode
        assert_finite({k: row[k] for k in ("median_step_seconds", "min_step_seconds",
                                           "max_step_seconds", "overhead_pct")}, mode)
    assert report["modes"]["none"]["snapshots"] == 0
    assert report["modes"]["orbax_async"]["snapshots"] == 3  # it saves every step
    assert [s["stage"] for s in report["per_stage"]] == [0, 1]
    for stage in report["per_stage"]:
        assert_finite({k: stage[k] for k in ("bubble_seconds_per_iteration",
                                             "naive_copy_seconds", "copy_to_bubble_ratio")},
                      f"stage {stage['stage']}")
        assert stage["state_bytes"] > 0
    assert_finite(report["noise_pct"], "noise_pct")
    check_replication(report["replication"])
    assert set(report["checks"]) == {
        "bubblesnap_overhead_le_1pct", "bubblesnap_snapshot_every_iteration",
        "bubblesnap_below_third_of_orbax_async", "naive_copy_ge_third_of_bubble_every_stage"}
    assert all(isinstance(ok, bool) for ok in report["checks"].values())


def check_replication(replication: dict, pushes_every_run: bool = True) -> None:
    """The ring modes' block of overhead.py's report (on loopback or on a Cluster).
    Without ``pushes_every_run`` a ring mode may have pushed no measured step (on a slow
    link the replicator may be busy re-replicating skipped copies all through them):
    its push figures are then None, but the data channels still sent bytes."""
    assert set(replication) == {"overhead_pct_vs_unreplicated", "paced_vs_unpaced",
                                "unreplicated", "replicated", "paced"}
    assert_finite(replication["overhead_pct_vs_unreplicated"], "replication overhead")
    assert set(replication["overhead_pct_vs_unreplicated"]) == {"replicated", "paced"}
    # None where unpaced replication cost nothing measurable: no ratio to take
    ratio = replication["paced_vs_unpaced"]
    assert ratio is None or math.isfinite(ratio), ratio
    timings = ("copies_seconds_median", "copies_seconds_max", "waited_seconds_median",
               "push_seconds_median")
    for mode in ("unreplicated", "replicated", "paced"):
        row = replication[mode]
        assert row["pushes"] >= (1 if pushes_every_run else 0), mode  # per measured step
        if row["pushes"]:
            assert_finite({k: row[k] for k in timings}, mode)
        else:
            assert all(row[k] is None for k in (*timings, "in_bubbles_fraction")), row
    for mode in ("replicated", "paced"):
        row = replication[mode]
        if row["pushes"]:
            assert 0 <= row["in_bubbles_fraction"] <= 1, mode
        # the first copies go while training runs
        assert row["sent_bytes_per_iteration"] > 0 and row["pushed_bytes_per_iteration"] > 0
    assert replication["unreplicated"]["sent_bytes_per_iteration"] == 0


def check_overhead_link_rate(report: dict) -> None:
    """overhead.py --link-rate 1gbit: its four modes, each stage on a host of a Cluster."""
    assert report["benchmark"] == "overhead"
    assert list(report["modes"]) == ["none", "unreplicated", "replicated", "paced"]
    for mode, row in report["modes"].items():
        assert row["measured_steps"] == 3, mode
        assert_finite({k: row[k] for k in ("median_step_seconds", "min_step_seconds",
                                           "max_step_seconds", "overhead_pct")}, mode)
    assert report["modes"]["none"]["snapshots"] == 0
    assert report["link_rate"] == "1gbit" and report["link_bits_per_second"] == 1e9
    assert report["pace_max_wait_seconds"] == 2.0
    assert [s["stage"] for s in report["per_stage"]] == [0, 1]
    assert report["state_bytes_per_stage"] == [s["state_bytes"] for s in report["per_stage"]]
    for stage in report["per_stage"]:
        assert stage["state_bytes"] > 0
        assert_finite({k: stage[k] for k in ("bubble_seconds_per_iteration",
                                             "link_seconds_per_copy", "link_to_bubble_ratio")},
                      f"stage {stage['stage']}")
        assert stage["link_seconds_per_copy"] == stage["state_bytes"] * 8 / 1e9
    assert_finite(report["noise_pct"], "noise_pct")
    check_replication(report["replication"], pushes_every_run=False)
    assert set(report["checks"]) == {"paced_below_unpaced"}
    assert isinstance(report["checks"]["paced_below_unpaced"], bool)


def check_sick_daemon(report: dict) -> None:
    assert set(report["modes"]) == {"memory", "persisted"}
    for mode, row in report["modes"].items():
        assert row["baseline"]["steps"] == 10, mode
        assert_finite(row["baseline"], "baseline")
        [freeze] = row["freezes"]
        assert freeze["freeze_seconds"] == 1.0 and freeze["steps"] > 0
        assert_finite({k: v for k, v in freeze.items()
                       if k != "first_save_taken_after_thaw_seconds"}, "freeze")
        assert all(isinstance(ok, bool) for ok in row["checks"].values())
        assert row["restore_matches"] is True, mode
    memory = report["modes"]["memory"]
    [freeze] = memory["freezes"]
    # a frozen daemon skips saves (it cannot take them); the first after the thaw is taken
    assert 1 <= freeze["skipped_saves"] <= freeze["steps"]
    assert freeze["first_save_taken_after_thaw_seconds"] is not None
    assert set(memory["checks"]) == {"step_le_0.2s_over_baseline", "commit_within_2s_of_thaw"}
    persisted = report["modes"]["persisted"]
    assert set(persisted["checks"]) == {"step_le_bound_plus_orbax_save",
                                        "every_kept_step_finalized_once"}
    assert persisted["checks"]["every_kept_step_finalized_once"] is True
    assert persisted["wait_bound_seconds"] >= 2.0  # the floor
    assert_finite(persisted["orbax_baseline"], "orbax_baseline")
    assert persisted["written_by_trainer"] >= 0


def check_plan_scale(report: dict) -> None:
    assert report["stages"] == 64
    assert_finite({k: report["plan_seconds"][k] for k in ("median", "min", "max")},
                  "plan_seconds")
    assert report["plan_seconds"]["runs"] == 2
    assert isinstance(report["plan_under_one_second"], bool)
    assert report["interval"] >= 1
    assert_finite({"predicted_overhead": report["predicted_overhead"]}, "report")
    assert report["spill_bytes"] >= 0
    # every stage of a 1F1B schedule idles (p-1)(f+b) per iteration
    idle = report["idle_seconds_per_stage"]
    for bound in ("min", "max"):
        assert math.isclose(idle[bound], idle["formula_(p-1)(f+b)"], rel_tol=1e-9), idle
    for use in ("per_host_daemon", "one_daemon_all_ranks"):
        row = report["bubble_plans"][use]
        assert row["interval"] >= 1 and row["steady_start_seconds"]["runs"] > 0, use
        assert_finite({k: row[k] for k in ("record_two_iterations_seconds",
                                           "plan_and_answer_seconds")}, use)


def check_log_cost(report: dict) -> None:
    assert list(report["modes"]) == ["none", "training_log", "boundary_log"]
    for mode, row in report["modes"].items():
        assert row["measured_steps"] == 2, mode
        assert_finite({k: row[k] for k in ("median_step_ms", "min_step_ms", "max_step_ms",
                                           "overhead_pct")}, mode)
    assert report["training_log_bytes_per_step"] > 0
    boundary = report["boundary_log_bytes_per_step"]
    assert len(boundary["per_boundary"]) == 2 and min(boundary["per_boundary"]) > 0
    assert boundary["all_boundaries"] == sum(boundary["per_boundary"])
    assert len(report["state_bytes_per_stage"]) == 3


def check_adoption(report: dict) -> None:
    assert report["copies"] == 4 and report["rounds"] == 1
    assert report["adopted_bytes"] == report["copies"] * report["copy_bytes"]
    assert_finite({k: report["adoption_seconds"][k] for k in ("median", "min", "max")},
                  "adoption_seconds")
    assert_finite({k: report[k] for k in ("adoption_seconds_per_gib", "adoption_vs_hash",
                                          "restart_seconds", "empty_start_seconds")}, "report")
    assert set(report["hash_seconds_per_gib"]) == {"1_threads", "2_threads"}
    assert_finite(report["hash_seconds_per_gib"], "hash_seconds_per_gib")
    assert report["restored_matches"] is True


def check_load(report: dict) -> None:
    assert [row["ranks"] for row in report["runs"]] == [8, 16]
    for row in report["runs"]:
        assert row["errors"] == 0 and row["error_reasons"] == [], row["error_reasons"]
        assert row["streams"] == row["ranks"] and row["snapshots"] == 2 * row["ranks"]
        assert row["health_ms"]["probes"] > 0
        for key in ("snapshot_ms", "health_ms", "status_ms"):
            assert_finite({k: row[key][k] for k in ("p50", "p99", "max")}, key)
            assert 0 <= row[key]["p50"] <= row[key]["p99"] <= row[key]["max"], (key, row)
        assert row["processes"] == 2 and row["plans_received"] >= 0 and row["seconds"] > 0
    assert report["ok"] is True


def check_group_scale(report: dict) -> None:
    rows = {(r["backend"], r["daemons"]): r for r in report["results"]}
    assert set(rows) == {(b, n) for b in ("static", "etcd") for n in (10, 40)}
    for row in rows.values():
        for key in ("typical", "busiest", "total"):
            assert_finite(row[key], key)
        assert_finite({k: row[k] for k in ("commit_seconds", "detect_seconds",
                                           "re_replicate_seconds")}, row["backend"])
    # Counts per step, not rates over a window: what the protocol fixes. On the static
    # ring a daemon makes and answers a Holdings and a Layouts call per peer (request
    # and answer each); with etcd a typical daemon publishes and reads once whatever
    # the group's size, and hears one to four summaries (the distinct values the
    # aggregator saw while the step's holdings arrived: that depends on timing).
    for n in (10, 40):
        per_step = rows[("static", n)]["typical_per_step"]
        assert per_step["call_messages"] == 8 * (n - 1) and per_step["watch_events"] == 0
    small, large = rows[("etcd", 10)]["typical_per_step"], rows[("etcd", 40)]["typical_per_step"]
    assert small["call_messages"] == large["call_messages"] == 4, (small, large)
    assert all(1 <= p["watch_events"] <= 4 for p in (small, large)), (small, large)
    # the same keys, an index a digit longer
    assert math.isclose(small["call_bytes"], large["call_bytes"], rel_tol=0.01)
    assert isinstance(report["static_limit"], str)


def check_manager(report: dict) -> None:
    bubblesnap = ["bubblesnap", "bubblesnap_memory", "bubblesnap_memory_only"]
    assert list(report["modes"]) == ["none", "memcpy", *bubblesnap, "orbax", "orbax_every_10"]
    for mode, row in report["modes"].items():
        assert_finite(row, mode)
        assert row["median_step_ms"] > 0, mode
    assert report["modes"]["none"]["overhead"] == 0
    # each bubblesnap mode's step time over the bound's, from the same rows
    memcpy = report["modes"]["memcpy"]["median_step_ms"]
    assert list(report["vs_memcpy"]) == bubblesnap
    for mode in bubblesnap:
        assert math.isclose(report["vs_memcpy"][mode],
                            report["modes"][mode]["median_step_ms"] / memcpy), mode
    assert report["steps"] == 2 and report["rounds"] == 1 and report["state_mb"] > 0
    assert_finite(report["restore"], "restore")
    # both managers gave the saved TrainState back, bit for bit
    assert report["restore_matches"] == {"bubblesnap": True, "orbax": True}


def check_durable_write(report: dict) -> None:
    assert_bandwidth_modes(report, ("durable_write", "orbax_save"))
    assert report["rounds"] == 1 and report["state_bytes"] > 0 and report["devices"] == 4
    assert set(report["ratios"]) == {"durable_write_vs_orbax_save"}
    assert_finite(report["ratios"], "ratios")
    assert set(report["meets_targets"]) == {"durable_write_ge_orbax_save"}
    assert isinstance(report["meets_targets"]["durable_write_ge_orbax_save"], bool)
    assert list(report["anon_grown_mb"]) == ["durable_write", "orbax_save"]
    for mode, row in report["anon_grown_mb"].items():
        assert_finite(row, mode)
        assert 0 <= row["median"] <= row["max"], (mode, row)
    # over the level before the first round, both writers grew (the sampler watched them)
    over_start = report["anon_peak_over_start_mb"]
    assert list(over_start) == ["durable_write", "orbax_save"]
    assert all(value > 0 for value in over_start.values()), over_start
    # the daemon's step and Orbax's folder each restored through plain Orbax, bit for bit
    assert report["matches"] == {"durable_write": True, "orbax_save": True}
    assert_machine_memory(report)


def check_durable_store(report: dict, ours_theirs: list[tuple[str, str]]) -> None:
    """durable_write.py on an object store: each of ours against its baseline."""
    modes = [mode for pair in ours_theirs for mode in pair]
    assert_bandwidth_modes(report, tuple(modes))
    least = 0.9 if ours_theirs[0][1] == "tensorstore_write" else 1.0
    assert set(report["ratios"]) == {f"{a}_vs_{b}" for a, b in ours_theirs}
    assert_finite(report["ratios"], "ratios")
    assert report["meets_targets"] == {f"{name}_ge_{least}": value >= least
                                       for name, value in report["ratios"].items()}
    assert report["matches"] == {"durable_restore": True, ours_theirs[1][1]: True}
    phases = report["durable_restore_phases_ms"]
    assert {"call", "daemon.read", "daemon.verify"} <= set(phases)
    assert_finite(phases, "durable_restore_phases_ms")
    assert phases["daemon.read"] <= phases["call"]
    assert_machine_memory(report)


def check_durable_write_s3(report: dict) -> None:
    assert report["storage"].startswith("SeaweedFS S3")
    check_durable_store(report, [("durable_write", "tensorstore_write"),
                                 ("durable_restore", "tensorstore_read")])


def check_durable_write_gcs(report: dict) -> None:
    assert report["storage"].startswith("fake-gcs-server")
    check_durable_store(report, [("durable_write", "orbax_save"),
                                 ("durable_restore", "orbax_restore")])


def check_restore_gcs(report: dict) -> None:
    """restore.py on an object store: the durable tier and Orbax's checkpoint both there,
    the two restores from it and nothing else."""
    assert "error" not in report, report
    assert report["storage"].startswith("durable tier and Orbax checkpoint on fake-gcs-server")
    assert_bandwidth_modes(report, ("restore_durable", "orbax_restore"))
    assert set(report["ratios"]) == {"restore_durable_vs_orbax"}
    assert_finite(report["ratios"], "ratios")
    assert report["meets_targets"] == {
        "restore_durable_ge_orbax": report["ratios"]["restore_durable_vs_orbax"] >= 1.0}
    assert report["matches"] == {"restore_durable": True, "orbax_restore": True}
    assert set(report["sources"]["restore_durable"]) == {"durable"}
    assert "daemon.read" in report["phases"]["restore_durable"]


def assert_machine_memory(report: dict) -> None:
    """The kernel's memory settings as this machine has them, the chosen one of a list."""
    memory = report["machine_memory"]
    assert set(memory) == {"thp_enabled", "thp_defrag", "thp_shmem_enabled",
                           "page_reporting_order"}
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            assert f"[{memory['thp_enabled']}]" in f.read()
    except FileNotFoundError:  # a kernel without transparent huge pages
        assert memory["thp_enabled"] is None
    assert all(value is None or (value and "[" not in value) for value in memory.values())


CHECKS = {"adoption": check_adoption, "datapath": check_datapath,
          "durable_write": check_durable_write, "gpu": check_gpu,
          "group_scale": check_group_scale, "load": check_load,
          "log_cost": check_log_cost, "manager": check_manager, "overhead": check_overhead,
          "plan_scale": check_plan_scale, "sick_daemon": check_sick_daemon,
          "restore": check_restore, "overhead_link_rate": check_overhead_link_rate,
          "durable_write_s3": check_durable_write_s3,
          "durable_write_gcs": check_durable_write_gcs, "restore_gcs": check_restore_gcs}


@pytest.mark.parametrize("name", PROGRAMS)
def test_benchmark_runs_quick_and_reports_what_the_docs_document(name, quick_runs):
    report = report_of(quick_runs[name])
    assert report["benchmark"] == name
    CHECKS[name](report)


@pytest.mark.parametrize("name", VARIANTS)
def test_benchmark_variant_runs_quick(name, quick_runs):
    reason = variant_unavailable(name)
    if reason:
        pytest.skip(f"{name} needs a Cluster: {reason}")
    CHECKS[name](report_of(quick_runs[name]))


def test_every_benchmark_is_tested_and_none_shadows_an_installed_module():
    modules = {path.stem for path in BENCHMARKS.glob("*.py")}
    assert modules == {*PROGRAMS, "bench_common", "durable_store"}
    for name in modules:  # a script's folder comes first on sys.path when it runs
        assert name not in sys.stdlib_module_names, name
        assert importlib.util.find_spec(name) is None, name
