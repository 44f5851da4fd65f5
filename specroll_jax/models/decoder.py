"""Qwen2 / Qwen2.5 / Llama-3 decoder in Flax (linen), with pure functions at the boundary.

Two kinds of step:

* :func:`step`: tokens at explicit positions with an explicit mask over [cache + new tokens],
  the cache only read. It returns the last layer's hidden states *before* the final norm (what
  the heads and the sampler read), the step's own K/V per layer, and logits (f32) unless the
  caller passes ``compute_logits=False`` (the engines do: they sample from the hidden states).
  Uses: the full causal forward (``forward``), the prefill of ragged right-padded prompts
  (``prefill``, which then scatters the K/V into the cache with :func:`write_cache`), and tree
  verification (each node sees the valid cache prefix and its tree ancestors; the accepted nodes'
  K/V are committed afterwards with :func:`write_cache`).
* :func:`append_step`: the decode step. Each token's K/V are written into the cache buffers in
  place first, then the token attends the cache (no cache copy per step); it returns
  the hidden states and the updated cache (no logits).

``kernels`` (a :class:`specroll_jax.kernels.Kernels`, or a choice name resolved on the spot) picks
the attention implementation. Parameters are the ``params`` collection of :class:`Decoder`
(layers stacked on a leading axis by ``nn.scan``; ``unstack_layers`` slices them once outside a
loop); dense kernels are stored [in, out].

Two ways through the layers (``layer_loop.LayerLoop``; docs/benchmarks.md, "Compile time"): unrolled
over per-layer weight slices (one copy of the block per program part; inside a decode ``while_loop``
the slices are loop invariants, so no weight is copied per step) or a ``lax.scan`` over the stacked
weights (one copy of the block, so compile time does not grow with depth; XLA on CPU copies each
layer's weights out of the stack on every pass). Forwards without a cache (prefill, ``forward``, the
trainer's log-probs) follow ``LayerLoop.full``; steps over a cache follow the cache's layout, which
``init_cache`` takes from ``LayerLoop.cached``: a tuple of per-layer buffers runs unrolled, one
stacked [B, Ly, L, Hkv, Dh] buffer runs the scan. The policy is read when a function is traced.
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from specroll_jax.kernels import REFERENCE, Kernels
from specroll_jax.models.config import ModelConfig
from specroll_jax.models.layer_loop import LAYER_LOOPS, layer_loop_policy


@flax.struct.dataclass
class KVCache:
  """Keys and values of the committed tokens in one of two layouts (``LayerLoop.cached``): a
  tuple of one buffer per layer, which the unrolled loop updates in place (a stacked buffer would
  be sliced per layer and copied on every step), or one stacked buffer per K and V with the batch
  axis first (so compaction takes rows of every leaf alike), which the layer scan carries."""

  k: tuple | Array  # Ly x [B, L, Hkv, Dh] or [B, Ly, L, Hkv, Dh]: row b valid up to lengths[b]
  v: tuple | Array  # as k
  lengths: Int[Array, " B"]  # number of committed tokens per row

  @property
  def is_stacked(self) -> bool:
    return not isinstance(self.k, tuple | list)

  @property
  def max_length(self) -> int:
    return self.k.shape[2] if self.is_stacked else self.k[0].shape[1]

  def stacked(self):
    """(k, v) as [Ly, B, L, Hkv, Dh] arrays (a copy; for inspection and tests)."""
    if self.is_stacked:
      return jnp.moveaxis(self.k, 1, 0), jnp.moveaxis(self.v, 1, 0)
    return jnp.stack(self.k), jnp.stack(self.v)

  def take_rows(self, rows: Int[Array, " R"]) -> KVCache:
    """The cache of the given batch rows (compaction into a smaller bucket)."""
    if self.is_stacked:
      return KVCache(k=self.k[rows], v=self.v[rows], lengths=self.lengths[rows])
    return KVCache(k=tuple(x[rows] for x in self.k), v=tuple(x[rows] for x in self.v),
                   lengths=self.lengths[rows])


@flax.struct.dataclass
class StepOutput:
  logits: Float[Array, "B T V"] | None  # float32 (None when the step was asked for none)
  hidden: Float[Array, "B T D"]  # last layer output before the final norm
  k_new: Float[Array, "Ly B T Hkv Dh"]
  v_new: Float[Array, "Ly B T Hkv Dh"]


def init_cache(config: ModelConfig, batch: int, max_length: int, dtype=None, *,
               layout: str | None = None) -> KVCache:
  """An empty cache; ``layout`` "unroll" (per-layer buffers) or "scan" (stacked), by default
  ``LayerLoop.cached`` of the current policy."""
  layout = layout or layer_loop_policy().cached
  if layout not in LAYER_LOOPS:
    raise ValueError(f"layout must be one of {LAYER_LOOPS}, got {layout!r}")
  shape = (batch, max_length, config.num_kv_heads, config.head_dim)
  dtype = dtype or config.jnp_dtype
  lengths = jnp.zeros((batch,), jnp.int32)
  if layout == "scan":
    stacked = (batch, config.num_layers, *shape[1:])
    return KVCache(k=jnp.zeros(stacked, dtype), v=jnp.zeros(stacked, dtype), lengths=lengths)
  zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
  return KVCache(k=zeros(), v=zeros(), lengths=lengths)


def _scatter_rows(buf, new, slots, layer=None):
  """buf [B, L, ...] <- new [B, T, ...] at slots [B, T] (out-of-range slots dropped); with
  ``layer``, buf is stacked [B, Ly, L, ...] and that layer is written; with layer ``slice(None)``,
  new is [B, T, Ly, ...] and every layer is written."""
  slots = jnp.where(slots < 0, buf.shape[1 if layer is None else 2], slots)
  # one scatter per row, vmapped: the rows are a batch dimension of the scatter, so a cache split
  # over rows (a data axis) is written where it lies, with no gather of the rows' K/V
  if layer is None:
    one = lambda buf, new, slots: buf.at[slots].set(new, mode="drop")
  elif isinstance(layer, slice):  # every layer: a row's new is [T, Ly, ...], its buf [Ly, L, ...]
    one = lambda buf, new, slots: buf.at[layer, slots].set(jnp.moveaxis(new, 0, 1), mode="drop")
  else:
    one = lambda buf, new, slots: buf.at[layer, slots].set(new, mode="drop")
  return jax.vmap(one)(buf, new.astype(buf.dtype), slots)


def rms_norm(x, scale, eps: float):
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def _inv_freq(config: ModelConfig):
  dh = config.head_dim
  inv = 1.0 / (config.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  if config.rope_scaling:
    # Llama-3 frequency-dependent rope scaling (transformers' _compute_llama3_parameters).
    rs = dict(config.rope_scaling)
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    inv_l = jnp.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    inv = jnp.where(medium, smoothed, inv_l)
  return inv


def rope(x, positions, config: ModelConfig):
  """Rotary embedding (transformers' rotate-half convention). x [B, T, H, Dh], positions [B, T]."""
  freqs = positions.astype(jnp.float32)[..., None] * _inv_freq(config)  # [B, T, Dh/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * cos + rot * sin).astype(x.dtype)


class RMSNorm(nn.Module):
  eps: float
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
    return rms_norm(x, scale, self.eps)


class Block(nn.Module):
  """One decoder layer. Carry: hidden [B, T, D]; scanned input: this layer's (k_cache, v_cache).

  write: for the decode step, a function (k, v) -> this layer's (k_cache, v_cache) with the step's
  K/V [B, T, Hkv, Dh] written in place (``layer_cache`` is then unused); the tokens then attend
  the cache only.
  """

  config: ModelConfig
  attention_fn: callable

  @nn.compact
  def __call__(self, x, layer_cache, positions, cache_lengths, mask, write=None):
    c = self.config
    dt = c.jnp_dtype
    dense = functools.partial(nn.Dense, dtype=dt, param_dtype=dt,
                              kernel_init=nn.initializers.normal(0.02))
    b, t, _ = x.shape
    h = RMSNorm(c.rms_norm_eps, dt, name="attn_norm")(x)
    q = dense(c.num_heads * c.head_dim, use_bias=c.qkv_bias, name="q_proj")(h)
    k = dense(c.num_kv_heads * c.head_dim, use_bias=c.qkv_bias, name="k_proj")(h)
    v = dense(c.num_kv_heads * c.head_dim, use_bias=c.qkv_bias, name="v_proj")(h)
    q = rope(q.reshape(b, t, c.num_heads, c.head_dim), positions, c)
    k = rope(k.reshape(b, t, c.num_kv_heads, c.head_dim), positions, c)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    if write is not None:
      # Decode: write this step's K/V into the layer's cache in place first, then attend the
      # cache only (the new-token block is masked out), so no cache copy is ever needed.
      k_cache, v_cache = write(k, v)
      attn = self.attention_fn(q, k_cache, v_cache, cache_lengths + t, k, v,
                               jnp.zeros((b, t, t), bool))
    else:
      k_cache, v_cache = layer_cache
      attn = self.attention_fn(q, k_cache, v_cache, cache_lengths, k, v, mask)
    x = x + dense(c.hidden_size, use_bias=False, name="o_proj")(attn.reshape(b, t, -1))
    h = RMSNorm(c.rms_norm_eps, dt, name="mlp_norm")(x)
    gate = dense(c.intermediate_size, use_bias=False, name="gate_proj")(h)
    up = dense(c.intermediate_size, use_bias=False, name="up_proj")(h)
    x = x + dense(c.hidden_size, use_bias=False, name="down_proj")(nn.silu(gate) * up)
    return x, ((k, v), (k_cache, v_cache))


class Decoder(nn.Module):
  config: ModelConfig
  attention_fn: callable

  @nn.compact
  def __call__(self, tokens, positions, cache_k, cache_v, cache_lengths, mask):
    c = self.config
    dt = c.jnp_dtype
    embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=dt, param_dtype=dt,
                     embedding_init=nn.initializers.normal(0.02), name="embed")
    x = embed(tokens)
    layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                     in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=c.num_layers)
    x, ((k_new, v_new), _) = layers(c, self.attention_fn, name="layers")(
        x, (cache_k, cache_v), positions, cache_lengths, mask)
    if self.is_initializing():  # register the output parameters; logits come from
      RMSNorm(c.rms_norm_eps, dt, name="final_norm")(x)  # ``logits_from_hidden`` (one code path)
      if not c.tie_word_embeddings:
        nn.Dense(c.vocab_size, use_bias=False, dtype=dt, param_dtype=dt,
                 kernel_init=nn.initializers.normal(0.02), name="lm_head")(x)
    return x, k_new, v_new


