"""A GPT-style decoder in Flax, split into pipeline stages, trained with optax AdamW.

Stage 0 embeds tokens; the last stage ends with the LM head and the loss.
Each stage's parameters and optimizer state live on that stage's devices; with
several devices per stage the larger kernels are sharded over them (intra-stage
model parallelism) and XLA partitions the computation.

Backward recomputes the stage's forward (activation recomputation), so a
stage only keeps its microbatches' inputs between F and B.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 4096
    d_model: int = 256
    heads: int = 4
    layers_per_stage: tuple[int, ...] = (2,)  # one entry per stage, or one for all
    seq_len: int = 32
    microbatch_size: int = 2
    learning_rate: float = 3e-4


class Block(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=c.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(c.d_model)(nn.gelu(nn.Dense(4 * c.d_model)(h)))


class Stage(nn.Module):
    config: GPTConfig
    first: bool
    last: bool
    layers: int

    @nn.compact
    def __call__(self, x):
        c = self.config
        if self.first:
            x = nn.Embed(c.vocab, c.d_model)(x) + self.param(
                "positions", nn.initializers.normal(0.02), (c.seq_len, c.d_model))
        for _ in range(self.layers):
            x = Block(c)(x)
        if self.last:
            x = nn.Dense(c.vocab)(nn.LayerNorm()(x))
        return x


def batch(config: GPTConfig, step: int, microbatch: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and next-token targets; a pure function of (step, microbatch)."""
    rng = np.random.default_rng([step, microbatch])
    tokens = rng.integers(0, config.vocab, (config.microbatch_size, config.seq_len + 1))
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)


def _kernel_sharding(mesh: Mesh, leaf) -> NamedSharding:
    """Shard the last axis of big kernels over the stage's devices, replicate the rest."""
    size = mesh.devices.size
    if size > 1 and leaf.ndim >= 2 and leaf.shape[-1] % size == 0 and leaf.size >= 1 << 14:
        return NamedSharding(mesh, P(*([None] * (leaf.ndim - 1)), "model"))
    return NamedSharding(mesh, P())


class StageProgram:
    """Jitted forward, backward and update of one stage, placed on its devices."""

    def __init__(self, config: GPTConfig, stages: int, stage: int, devices):
        self.config, self.first, self.last = config, stage == 0, stage == stages - 1
        self.mesh = Mesh(np.array(devices), ("model",))
        layers = config.layers_per_stage
        self.module = Stage(config, self.first, self.last,
                            layers[stage] if len(layers) == stages else layers[0])
        self.optimizer = optax.adamw(config.learning_rate)
        self.replicated = NamedSharding(self.mesh, P())
        shape = (config.microbatch_size, config.seq_len)
        sample = jnp.zeros(shape, jnp.int32) if self.first else jnp.zeros(
            (*shape, config.d_model), jnp.float32)
        params = self.module.init(jax.random.key(stage), sample)
        place = functools.partial(jax.tree.map,
                                  lambda x: jax.device_put(x, _kernel_sharding(self.mesh, x)))
        params = place(params)
        # optax's init makes its counters uncommitted on the default device: place the
        # whole state on this stage's devices, so a restored state lands where it was.
        self.state = {"params": params, "opt_state": place(jax.jit(self.optimizer.init)(params))}
        self._forward = jax.jit(self._forward_impl)
        self._backward = jax.jit(self._backward_impl)
        self._update = jax.jit(self._update_impl)
        self._accumulate = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))

    def _loss(self, params, x, targets):
        logits = self.module.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def _forward_impl(self, params, x, targets):
        if self.last:
            return self._loss(params, x, targets)
        return self.module.apply(params, x)

    def _backward_impl(self, params, x, upstream):
        """(param grads, input grads), recomputing the forward; stage 0 has no input grads."""
        if self.last:
            return jax.grad(lambda p, x_: self._loss(p, x_, upstream), argnums=(0, 1))(params, x)
        if self.first:
            _, vjp = jax.vjp(lambda p: self.module.apply(p, x), params)
            return vjp(upstream)[0], None
        _, vjp = jax.vjp(self.module.apply, params, x)
        return vjp(upstream)

    def _update_impl(self, state, grads):
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    def place(self, array):
        return jax.device_put(array, self.replicated)

    def forward(self, x, targets=None, params=None):
        """The stage's output (the last stage: its loss); ``params`` (default: the stage's
        own) may be a copy placed elsewhere, e.g. a replay worker's on its device."""
        return self._forward(self.state["params"] if params is None else params, x, targets)

    def backward(self, x, upstream, params=None):
        """(param grads, input grads) of one microbatch; ``params`` as in :meth:`forward`."""
        return self._backward(self.state["params"] if params is None else params, x, upstream)

    def accumulate(self, total, grads):
        return grads if total is None else self._accumulate(total, grads)

    def updated(self, grads):
        """The state one optimizer step on ``grads`` makes of the stage's, without keeping it."""
        return self._update(self.state, grads)

    def update(self, grads) -> None:
        self.state = self.updated(grads)

    def state_bytes(self) -> int:
        return sum(x.nbytes for x in jax.tree.leaves(self.state))
