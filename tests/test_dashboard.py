"""The Grafana dashboard (deploy/grafana/bubblesnap.json): Grafana's structure, and every
metric it queries exported by running daemons."""

import json
import pathlib
import re
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bubblesnap.clients import ClientOptions, NumpyClient
from bubblesnap.protos import daemon_pb2 as pb
from bubblesnap.service.metrics import PHASES
from bubblesnap.testing import wait_for
from tests.helpers import register, tensor_spec

DASHBOARD = pathlib.Path(__file__).parent.parent / "deploy" / "grafana" / "bubblesnap.json"


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _queried_panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in _queried_panels(dashboard) for t in p["targets"]]


def _queries(dashboard: dict) -> list[str]:
    """Every PromQL the dashboard runs: its panels' and its variables'."""
    return _expressions(dashboard) + [v["definition"] for v in dashboard["templating"]["list"]
                                      if v["type"] == "query"]


def _scrape(daemon) -> dict[str, dict[tuple, float]]:
    """sample name -> {labels: value} of what the daemon's --metrics endpoint serves."""
    text = urllib.request.urlopen(f"http://{daemon.ready['metrics']}/metrics",
                                  timeout=10).read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def test_the_dashboard_has_grafana_dashboard_structure():
    dashboard = _dashboard()
    for key, kind in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list),
                      ("templating", dict), ("time", dict)):
        assert isinstance(dashboard.get(key), kind), key
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(grid) and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["type"] in ("row", "timeseries", "stat"), panel["title"]
    for panel in _queried_panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert 'instance=~"$instance"' in target["expr"], target["expr"]


def test_the_dashboard_charts_what_the_issue_asks_for():
    exprs = " ".join(_expressions(_dashboard()))
    for name in ("bubblesnap_phase_seconds_count", "bubblesnap_phase_seconds_bucket",
                 "bubblesnap_memory_used_bytes", "bubblesnap_memory_budget_bytes",
                 "bubblesnap_newest_step_copies", "bubblesnap_bubble_seconds_total",
                 "bubblesnap_corrupt_copies_total", "bubblesnap_peers_alive"):
        assert name in exprs, name


def test_every_metric_the_dashboard_queries_is_exported(start_ring):
    ring = start_ring(2, "--replicas", "1")
    client = NumpyClient("dash", options=ClientOptions(daemon=ring.daemons[0].address))
    state = {"w": np.arange(4096, dtype=np.float32)}
    for step in (1, 2):
        assert client.snapshot(step, state, wait="job").committed
    assert client.restore()[0] == 2
    client.close()
    # A pipeline stage's commit reports its bubbles; the same commit again counts once.
    stub = ring.daemons[0].stub
    register(stub, job="bubbles", tensors=[tensor_spec("a", (256,))])
    staging = stub.BeginStep(pb.BeginStepRequest(job="bubbles", rank=0, step=1), timeout=10)
    usage = pb.BubbleUsage(offered_seconds=0.5, used_seconds=0.25, spilled_seconds=0.125,
                           bubbles=4, iterations=1)
    for _ in range(2):
        stub.CommitStep(pb.CommitStepRequest(job="bubbles", rank=0, step=1, usage=usage),
                        timeout=10)
    assert stub.WaitCommitted(pb.WaitCommittedRequest(job="bubbles", step=1,
                                                      timeout_seconds=20), timeout=30).committed
    # A bit flips in daemon 0's copy: the restore skips it, counted, and takes the peer's.
    with open(staging.segment_path, "r+b") as segment:
        segment.seek(staging.slots[0].offset + 17)
        byte = segment.read(1)
        segment.seek(-1, 1)
        segment.write(bytes([byte[0] ^ 0x10]))
    assert stub.Restore(pb.RestoreRequest(job="bubbles", rank=0), timeout=30).source == "peer"

    def copies_known():
        samples = _scrape(ring.daemons[0])
        copies = samples["bubblesnap_newest_step_copies"]
        return samples if len(copies) == 2 and all(n == 2 for n in copies.values()) else None
    samples = wait_for(copies_known, "both jobs' copies, 2 each, in the metrics", timeout=30)

    used = {name for expr in _queries(_dashboard())
            for name in re.findall(r"\bbubblesnap_[a-z_]+\b", expr)}
    assert used - set(samples) == set(), "queried by the dashboard, not exported"
    phases = samples["bubblesnap_phase_seconds_count"]
    assert {dict(labels)["phase"] for labels in phases} == set(PHASES)
    counts = {dict(labels)["phase"]: n for labels, n in phases.items()}
    # Three steps staged, fetched, committed (one twice) and pushed to the peer; two restores.
    assert counts["stage"] >= 3 and counts["fetch"] >= 3 and counts["commit"] >= 4
    assert counts["replicate"] >= 3 and counts["restore"] == 2 and counts["persist"] == 0
    assert samples["bubblesnap_bubble_seconds_total"] == {
        (("kind", "offered"),): 0.5, (("kind", "used"),): 0.25, (("kind", "spilled"),): 0.125}
    assert samples["bubblesnap_newest_step_copies"][(("job", "dash"),)] == 2.0
    assert samples["bubblesnap_copies_wanted"] == {(): 2.0}
    assert samples["bubblesnap_peers"] == {(): 2.0}
    assert samples["bubblesnap_peers_alive"] == {(): 2.0}
    assert samples["bubblesnap_restores_total"] == {(("source", "memory"),): 1.0,
                                                    (("source", "peer"),): 1.0}
    assert samples["bubblesnap_corrupt_copies_total"] == {
        (("source", "memory"),): 1.0, (("source", "peer"),): 0.0, (("source", "durable"),): 0.0}
