"""A decoder-only transformer (GPT) as a chain of blocks cut into pipeline stages.

The chain is: the token embedding with learned positions (always on stage 0),
`num_layers` pre-LayerNorm blocks of causal multi-head self-attention and an
MLP, and the final LayerNorm with an untied output head (always on the last
stage). Tied input and output embeddings would live on two devices and get
gradients of different staleness, so they are not offered. There is no
dropout: a stochastic layer would need its randomness keyed by (seed, step,
stage, microbatch) in the engine and in the reference alike.

>>> import jax.numpy as jnp
>>> stages = gpt(vocab_size=256, num_layers=2, num_heads=2, dim=16, context=8, num_stages=2)
>>> tokens = jnp.zeros((3, 8), jnp.int32)
>>> h = stages[0](tokens)
>>> h.shape, stages[1](h).shape  # stage 0: embedding + a block; stage 1: a block + the head
((3, 8, 16), (3, 8, 256))
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from dgrad.models.common import as_rngs
from dgrad.models.split import Blocks


class Embedding(nnx.Module):
    """Token embedding plus a learned position embedding, for windows of up to `context`.

    >>> import jax.numpy as jnp
    >>> embed = Embedding(256, 8, context=4, rngs=nnx.Rngs(0))
    >>> embed(jnp.array([[1, 2, 3]])).shape
    (1, 3, 8)
    """

    def __init__(self, vocab_size: int, dim: int, *, context: int, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.tokens = nnx.Embed(vocab_size, dim, embedding_init=init, rngs=rngs)
        self.positions = nnx.Param(init(rngs.params(), (context, dim)))

    def __call__(self, tokens):
        length = tokens.shape[-1]
        return self.tokens(tokens) + self.positions[...][:length]


class Block(nnx.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)): causal self-attention through
    `jax.nn.dot_product_attention` (fused kernels on GPUs) and a 4x GELU MLP.

    >>> import jax.numpy as jnp
    >>> block = Block(8, 2, rngs=nnx.Rngs(0))
    >>> x = jnp.ones((2, 5, 8))
    >>> y = block(x)
    >>> y.shape, bool(jnp.allclose(block(x[:, :3])[:, :3], y[:, :3], atol=1e-6))  # causal
    ((2, 5, 8), True)
    """

    def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
        if dim % num_heads:
            raise ValueError(f"dim={dim} must be a multiple of num_heads={num_heads}.")
        self.num_heads = num_heads
        dense = nnx.initializers.normal(0.02)
        self.attention_norm = nnx.LayerNorm(dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, kernel_init=dense, rngs=rngs)
        self.out = nnx.Linear(dim, dim, kernel_init=dense, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, kernel_init=dense, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, kernel_init=dense, rngs=rngs)

    def __call__(self, x):
        batch, length, dim = x.shape
        heads = self.num_heads
        q, k, v = jnp.split(self.qkv(self.attention_norm(x)), 3, axis=-1)
        q, k, v = (a.reshape(batch, length, heads, dim // heads) for a in (q, k, v))
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.reshape(batch, length, dim))
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class Head(nnx.Module):
    """The final LayerNorm and the (untied) projection to the vocabulary's logits.

    >>> import jax.numpy as jnp
    >>> Head(8, 256, rngs=nnx.Rngs(0))(jnp.ones((2, 3, 8))).shape
    (2, 3, 256)
    """

    def __init__(self, dim: int, vocab_size: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.logits = nnx.Linear(
            dim, vocab_size, kernel_init=nnx.initializers.normal(0.02), rngs=rngs
        )

    def __call__(self, x):
        return self.logits(self.norm(x))


def gpt(
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    dim: int,
    context: int,
    num_stages: int = 1,
    *,
    split: str | Sequence[int] = "balanced",
    rngs=0,
) -> list[nnx.Sequential]:
    """A GPT of `num_layers` blocks cut into `num_stages` stages at block boundaries
    (`split="balanced"`: equal multiply-adds per stage, or explicit cut indices into the
    chain embedding, block 1 .. block L, head).

    >>> stages = gpt(256, num_layers=4, num_heads=2, dim=16, context=8, num_stages=3)
    >>> [len(stage.layers) for stage in stages]  # the head of 256 logits weighs a block
    [3, 2, 1]
    >>> [len(stage.layers) for stage in gpt(256, 4, 2, 16, 8, num_stages=3, split=[2, 4])]
    [2, 2, 2]
    """
    return gpt_blocks(vocab_size, num_layers, num_heads, dim, context, rngs=rngs).stages(
        num_stages, split
    )


def gpt_blocks(
    vocab_size: int, num_layers: int, num_heads: int, dim: int, context: int, *, rngs=0
) -> Blocks:
    """The GPT as a chain of blocks with their multiply-adds per token window (for
    balancing): attention's projections and scores, the MLP, the head; the embedding's
    lookup counts as nothing.

    >>> blocks = gpt_blocks(256, num_layers=2, num_heads=2, dim=16, context=8)
    >>> len(blocks.modules), blocks.costs[0], blocks.costs[1] == blocks.costs[2]
    (4, 0, True)
    """
    rngs = as_rngs(rngs)
    block_cost = context * 12 * dim * dim + 2 * context * context * dim
    modules = [
        Embedding(vocab_size, dim, context=context, rngs=rngs),
        *(Block(dim, num_heads, rngs=rngs) for _ in range(num_layers)),
        Head(dim, vocab_size, rngs=rngs),
    ]
    costs = [0, *[block_cost] * num_layers, context * dim * vocab_size]
    return Blocks(modules, costs, name=f"GPT-{num_layers}")


def sample(
    model: nnx.Module,
    prompt: Sequence[int],
    length: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[int]:
    """`prompt` (token ids) continued by `length` tokens of the GPT `model` (its stages, or
    `dgrad.train.export.load`'s merged model): the most likely token at `temperature` 0,
    else one drawn from softmax(logits / temperature). The model sees the newest `context`
    tokens; one compiled call per token.

    >>> stages = gpt(256, num_layers=1, num_heads=2, dim=16, context=8, rngs=1)
    >>> model = nnx.Sequential(*stages)
    >>> greedy = sample(model, list(b"ab"), 12)
    >>> len(greedy), greedy[:2] == list(b"ab"), greedy == sample(model, list(b"ab"), 12)
    (14, True, True)
    >>> drawn = sample(model, list(b"ab"), 12, temperature=1.0, seed=3)
    >>> drawn == sample(model, list(b"ab"), 12, temperature=1.0, seed=3), drawn != greedy
    (True, True)
    """
    if not prompt:
        raise ValueError("sample needs a prompt of at least one token.")
    embedding = next(m for _, m in nnx.iter_graph(model) if isinstance(m, Embedding))
    context = embedding.positions.shape[0]
    graphdef, weights = nnx.split(model)

    @jax.jit
    def next_token(weights, window, last, key):
        logits = nnx.merge(graphdef, weights)(window[None])[0, last]  # causal: the pad is unseen
        drawn = jax.random.categorical(key, logits / max(temperature, 1e-6))
        return drawn if temperature > 0 else jnp.argmax(logits)

    tokens, key = list(prompt), jax.random.key(seed)
    for _ in range(length):
        seen = tokens[-context:]
        window = jnp.asarray(seen + [0] * (context - len(seen)), jnp.int32)
        key, step_key = jax.random.split(key)
        tokens.append(int(next_token(weights, window, len(seen) - 1, step_key)))
    return tokens