def _attention(kernels):
  return Kernels.resolve(kernels).attention_fn


def init_params(key, config: ModelConfig):
  """Random parameters (normal(0.02) dense/embeddings, unit norms, zero biases)."""
  tokens = jnp.zeros((1, 2), jnp.int32)
  empty = jnp.zeros((config.num_layers, 1, 0, config.num_kv_heads, config.head_dim),
                    config.jnp_dtype)
  variables = Decoder(config, _attention(REFERENCE)).init(
      key, tokens, jnp.zeros((1, 2), jnp.int32), empty, empty, jnp.zeros((1,), jnp.int32),
      jnp.ones((1, 2, 2), bool))
  return variables["params"]


@functools.lru_cache(maxsize=16)
def _expected_leaves(config: ModelConfig) -> dict:
  """{path: (shape, dtype)} of ``init_params``'s tree for ``config`` (traced once per config)."""
  shapes = jax.eval_shape(lambda: init_params(jax.random.key(0), config))
  return {jax.tree_util.keystr(p): (tuple(x.shape), jnp.dtype(x.dtype))
          for p, x in jax.tree_util.tree_flatten_with_path(shapes)[0]}


def check_params(config: ModelConfig, params, what: str = "params") -> None:
  """ValueError naming the leaf unless ``params`` is the decoder's parameter tree for ``config``
  (the same leaves, each of the config's shape and dtype; ``layers`` stacked, or unstacked by
  ``unstack_layers``): what a wrong checkpoint, a vocabulary mismatch (``jnp.take`` would clip
  token ids silently) or another dtype would otherwise do inside the compiled rollout."""
  if not isinstance(params, dict) or "layers" not in params:
    raise ValueError(f"{what} must be the decoder's parameter dict (with 'layers'), got "
                     f"{type(params).__name__}")
  layers = params["layers"]
  if isinstance(layers, tuple | list):  # unstacked: compare the restacked shapes
    if len(layers) != config.num_layers:
      raise ValueError(f"{what}['layers'] holds {len(layers)} layers, the config "
                       f"{config.num_layers}")
    layers = jax.tree.map(lambda *a: jax.ShapeDtypeStruct((len(a), *a[0].shape), a[0].dtype),
                          *layers)
    params = {**params, "layers": layers}
  want = _expected_leaves(config)
  got = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
  if missing or extra:
    raise ValueError(f"{what} does not fit the config: missing {missing[:4]}, unexpected "
                     f"{extra[:4]}")
  for name, (shape, dtype) in want.items():
    x = got[name]
    if tuple(np.shape(x)) != shape:
      raise ValueError(f"{what}{name} has shape {tuple(np.shape(x))}; the config "
                       f"(vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, "
                       f"num_layers={config.num_layers}, ...) needs {shape}")
    if jnp.dtype(x.dtype) != dtype:
      raise ValueError(f"{what}{name} is {jnp.dtype(x.dtype).name}; the config's dtype is "
                       f"{dtype.name} (cast the parameters or set ModelConfig.dtype)")


