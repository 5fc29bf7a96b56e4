"""A small transformer language model in plain JAX (no Flax, no Optax).

Vocabulary: ``ModelConfig.vocab`` ids (the demo's BPE; the 256 byte values by default), id 0
ending a document. Pre-norm decoder blocks with causal multi-head attention
and a GELU MLP, learned positions, tied input/output embeddings, AdamW with warmup and
cosine decay. The train state is a plain dict pytree: ``{"params", "opt", "step"}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

VOCAB = 256

Params = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Sizes of the model and the optimizer's schedule."""

    seq_len: int = 128
    vocab: int = VOCAB
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    lr: float = 3e-3
    warmup_steps: int = 20
    total_steps: int = 300
    weight_decay: float = 0.01


def _dense(key: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
    return jax.random.normal(key, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)


def init_params(key: jax.Array, cfg: ModelConfig) -> Params:
    """Random parameters for `cfg` (deterministic in `key`)."""
    d = cfg.d_model
    keys = jax.random.split(key, 2 + cfg.num_layers)
    layers = []
    for k in keys[2:]:
        kq, ko, k1, k2 = jax.random.split(k, 4)
        layers.append(
            {
                "ln1": jnp.ones(d),
                "qkv": _dense(kq, d, 3 * d),
                "out": _dense(ko, d, d) / math.sqrt(2 * cfg.num_layers),
                "ln2": jnp.ones(d),
                "up": _dense(k1, d, 4 * d),
                "down": _dense(k2, 4 * d, d) / math.sqrt(2 * cfg.num_layers),
            }
        )
    return {
        "embed": jax.random.normal(keys[0], (cfg.vocab, d)) * 0.02,
        "pos": jax.random.normal(keys[1], (cfg.seq_len, d)) * 0.02,
        "layers": layers,
        "ln_f": jnp.ones(d),
    }


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _attention(x: jax.Array, layer: Params, num_heads: int) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, num_heads, d // num_heads) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // num_heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d) @ layer["out"]


def logits(params: Params, tokens: jax.Array, num_heads: int) -> jax.Array:
    """Next-token logits (B, T, vocab) for int tokens (B, T)."""
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    for layer in params["layers"]:
        x = x + _attention(_norm(x, layer["ln1"]), layer, num_heads)
        x = x + jax.nn.gelu(_norm(x, layer["ln2"]) @ layer["up"]) @ layer["down"]
    return _norm(x, params["ln_f"]) @ params["embed"].T


def row_losses(params: Params, window: jax.Array, num_heads: int) -> jax.Array:
    """Mean next-token cross-entropy (nats) of each row of `window` (B, T+1)."""
    tokens = window.astype(jnp.int32)
    logp = jax.nn.log_softmax(logits(params, tokens[:, :-1], num_heads))
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -jnp.mean(picked, axis=-1)


def learning_rate(step: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Linear warmup, then cosine decay to a tenth of the peak at `total_steps`."""
    warm = (step + 1) / cfg.warmup_steps
    progress = jnp.clip(
        (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps), 0, 1
    )
    cosine = 0.1 + 0.45 * (1 + jnp.cos(jnp.pi * progress))
    return cfg.lr * jnp.where(step < cfg.warmup_steps, warm, cosine)


def init_state(key: jax.Array, cfg: ModelConfig) -> dict[str, Any]:
    """The train state: parameters, AdamW moments, step counter."""
    params = init_params(key, cfg)
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"params": params, "opt": {"mu": zeros, "nu": zeros}, "step": jnp.zeros((), jnp.int32)}


def adamw(state: dict[str, Any], grads: Params, cfg: ModelConfig) -> dict[str, Any]:
    """One AdamW update (b1 0.9, b2 0.95) with global-norm clipping at 1."""
    step = state["step"] + 1
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), grads)
    mu = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["opt"]["mu"], grads)
    nu = jax.tree.map(lambda v, g: 0.95 * v + 0.05 * g * g, state["opt"]["nu"], grads)
    lr = learning_rate(state["step"], cfg)

    def update(p: jax.Array, m: jax.Array, v: jax.Array) -> jax.Array:
        m_hat, v_hat = m / (1 - 0.9**step), v / (1 - 0.95**step)
        decay = cfg.weight_decay * p if p.ndim == 2 else 0.0
        return p - lr * (m_hat / (jnp.sqrt(v_hat) + 1e-8) + decay)

    params = jax.tree.map(update, state["params"], mu, nu)
    return {"params": params, "opt": {"mu": mu, "nu": nu}, "step": step}


def make_step(cfg: ModelConfig, source_names: tuple[str, ...]) -> Any:
    """The step for `roxxel.train.fit`: (state, batch) -> (state, {"loss", per-source losses}).

    With the loader's provenance (``batch["source"]``, the source id of each row) the loss
    of each source is reported too, so the curriculum's effect shows in the metrics.
    """

    def step(state: dict[str, Any], batch: dict[str, jax.Array]) -> Any:
        def loss_fn(params: Params) -> tuple[jax.Array, jax.Array]:
            rows = row_losses(params, batch["tokens"], cfg.num_heads)
            return jnp.mean(rows), rows

        (loss, rows), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        metrics = {"loss": loss, "lr": learning_rate(state["step"], cfg)}
        if "source" in batch:
            for i, name in enumerate(source_names):
                mine = batch["source"] == i
                metrics[f"loss_{name}"] = jnp.sum(rows * mine) / jnp.maximum(jnp.sum(mine), 1)
                metrics[f"rows_{name}"] = jnp.sum(mine)
        return adamw(state, grads, cfg), metrics

    return step


Codec = tuple[Callable[[str], list[int]], Callable[[list[int]], str]]


def _bytes_codec() -> Codec:
    return list, lambda ids: bytes(ids).decode("utf-8", errors="replace")


def generate(
    params: Params, prompt: str, cfg: ModelConfig, num_tokens: int = 160, codec: Codec | None = None
) -> str:
    """Samples a continuation of `prompt` token by token (temperature 0.8, fixed seed).

    ``codec`` is (encode, decode) of the tokenizer (default: UTF-8 bytes). Stops at the
    end-of-document id (0). Each token is one forward pass over a window of `cfg.seq_len`
    tokens; causal attention makes the zero padding after the prompt harmless.
    """
    encode, decode = codec or _bytes_codec()
    next_logits = jax.jit(lambda p, t, i: logits(p, t, cfg.num_heads)[0, i])
    key = jax.random.key(0)
    out = list(encode(prompt))
    for k in range(num_tokens):
        window = np.zeros((1, cfg.seq_len), np.int32)
        recent = out[-cfg.seq_len :]
        window[0, : len(recent)] = recent
        scores = next_logits(params, window, len(recent) - 1) / 0.8
        token = int(jax.random.categorical(jax.random.fold_in(key, k), scores))
        if token == 0:
            break
        out.append(token)
    return decode(out)
