"""Snapshot and restore through a real daemon process: dtypes, shardings, steps."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bubblesnap.clients import ClientOptions, NumpyClient, RestoreError
from bubblesnap.clients.jax import SnapshotClient

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.int32, jnp.uint8, jnp.bool_]
SPECS = {"replicated": P(), "rows": P("a"), "grid": P("a", "b"), "cols": P(None, "b")}


def _mesh():
    return Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))


def _state(step: int, mesh):
    """A state whose every value depends on the step, in each dtype and sharding."""
    state = {}
    rng = np.random.default_rng(step)
    for dtype in DTYPES:
        for label, spec in SPECS.items():
            host = rng.standard_normal((8, 6)) * 100
            host = host > 0 if dtype == jnp.bool_ else host.astype(dtype)
            state[f"{jnp.dtype(dtype).name}/{label}"] = jax.device_put(
                host, NamedSharding(mesh, spec))
    return state


def _abstract(state, sharding_of=lambda x: x.sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=sharding_of(x)), state)


def _assert_equal(restored, expected):
    for name, array in expected.items():
        got = restored[name]
        assert got.dtype == array.dtype, name
        # Compare raw bytes: bit-for-bit, NaN-safe.
        assert np.asarray(got).tobytes() == np.asarray(array).tobytes(), name


def test_round_trip_every_dtype_and_sharding(daemon):
    mesh = _mesh()
    client = SnapshotClient("roundtrip", options=ClientOptions(daemon=daemon.address))
    states = {step: _state(step, mesh) for step in range(3)}
    for step, state in states.items():
        result = client.snapshot(step, state, wait=True)
        assert result.taken and result.committed, result.reason

    restored = client.restore(_abstract(states[2]))
    assert restored.step == 2
    _assert_equal(restored.state, states[2])
    for name, array in restored.state.items():
        assert array.sharding == states[2][name].sharding, name

    older = client.restore(_abstract(states[1]), step=1)
    assert older.step == 1
    _assert_equal(older.state, states[1])


def test_restore_into_other_sharding(daemon):
    mesh = _mesh()
    client = SnapshotClient("reshard", options=ClientOptions(daemon=daemon.address))
    state = _state(7, mesh)
    assert client.snapshot(7, state, wait=True).taken
    flipped = _abstract(state, lambda x: NamedSharding(mesh, P("b", "a")))
    restored = client.restore(flipped)
    _assert_equal(restored.state, state)
    single = _abstract(state, lambda x: jax.sharding.SingleDeviceSharding(jax.devices()[3]))
    restored = client.restore(single)
    _assert_equal(restored.state, state)
    assert all(a.devices() == {jax.devices()[3]} for a in restored.state.values())


def test_restore_rejects_mismatched_target(daemon):
    client = SnapshotClient("mismatch", options=ClientOptions(daemon=daemon.address))
    state = {"w": jnp.ones((4, 4), jnp.float32)}
    assert client.snapshot(0, state, wait=True).taken
    with pytest.raises(RestoreError, match="float32"):
        client.restore({"w": jax.ShapeDtypeStruct((4, 5), jnp.float32)})
    with pytest.raises(RestoreError, match="no tensor"):
        client.restore({"v": jax.ShapeDtypeStruct((4, 4), jnp.float32)})


def test_retention_keeps_the_newest_steps(start_daemon):
    daemon = start_daemon("--keep", "2")
    client = SnapshotClient("keep", options=ClientOptions(daemon=daemon.address))
    for step in range(5):
        assert client.snapshot(step, {"w": jnp.full((16,), step, jnp.int32)}, wait=True).taken
    steps = [s.step for s in client.status().steps]
    assert steps == [3, 4]
    with pytest.raises(RestoreError, match="NOT_FOUND"):
        client.restore({"w": jax.ShapeDtypeStruct((16,), jnp.int32)}, step=1)


def test_numpy_client_without_jax_arrays(daemon):
    client = NumpyClient("plain", options=ClientOptions(daemon=daemon.address))
    arrays = {"weights": np.arange(12, dtype=np.float64).reshape(3, 4),
              "bf16": np.linspace(0, 1, 10).astype(ml_dtypes.bfloat16),
              "count": np.array(42, dtype=np.int64)}
    assert client.snapshot(3, arrays).committed
    step, restored = client.restore()
    assert step == 3
    for name, array in arrays.items():
        assert restored[name].dtype == array.dtype
        assert restored[name].shape == array.shape
        assert restored[name].tobytes() == array.tobytes()


def test_restored_arrays_outlive_the_snapshot_they_came_from(start_daemon):
    daemon = start_daemon("--keep", "1")
    client = SnapshotClient("outlive", options=ClientOptions(daemon=daemon.address))
    state = {"w": jnp.arange(4096, dtype=jnp.float32)}
    assert client.snapshot(0, state, wait=True).committed
    restored = client.restore({"w": jax.ShapeDtypeStruct((4096,), jnp.float32)}).state
    for step in range(1, 4):  # step 0 is retired; its segment is unlinked, not reused
        assert client.snapshot(step, {"w": state["w"] + step}, wait=True).committed
    assert np.asarray(restored["w"]).tobytes() == np.asarray(state["w"]).tobytes()
    assert [s.step for s in client.status().steps] == [3]