def unstack_layers(params):
  """Params with ``layers`` as a tuple of per-layer dicts (static slices of the stacked leaves).

  Call it once outside a decode loop; ``step`` accepts either form."""
  layers = params["layers"]
  if isinstance(layers, (tuple, list)):
    return params
  n = jax.tree.leaves(layers)[0].shape[0]
  return {**params, "layers": tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n))}


def step(config: ModelConfig, params, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
         cache: KVCache | None = None, mask: Bool[Array, "B T T"] | None = None, *,
         kernels: Kernels | str = "auto", compute_logits: bool = True) -> StepOutput:
  """Run the decoder on ``tokens`` at absolute ``positions`` over the valid prefix of ``cache``.

  mask: which new tokens each new token may attend (default causal). The cache is not modified.
  compute_logits: False skips the unembedding (callers that sample from ``hidden`` with the fused
  sampler never materialise [B, T, V]).
  """
  b, t = tokens.shape
  if mask is None:
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  if cache is None:
    cache = init_cache(config, b, 0, layout=layer_loop_policy().full)
  hidden, k_new, v_new, _ = _layers(config, params, tokens, positions, cache, mask, kernels)
  logits = logits_from_hidden(config, params, hidden) if compute_logits else None
  return StepOutput(logits=logits, hidden=hidden, k_new=k_new, v_new=v_new)


