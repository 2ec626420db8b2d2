"""Options check themselves where they are written and say which option is wrong."""

import dataclasses
import os

import pytest

from bubblesnap.clients import ClientOptions
from bubblesnap.clients.jax import BubbleSnapshotOptions


def test_defaults_are_the_documented_ones():
    socket = f"unix:///dev/shm/bubblesnap-user-{os.getuid()}/daemon.sock"  # the daemon's default
    assert ClientOptions() == ClientOptions(daemon=socket, token="", rpc_timeout_seconds=5.0,
                                            backoff_seconds=10.0, verify_restore=False,
                                            restore_timeout_seconds=300.0,
                                            commit_timeout_seconds=60.0)
    assert BubbleSnapshotOptions() == BubbleSnapshotOptions(warmup_iterations=2, eager=False,
                                                            min_report_seconds=1e-3,
                                                            smoothing=0.3)


@pytest.mark.parametrize(("options", "field", "message"), [
    (ClientOptions, "rpc_timeout_seconds",
     "ClientOptions.rpc_timeout_seconds must be > 0, got -1"),
    (ClientOptions, "restore_timeout_seconds",
     "ClientOptions.restore_timeout_seconds must be > 0, got -1"),
    (ClientOptions, "backoff_seconds", "ClientOptions.backoff_seconds must be >= 0, got -1"),
    (BubbleSnapshotOptions, "warmup_iterations",
     "BubbleSnapshotOptions.warmup_iterations must be a whole number >= 0, got -1"),
    (BubbleSnapshotOptions, "min_report_seconds",
     "BubbleSnapshotOptions.min_report_seconds must be >= 0, got -1"),
    (BubbleSnapshotOptions, "smoothing", "BubbleSnapshotOptions.smoothing must be in (0, 1], "
                                         "got -1"),
])
def test_a_bad_value_names_its_option(options, field, message):
    with pytest.raises(ValueError) as info:
        options(**{field: -1})
    assert str(info.value) == message


@pytest.mark.parametrize(("options", "values"), [
    (ClientOptions, {"daemon": ""}),
    (ClientOptions, {"rpc_timeout_seconds": float("nan")}),
    (ClientOptions, {"rpc_timeout_seconds": "5"}),
    (ClientOptions, {"verify_restore": 1}),
    (BubbleSnapshotOptions, {"warmup_iterations": 1.5}),
    (BubbleSnapshotOptions, {"eager": "yes"}),
    (BubbleSnapshotOptions, {"smoothing": 0}),
    (BubbleSnapshotOptions, {"smoothing": 1.5}),
])
def test_values_of_the_wrong_kind_or_range_are_refused(options, values):
    (field,) = values
    with pytest.raises(ValueError, match=rf"^{options.__name__}\.{field} must be "):
        options(**values)


def test_options_are_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        ClientOptions("127.0.0.1:7070")
    with pytest.raises(TypeError):
        BubbleSnapshotOptions(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClientOptions().daemon = "elsewhere"
    assert BubbleSnapshotOptions(smoothing=1).smoothing == 1
    assert ClientOptions(backoff_seconds=0).backoff_seconds == 0
