"""Peers from a headless Service: the ring order and index (pure), the wait for an answer
to take (a resolver and a clock the test controls), and the daemon's flags."""

import itertools
import re
import subprocess
import sys

import pytest

from bubblesnap.service import DiscoveryError, DiscoveryOptions, discover
from bubblesnap.service.peers.discovery import ring, waiting_for

NODES = ["10.0.0.9", "10.0.0.10", "10.0.1.2", "10.0.0.100"]


def options(**changes) -> DiscoveryOptions:
    return DiscoveryOptions(**{"service": "bubblesnap-peers:7072", "own_address": "10.0.0.10",
                               "expected": 4, **changes})


def test_every_daemon_derives_the_same_ring_whatever_order_dns_answers_in():
    rings = {ring(listed, own, 7072)[0]
             for listed in itertools.permutations(NODES) for own in NODES}
    # Numeric order: 10.0.0.9 before 10.0.0.10 (as text it would sort after it).
    assert rings == {("10.0.0.9:7072", "10.0.0.10:7072", "10.0.0.100:7072", "10.0.1.2:7072")}
    assert [ring(NODES, own, 7072)[1] for own in NODES] == [0, 1, 3, 2]


def test_a_pod_restarted_on_its_node_keeps_its_place_and_a_lost_node_moves_only_later_ones():
    peers, index = ring(NODES, "10.0.0.100", 7072)
    # Host network: the restarted pod has its node's IP again; same ring, same index.
    assert ring(list(reversed(NODES)), "10.0.0.100", 7072) == (peers, index)
    # Node 10.0.0.10 gone: the daemon before it keeps index 0, the later ones move up,
    # which is why a changed node set needs every daemon restarted (discovery.py).
    smaller = [n for n in NODES if n != "10.0.0.10"]
    assert ring(smaller, "10.0.0.9", 7072)[1] == 0
    assert ring(smaller, "10.0.0.100", 7072)[1] == 1


def test_duplicates_and_the_other_family_are_dropped_and_ipv6_is_bracketed():
    listed = ["10.0.0.2", "10.0.0.1", "10.0.0.2", "fd00::1", "not-an-ip"]
    assert ring(listed, "10.0.0.2", 7072) == (("10.0.0.1:7072", "10.0.0.2:7072"), 1)
    assert ring(["fd00::2", "fd00::1", "10.0.0.1"], "fd00::2", 7) == (
        ("[fd00::1]:7", "[fd00::2]:7"), 1)


def test_a_daemon_not_listed_yet_has_no_ring():
    with pytest.raises(ValueError, match=re.escape("10.0.0.5 is not among the 4")):
        ring(NODES, "10.0.0.5", 7072)


def test_an_answer_is_taken_only_with_exactly_the_expected_daemons_this_one_among_them():
    assert waiting_for(NODES, options()) == ""
    assert "lists 3 daemons" in waiting_for(NODES[:3], options())
    assert "lists 4 daemons" in waiting_for(NODES, options(expected=5))
    assert "not among" in waiting_for(NODES[2:], options(expected=2))


class Service:
    """A headless Service whose answer the test scripts, and the clock it is read by:
    each ``sleep`` advances the clock; the answer changes at the times given."""

    def __init__(self, answers: list[tuple[float, list[str]]]):
        self.answers = answers
        self.now = 0.0
        self.asked: list[str] = []

    def resolve(self, name: str) -> list[str]:
        self.asked.append(name)
        return next(listed for at, listed in reversed(self.answers) if at <= self.now)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_discovery_waits_for_every_pod_and_for_the_answer_to_settle():
    service = Service([(0, []), (3, ["10.0.0.10"]), (10, NODES[:3]),
                       (20, NODES), (22, NODES[:3]),   # a pod listed, then not: a flap
                       (25, NODES)])
    peers, index = discover(options(), service.resolve, lambda: service.now, service.sleep)
    assert (peers, index) == ring(NODES, "10.0.0.10", 7072)
    assert set(service.asked) == {"bubblesnap-peers"}
    assert service.now == 25 + options().settle_seconds  # not at 20: it flapped after


def test_discovery_gives_up_saying_what_it_saw():
    service = Service([(0, NODES[:3])])
    with pytest.raises(DiscoveryError, match="after 30 s: the Service lists 3 daemons"):
        discover(options(timeout_seconds=30), service.resolve, lambda: service.now,
                 service.sleep)
    assert service.now == 30


@pytest.mark.parametrize("changes, words", [
    (dict(service="bubblesnap-peers"), "DiscoveryOptions.service: --peers-from-dns"),
    (dict(service="peers:0"), "DiscoveryOptions.service"),
    (dict(own_address="node-1"), "DiscoveryOptions.own_address: --own-address"),
    (dict(expected=1), "DiscoveryOptions.expected: --peers-expected"),
    (dict(settle_seconds=-1.0), "DiscoveryOptions.settle_seconds"),
])
def test_bad_discovery_options_are_refused_naming_the_option(changes, words):
    with pytest.raises(ValueError, match=words):
        options(**changes)


def _daemon(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bubblesnap", "daemon", "--metrics", "",
                           "--listen", "127.0.0.1:0", *flags], capture_output=True, text=True,
                          timeout=60)


def test_the_daemon_finds_no_ring_in_real_dns_and_says_so():
    # localhost resolves (really, through getaddrinfo) to this host alone: one daemon of two.
    done = _daemon("--peers-from-dns", "localhost:7072", "--own-address", "127.0.0.1",
                   "--peers-expected", "2", "--discovery-timeout", "0.5")
    assert done.returncode != 0
    assert "--peers-from-dns localhost:7072: no ring from localhost after 0.5 s: " \
           "the Service lists 1 daemons (127.0.0.1:7072), --peers-expected is 2" in done.stderr


def test_peers_from_dns_takes_no_hand_written_peers_or_index():
    done = _daemon("--peers-from-dns", "svc:7072", "--own-address", "10.0.0.1",
                   "--peers-expected", "2", "--index", "0")
    assert done.returncode != 0 and "give no --peers, --peers-file or --index" in done.stderr