def append_step(config: ModelConfig, params, tokens: Int[Array, "B T"],
                cache: KVCache, slots: Int[Array, "B T"], *, kernels: Kernels | str = "auto"):
  """Decode step that appends: token j of row b sits at position lengths[b] + j, its K/V are
  written into the cache (in place, per layer) at ``slots`` (normally lengths[b] + j; < 0 to drop)
  before attention, so each token attends the cache prefix and itself and its predecessors.

  Returns (pre-norm hidden [B, T, D], cache with the K/V written; lengths unchanged).
  """
  b, t = tokens.shape
  positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  hidden, _, _, (ks, vs) = _layers(config, params, tokens, positions, cache, None, kernels,
                                   append_slots=slots)
  return hidden, cache.replace(k=ks, v=vs)


def _layers(config, params, tokens, positions, cache, mask, kernels, append_slots=None):
  """(pre-norm hidden [B, T, D], the step's k, v [Ly, B, T, Hkv, Dh], cache (k, v) with the
  step's K/V written when ``append_slots`` is given), by the loop of the cache's layout."""
  kernels = Kernels.resolve(kernels)
  block = Block(config, kernels.attention_fn)
  x = jnp.take(params["embed"]["embedding"], tokens, axis=0)
  layers = cache.k.shape[1] if cache.is_stacked else len(cache.k)
  if layers != config.num_layers:
    layout = "stacked [B, Ly, L, Hkv, Dh]" if cache.is_stacked else "a tuple of per-layer buffers"
    raise ValueError(f"cache holds K/V of {layers} layers ({layout}), the model has "
                     f"{config.num_layers}")
  mesh = kernels.mesh
  if mesh is not None:  # rows over data, KV heads over model (GSPMD places the rest from these)
    x = mesh.constrain_rows(x)
    cache = cache.replace(k=mesh.constrain_cache(cache.k), v=mesh.constrain_cache(cache.v))
  if cache.is_stacked:
    x, k_new, v_new, (ck, cv) = _scanned(block, params, x, positions, cache, mask, append_slots)
  else:
    x, k_new, v_new, (ck, cv) = _unrolled(block, params, x, positions, cache, mask, append_slots)
  if mesh is not None:
    ck, cv = mesh.constrain_cache(ck), mesh.constrain_cache(cv)
  return x, k_new, v_new, (ck, cv)


