"""Options: frozen, keyword-only, validated with messages that name the option; the CLI's
defaults are theirs."""

import dataclasses

import pytest

from bubblesnap import cli
from bubblesnap.cli import daemon_command
from bubblesnap.service import (
    BubbleOptions,
    CoordinationOptions,
    DaemonOptions,
    DiscoveryOptions,
    DurableOptions,
    LogOptions,
    PeerOptions,
    PeerSecurity,
    PlannerOptions,
    StoreOptions,
)

ALL = [BubbleOptions, CoordinationOptions, DaemonOptions, DiscoveryOptions, DurableOptions,
       LogOptions, PeerOptions, PeerSecurity, PlannerOptions, StoreOptions]


@pytest.mark.parametrize("options", ALL)
def test_options_are_frozen_and_keyword_only(options):
    default = options()
    first = dataclasses.fields(options)[0]
    with pytest.raises(TypeError):
        options(getattr(default, first.name))  # positional
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(default, first.name, getattr(default, first.name))


@pytest.mark.parametrize("options, kwargs, words", [
    (StoreOptions, dict(keep_steps=0), "StoreOptions.keep_steps: --keep"),
    (StoreOptions, dict(checksum_threads=0), "StoreOptions.checksum_threads"),
    (StoreOptions, dict(memory_budget_bytes=0), "StoreOptions.memory_budget_bytes"),
    (PlannerOptions, dict(safety=1.5), "PlannerOptions.safety"),
    (PlannerOptions, dict(max_interval=0), "PlannerOptions.max_interval: --max-interval"),
    (BubbleOptions, dict(smoothing=0.0), "BubbleOptions.smoothing"),
    (BubbleOptions, dict(replan_change=-1.0), "BubbleOptions.replan_change"),
    (PeerOptions, dict(peers=("a:1", "b:2"), index=2), "PeerOptions.index: --index"),
    (PeerOptions, dict(peers=("a:1", "b:2"), replicas=2), "PeerOptions.replicas"),
    (PeerOptions, dict(refresh_seconds=0.0), "PeerOptions.refresh_seconds"),
    (PeerOptions, dict(group_name="två ringar"), "PeerOptions.group_name: --group-name"),
    (PeerSecurity, dict(tls_cert="c.pem"), "--peer-tls-key"),
    (CoordinationOptions, dict(url="http://h:1", group_size=3), "--coordination"),
    (CoordinationOptions, dict(url="etcd://h:1"), "CoordinationOptions.group_size: --group-size"),
    (CoordinationOptions, dict(prefix="bubblesnap"), "--coordination-prefix"),
    (PeerOptions, dict(coordination=CoordinationOptions(url="etcd://h:1", group_size=3)),
     "PeerOptions.listen: --peer-listen"),
    (PeerOptions, dict(peers=("a:1", "b:2"), listen="a:1",
                       coordination=CoordinationOptions(url="etcd://h:1", group_size=3)),
     "PeerOptions.peers: --peers"),
    (LogOptions, dict(max_rank_bytes=10), "LogOptions.max_rank_bytes: --training-log-budget"),
    (DurableOptions, dict(write_batch_bytes=0),
     "DurableOptions.write_batch_bytes: --durable-write-batch"),
    (DaemonOptions, dict(nice=20), "DaemonOptions.nice: --nice"),
    (DaemonOptions, dict(rpc_threads=0), "DaemonOptions.rpc_threads"),
])
def test_bad_options_are_refused_naming_the_option(options, kwargs, words):
    with pytest.raises(ValueError, match=words):
        options(**kwargs)


def test_the_daemon_flags_default_to_the_options_defaults():
    args = cli.parser().parse_args(["daemon"])
    assert daemon_command.daemon_options(args) == DaemonOptions()


def test_the_durable_write_batch_is_a_size():
    flags = ["daemon", "--durable-dir", "/ckpt", "--durable-every-steps", "10",
             "--durable-write-batch", "256MiB"]
    options = daemon_command.daemon_options(cli.parser().parse_args(flags)).durable
    assert options.write_batch_bytes == 256 << 20 != DurableOptions().write_batch_bytes
    with pytest.raises(SystemExit):  # argparse's usage error: not a size
        cli.parser().parse_args([*flags[:-1], "lots"])
    with pytest.raises(ValueError, match="--durable-write-batch"):
        daemon_command.daemon_options(cli.parser().parse_args([*flags[:-1], "0"]))


def test_spreading_restores_over_holders_can_be_turned_off():
    flags = ["daemon", "--peers", "127.0.0.1:1,127.0.0.1:2", "--no-spread-restores"]
    assert not daemon_command.daemon_options(cli.parser().parse_args(flags)).peers.spread_restores
    assert daemon_command.daemon_options(cli.parser().parse_args(flags[:3])).peers.spread_restores


def test_a_group_is_named_as_its_etcd_keys_are():
    def named(prefix: str) -> str:
        return PeerOptions(listen="a:1", coordination=CoordinationOptions(
            url="etcd://h:1", group_size=3, prefix=prefix)).group
    # one group whatever the trailing "/", and a name gRPC metadata can carry
    assert named("/prod/ring") == named("/prod/ring/") == "/prod/ring"
    assert named("/prod/ringé").isascii()
    assert PeerOptions().group == "bubblesnap"
    assert PeerOptions(group_name="mine", listen="a:1", coordination=CoordinationOptions(
        url="etcd://h:1", group_size=3)).group == "mine"