def _unrolled(block, params, x, positions, cache, mask, append_slots):
  # Unrolled over per-layer parameter slices (``unstack_layers``): inside a decode while_loop the
  # slices are loop invariants, so no weight is copied per step.
  layers = unstack_layers(params)["layers"]
  ks, vs, kc, vc = [], [], [], []
  for i, lp in enumerate(layers):
    layer_cache = (cache.k[i], cache.v[i])
    write = None
    if append_slots is not None:
      write = lambda k, v, c=layer_cache: (_scatter_rows(c[0], k, append_slots),
                                           _scatter_rows(c[1], v, append_slots))
    x, ((k, v), (ck, cv)) = block.apply({"params": lp}, x, layer_cache, positions, cache.lengths,
                                      mask, write)
    ks.append(k)
    vs.append(v)
    kc.append(ck)
    vc.append(cv)
  return x, jnp.stack(ks), jnp.stack(vs), (tuple(kc), tuple(vc))


def _scanned(block, params, x, positions, cache, mask, append_slots):
  """``_layers`` as one ``lax.scan`` over the stacked weights and the stacked cache. Layer i reads
  its cache slice [B, L, Hkv, Dh]; with ``append_slots`` it first writes its new K/V into the
  carried cache in place (only the [B, T] slots), then reads the slice."""
  layers = params["layers"]
  if isinstance(layers, tuple | list):  # slices of the stacked leaves: XLA folds this back
    layers = jax.tree.map(lambda *a: jnp.stack(a), *layers)
  n = jax.tree.leaves(layers)[0].shape[0]
  layer = lambda buf, i: jax.lax.dynamic_index_in_dim(buf, i, 1, keepdims=False)

  def body(carry, xs):
    x, ck, cv = carry
    lp, i = xs
    written = {}

    def write(k, v):  # write before reading, so the carried buffers are updated in place
      written["k"] = _scatter_rows(ck, k, append_slots, layer=i)
      written["v"] = _scatter_rows(cv, v, append_slots, layer=i)
      return layer(written["k"], i), layer(written["v"], i)

    if append_slots is None:
      x, ((k, v), _) = block.apply({"params": lp}, x, (layer(ck, i), layer(cv, i)), positions,
                                   cache.lengths, mask)
    else:
      x, ((k, v), _) = block.apply({"params": lp}, x, None, positions, cache.lengths, mask, write)
    return (x, written.get("k", ck), written.get("v", cv)), (k, v)

  (x, ck, cv), (k_new, v_new) = jax.lax.scan(body, (x, cache.k, cache.v),
                                             (layers, jnp.arange(n, dtype=jnp.int32)))
  return x, k_new, v_new, (ck, cv)


def forward(config: ModelConfig, params, tokens: Int[Array, "B T"], *,
            kernels: Kernels | str = "auto") -> Float[Array, "B T V"]:
  """Plain full causal forward: logits [B, T, V] (float32)."""
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return step(config, params, tokens, positions, kernels=kernels).logits


def write_cache(cache: KVCache, k_new, v_new, slots: Int[Array, "B T"]) -> KVCache:
  """Scatter the step's K/V [Ly, B, T, Hkv, Dh] into cache positions ``slots`` [B, T].

  A slot < 0 or >= the cache length is dropped (used for rejected tree nodes and padding).
  Lengths are not changed; the caller sets them.
  """
  if cache.is_stacked:
    every = slice(None)
    return cache.replace(k=_scatter_rows(cache.k, jnp.moveaxis(k_new, 0, 2), slots, layer=every),
                         v=_scatter_rows(cache.v, jnp.moveaxis(v_new, 0, 2), slots, layer=every))
  k = tuple(_scatter_rows(buf, k_new[i], slots) for i, buf in enumerate(cache.k))
  v = tuple(_scatter_rows(buf, v_new[i], slots) for i, buf in enumerate(cache.v))
  return cache.replace(k=k, v=v)


def prefill(config: ModelConfig, params, tokens: Int[Array, "B T"], lengths: Int[Array, " B"],
            cache: KVCache, *, kernels: Kernels | str = "auto"):
  """Prefill right-padded prompts (row b valid up to lengths[b] >= 1) into an empty cache.

  Returns (cache with lengths set, logits at each row's last prompt token [B, V],
  hidden there [B, D]).
  """
  b, t = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  valid = pos < lengths[:, None]
  mask = jnp.tril(jnp.ones((t, t), bool))[None] & valid[:, None, :]
  out = step(config, params, tokens, pos, None, mask, kernels=kernels, compute_logits=False)
  cache = write_cache(cache, out.k_new, out.v_new, jnp.where(valid, pos, -1))
  cache = cache.replace(lengths=lengths.astype(jnp.int32))
  hidden = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return cache, logits_from_hidden(config, params, hidden), hidden


def unembedding(config: ModelConfig, params) -> Float[Array, "D V"]:
  """The [D, V] unembedding matrix (the embedding's transpose when tied)."""
  if config.tie_word_embeddings:
    return params["embed"]["embedding"].T
  return params["lm_head"]["kernel"]


def unembedding_for_kernel(config: ModelConfig, params):
  """(matrix, layout) for the fused sampler without any transpose: the tied embedding table
  [V, D] as is ("vd"), or the untied lm_head kernel [D, V] ("dv")."""
  if config.tie_word_embeddings:
    return params["embed"]["embedding"], "vd"
  return params["lm_head"]["kernel"], "dv"


def unembedding_rows(config: ModelConfig, params, ids) -> Float[Array, "... D"]:
  """The unembedding vectors [..., D] of token ``ids`` [...] (clipped into the vocabulary): the
  logit of token v is final_norm(h) . row v, so a distribution over a few ids needs only these."""
  ids = jnp.clip(ids, 0, config.vocab_size - 1)
  w, layout = unembedding_for_kernel(config, params)
  if layout == "vd":
    return jnp.take(w, ids, axis=0)
  return jnp.moveaxis(jnp.take(w, ids, axis=1), 0, -1)


def final_norm(config: ModelConfig, params, hidden):
  return rms_norm(hidden, params["final_norm"]["scale"], config.rms_norm_eps)


def logits_from_hidden(config: ModelConfig, params, hidden) -> Float[Array, "... V"]:
  """Final norm + unembedding of pre-norm hidden states (what the heads and the sampler use).
  A tied embedding table [V, D] is contracted on D as is (no transposed copy)."""
  normed = final_norm(config, params, hidden)
  w, layout = unembedding_for_kernel(config, params)
  eq = "...d,vd->...v" if layout == "vd" else "...d,dv->...v"
  return jnp.einsum(eq, normed, w.astype(normed.dtype)).astype(jnp.float32)
