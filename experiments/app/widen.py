"""Cost-faithful widening: a small model, with its exact function, inside a real-size shape
(docs/widening.md).

``widen`` places a small Qwen2/Llama decoder (the embedded model) inside a network of a real
model's shape (Qwen2.5 0.5B / 1.5B / 7B: ``QWEN25_SHAPES``), so that a GPU measures the small
model's acceptance at the real model's cost: every layer of the real shape reads all its weight
bytes and writes all its KV bytes, and the output is the small model's, exact in exact arithmetic.

The recipe (Ds, Db the small and big widths; r = Ds / Db):

* Residual stream: the small model's dims first, the padded dims zero (embedding columns and the
  output columns of o_proj / down_proj zero there). Every RMSNorm scale is multiplied by sqrt(r)
  on the real dims (zero elsewhere) and ``rms_norm_eps`` by r: the mean of squares over Db is r
  times the one over Ds, so rsqrt(r (m + eps)) sqrt(r) = rsqrt(m + eps) and each norm's output is
  unchanged.
* Attention: the small model's query heads of KV group j sit first in the big model's group j, so
  they share their original KV head (the big group size must be >= the small one). Head width
  Dh -> Dh' puts the two rotate-half halves at [0, Dh/2) and [Dh'/2, Dh'/2 + Dh/2), raises
  ``rope_theta`` to the power Dh'/Dh (the first Dh/2 frequencies then match) and scales q by
  sqrt(Dh'/Dh) for the 1/sqrt(head width) change; a real query head is zero on its other dims.
* Dead units (extra query heads, extra FFN columns, extra KV heads, extra layers) have random
  input weights (uniform with standard deviation ``scale``, a real init's 0.02) and zero output
  rows (o_proj / down_proj), so they add nothing; a real KV head's extra dims are random too (the
  real queries are zero there, o_proj's rows for them zero). Extra layers are identities: random
  q/k/v/gate/up, zero o_proj and down_proj. The real layers are spread evenly: small layer i is
  big layer floor(i * Ly' / Ly).
* Input weights that read the padded residual dims (q/k/v/gate/up rows, an untied lm_head's rows,
  the heads' input rows) are random too: a norm's output there is exactly zero.
* The vocabulary is kept (the small model's); ``byte_count`` gives the bytes it leaves out.

Medusa heads (``heads.Heads``) and root-conditioned heads (``cond_heads.CondHeads``) widen the same
way (``widen_heads``) and propose the same tokens. Parameters are built in the big model's dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from specroll_jax._fields import check_bool, check_int, float_arg, int_arg
from specroll_jax.models.config import _DTYPES, ModelConfig

_SIZES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "intermediate_size")


@dataclasses.dataclass(frozen=True)
class WideShape:
  """The shape a model is widened into. ``vocab_size`` is the real shape's vocabulary (used for
  byte accounting only; the widened model keeps the source's); None: the source's."""

  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  vocab_size: int | None = None
  tie_word_embeddings: bool = True

  def __post_init__(self):
    for name in _SIZES:
      check_int(self, name, 1)
    check_int(self, "vocab_size", 1, optional=True)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"WideShape.num_heads ({self.num_heads}) must be a multiple of "
                       f"num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"WideShape.head_dim must be even (rotate-half rope), got {self.head_dim}")
    check_bool(self, "tie_word_embeddings")

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads

  def real_config(self, dtype: str = "bfloat16", rope_theta: float = 1e6) -> ModelConfig:
    """The full model of this shape (its own vocabulary, qkv biases): for byte accounting."""
    if self.vocab_size is None:
      raise ValueError("WideShape.vocab_size is None: real_config needs the real vocabulary")
    return ModelConfig(
        vocab_size=self.vocab_size, hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size, num_layers=self.num_layers,
        num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
        rope_theta=rope_theta, tie_word_embeddings=self.tie_word_embeddings, qkv_bias=True,
        dtype=dtype)


QWEN25_SHAPES = {
    "0.5b": WideShape(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                      intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": WideShape(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                      intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7b": WideShape(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                    intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}
"""The Qwen2.5 base shapes (their ``config.json``)."""


# --- byte accounting -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ByteCount:
  """Weight and KV-cache bytes of a model at one dtype."""

  layers: int  # all decoder layers: q/k/v (+ biases), o_proj, gate/up/down, both norms
  final_norm: int
  embedding: int  # the input table [V, D] (also the unembedding when tied)
  lm_head: int  # the untied unembedding [D, V]; 0 when tied
  kv_per_token: int  # K and V of one token over all layers

  @property
  def body(self) -> int:
    """Weight bytes without the embedding and unembedding."""
    return self.layers + self.final_norm

  @property
  def vocab(self) -> int:
    """Embedding + unembedding bytes."""
    return self.embedding + self.lm_head

  @property
  def total(self) -> int:
    return self.body + self.vocab


def byte_count(config: ModelConfig, dtype: str | None = None) -> ByteCount:
  """Weight and KV bytes of ``config`` with every weight and the cache in ``dtype`` (default the
  config's)."""
  dtype = config.dtype if dtype is None else dtype
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
  n = jnp.dtype(_DTYPES[dtype]).itemsize
  d, f, dh = config.hidden_size, config.intermediate_size, config.head_dim
  q, kv = config.num_heads * dh, config.num_kv_heads * dh
  per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
  if config.qkv_bias:
    per_layer += q + 2 * kv
  return ByteCount(layers=n * config.num_layers * per_layer, final_norm=n * d,
                   embedding=n * config.vocab_size * d,
                   lm_head=0 if config.tie_word_embeddings else n * d * config.vocab_size,
                   kv_per_token=n * 2 * config.num_layers * kv)


# --- the widening --------------------------------------------------------------------------------


def widened_config(config: ModelConfig, shape: WideShape, *,
                   dtype: str | None = None) -> ModelConfig:
  """The config of ``config`` widened into ``shape`` (the source's vocabulary; ``dtype``: default
  the source's). Raises ValueError naming a dimension the shape cannot hold."""
  if not isinstance(shape, WideShape):
    raise ValueError(f"shape must be a WideShape, got {type(shape).__name__}")
  for name in _SIZES:
    small, big = getattr(config, name), getattr(shape, name)
    if big < small:
      raise ValueError(f"shape.{name} = {big} is smaller than the source's {name} = {small}")
  if shape.group_size < config.group_size:
    raise ValueError(
        f"shape group size num_heads / num_kv_heads = {shape.group_size} is smaller than the "
        f"source's {config.group_size}: the source's query heads of one KV group must fit in one")
  if config.head_dim % 2:
    raise ValueError(f"config.head_dim must be even (rotate-half rope), got {config.head_dim}")
  if config.rope_scaling is not None and shape.head_dim != config.head_dim:
    raise ValueError(f"config.rope_scaling = {config.rope_scaling!r}: a head_dim change "
                     f"({config.head_dim} -> {shape.head_dim}) supports plain rope only")
  if shape.tie_word_embeddings and not config.tie_word_embeddings:
    raise ValueError("shape.tie_word_embeddings = True but the source's unembedding is untied: "
                     "one table cannot hold both")
  dtype = config.dtype if dtype is None else dtype
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
  r = config.hidden_size / shape.hidden_size
  return config.replace(
      hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
      num_layers=shape.num_layers, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
      head_dim=shape.head_dim, rope_theta=config.rope_theta ** (shape.head_dim / config.head_dim),
      rms_norm_eps=config.rms_norm_eps * r, tie_word_embeddings=shape.tie_word_embeddings,
      dtype=dtype)


def _prep(x, dtype, factor: float = 1.0):
  """A small model's array scaled in float64 on the host and rounded once to ``dtype``."""
  return jnp.asarray((np.asarray(jax.device_get(x), np.float64) * factor).astype(jnp.dtype(dtype)))


def _mix(x):
  """murmur3's 32-bit finaliser: a bijective hash of uint32 values."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


class _Builder:
  """Big leaves under jit: random / zero / one bases with the small model's values placed in.

  The random weights are uniform with standard deviation ``scale``, each element a hash of its
  index and a per-leaf seed drawn from ``key``: a few fused integer ops per leaf. (A threefry or
  RngBitGenerator draw per leaf costs about a second of compile time each on CPU; dead weights
  need only a real init's scale, no particular stream.)
  """

  def __init__(self, key, dtype, scale: float):
    self.seed = jax.random.bits(key, (), jnp.uint32)
    self.dt, self.scale, self.count = jnp.dtype(dtype), scale, 0

  def rand(self, shape):
    self.count += 1
    seed = _mix(self.seed + jnp.uint32(self.count * 0x632BE5AB % 2**32))
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for ax in reversed(range(len(shape))):
      idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, ax) * jnp.uint32(stride % 2**32)
      stride *= shape[ax]
    u = (_mix(idx * jnp.uint32(0x9E3779B1) + seed) >> 8).astype(jnp.float32) * 2.0 ** -24
    return ((2 * u - 1) * (self.scale * math.sqrt(3))).astype(self.dt)  # [-a, a), std scale

  def zeros(self, shape):
    return jnp.zeros(shape, self.dt)

  def ones(self, shape):
    return jnp.ones(shape, self.dt)


@dataclasses.dataclass(frozen=True)
class _Layout:
  ds: int  # small width
  layers: np.ndarray  # [Ly]: big layer of each small layer
  q_cols: np.ndarray  # [H * Dh]: big q column of each small q column
  q_extra: np.ndarray  # the real query heads' other big columns
  kv_cols: np.ndarray  # [Hkv * Dh]: big k/v column of each small k/v column
  rms: float  # sqrt(r): the norm-scale factor
  q_factor: float  # sqrt(Dh' / Dh)


def _layout(small: ModelConfig, big: ModelConfig) -> _Layout:
  hs, hb = small.head_dim, big.head_dim
  dims = np.concatenate([np.arange(hs // 2), hb // 2 + np.arange(hs // 2)])
  gs, gb = small.group_size, big.group_size
  q_heads = np.array([(j // gs) * gb + j % gs for j in range(small.num_heads)])
  q_cols = (q_heads[:, None] * hb + dims[None]).reshape(-1)
  q_all = (q_heads[:, None] * hb + np.arange(hb)[None]).reshape(-1)
  kv_cols = (np.arange(small.num_kv_heads)[:, None] * hb + dims[None]).reshape(-1)
  layers = np.array([i * big.num_layers // small.num_layers for i in range(small.num_layers)])
  return _Layout(ds=small.hidden_size, layers=layers, q_cols=q_cols,
                 q_extra=np.setdiff1d(q_all, q_cols), kv_cols=kv_cols,
                 rms=math.sqrt(small.hidden_size / big.hidden_size), q_factor=math.sqrt(hb / hs))


_BIASES = {("q_proj", "bias"), ("k_proj", "bias"), ("v_proj", "bias")}
_LAYER_LEAVES = {("attn_norm", "scale"), ("mlp_norm", "scale"), ("q_proj", "kernel"),
                 ("k_proj", "kernel"), ("v_proj", "kernel"), ("o_proj", "kernel"),
                 ("gate_proj", "kernel"), ("up_proj", "kernel"), ("down_proj", "kernel")}


def _prepared(small: ModelConfig, big: ModelConfig, params, lay: _Layout):
  """The small model's leaves as they enter the big model: norms times sqrt(r), q times
  sqrt(Dh'/Dh), all in the big dtype."""
  layers = params["layers"]
  if isinstance(layers, (tuple, list)):
    raise ValueError("params['layers'] is unstacked (a tuple); widen reads stacked layers")
  leaves = {(m, n) for m, sub in layers.items() for n in sub}
  want = _LAYER_LEAVES | (_BIASES if small.qkv_bias else set())
  if leaves != want:
    raise ValueError(f"params['layers'] holds {sorted(leaves)}, expected {sorted(want)} (a "
                     f"{small.architecture} decoder with qkv_bias={small.qkv_bias})")
  dt = big.jnp_dtype
  factor = {"attn_norm": lay.rms, "mlp_norm": lay.rms, "q_proj": lay.q_factor}
  out = {"layers": {m: {n: _prep(v, dt, factor.get(m, 1.0)) for n, v in sub.items()}
                    for m, sub in layers.items()},
         "embed": {"embedding": _prep(params["embed"]["embedding"], dt)},
         "final_norm": {"scale": _prep(params["final_norm"]["scale"], dt, lay.rms)}}
  if not small.tie_word_embeddings:
    out["lm_head"] = {"kernel": _prep(params["lm_head"]["kernel"], dt)}
  return out


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _build(small: ModelConfig, big: ModelConfig, scale: float, sp, key):
  # Placements index with slices and at most one index array, so the scatters carry no large
  # index constants.
  b = _Builder(key, big.jnp_dtype, scale)
  lay = _layout(small, big)
  ly, d, f = big.num_layers, big.hidden_size, big.intermediate_size
  qw, kvw = big.num_heads * big.head_dim, big.num_kv_heads * big.head_dim
  ds, fs = lay.ds, small.intermediate_size
  s = sp["layers"]
  L = lay.layers

  def place(w, name, leaf, index, extra=None):
    """The real layers' slab of w with the small layers' leaf at ``index`` (``extra``: the last
    axis' columns zeroed first on the same rows), written back."""
    slab = w[L]
    if extra is not None:
      slab = slab.at[(slice(None), *index[:-1], extra)].set(0)
    return w.at[L].set(slab.at[(slice(None), *index)].set(s[name][leaf]))

  def norm(name):
    slab = jnp.zeros((len(L), d), b.dt).at[:, :ds].set(s[name]["scale"])
    return {"scale": b.ones((ly, d)).at[L].set(slab)}

  q, k, v = b.rand((ly, d, qw)), b.rand((ly, d, kvw)), b.rand((ly, d, kvw))
  gate, up = b.rand((ly, d, f)), b.rand((ly, d, f))
  layers = {"attn_norm": norm("attn_norm"), "mlp_norm": norm("mlp_norm"),
            "q_proj": {"kernel": place(q, "q_proj", "kernel", (slice(0, ds), lay.q_cols),
                                       lay.q_extra)},
            "k_proj": {"kernel": place(k, "k_proj", "kernel", (slice(0, ds), lay.kv_cols))},
            "v_proj": {"kernel": place(v, "v_proj", "kernel", (slice(0, ds), lay.kv_cols))},
            "gate_proj": {"kernel": place(gate, "gate_proj", "kernel",
                                          (slice(0, ds), slice(0, fs)))},
            "up_proj": {"kernel": place(up, "up_proj", "kernel", (slice(0, ds), slice(0, fs)))}}
  if small.qkv_bias:
    layers["q_proj"]["bias"] = place(b.rand((ly, qw)), "q_proj", "bias", (lay.q_cols,),
                                     lay.q_extra)
    for name in ("k_proj", "v_proj"):
      layers[name]["bias"] = place(b.rand((ly, kvw)), name, "bias", (lay.kv_cols,))
  layers["o_proj"] = {"kernel": place(b.zeros((ly, qw, d)), "o_proj", "kernel",
                                      (lay.q_cols, slice(0, ds)))}
  layers["down_proj"] = {"kernel": place(b.zeros((ly, f, d)), "down_proj", "kernel",
                                         (slice(0, fs), slice(0, ds)))}
  emb = sp["embed"]["embedding"]
  out = {"embed": {"embedding": b.zeros((small.vocab_size, d)).at[:, :ds].set(emb)},
         "layers": layers,
         "final_norm": {"scale": b.zeros((d,)).at[:ds].set(sp["final_norm"]["scale"])}}
  if not big.tie_word_embeddings:
    unembed = emb.T if small.tie_word_embeddings else sp["lm_head"]["kernel"]
    out["lm_head"] = {"kernel": b.rand((d, small.vocab_size)).at[:ds].set(unembed)}
  return out


def widen(config: ModelConfig, params, shape: WideShape, *, key, heads=None,
          dtype: str | None = None, scale: float = 0.02, head_width: int | None = None):
  """Widen ``config`` / ``params`` (layers stacked, as ``init_params`` / ``load_pretrained`` give
  them) into ``shape``: returns (big_config, big_params), or (big_config, big_params, big_heads)
  when ``heads`` (a ``heads.Heads`` or ``cond_heads.CondHeads`` of the source) is given.

  key: seeds the dead units' random weights (uniform, standard deviation ``scale``). dtype: the
  big model's (default the source's). head_width: the widened ``CondHeads`` MLP width (see
  ``widen_heads``). The big parameters are built by one jitted function on the default device.
  """
  big = widened_config(config, shape, dtype=dtype)
  scale = float_arg(scale, "scale", 0, lo_open=True)
  if heads is not None:
    _validate_heads(config, heads)
  hk, mk = jax.random.split(key)
  out = _build(config, big, float(scale), _prepared(config, big, params, _layout(config, big)), mk)
  if heads is None:
    return big, out
  return big, out, widen_heads(config, big, heads, key=hk, scale=scale, width=head_width)


def _validate_heads(config, heads):
  from specroll_jax.heads import conditioned as _ch
  from specroll_jax.heads import medusa as _mh
  if isinstance(heads, _mh.Heads):
    _mh.validate(config, heads)
  elif isinstance(heads, _ch.CondHeads):
    _ch.validate(config, heads)
  else:
    raise ValueError(f"heads must be a heads.Heads or cond_heads.CondHeads, got "
                     f"{type(heads).__name__}")


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _build_heads(ds: int, db: int, width: int, scale: float, sh, key):
  from specroll_jax.heads import medusa as _mh
  medusa = isinstance(sh, _mh.Heads)
  b = _Builder(key, (sh.norm if medusa else sh.norm_h).dtype, scale)
  kk = sh.num_heads
  norm = lambda v: b.zeros((kk, db)).at[:, :ds].set(v)
  if medusa:
    w = b.rand((kk, db, db)).at[:, :ds, ds:].set(0).at[:, :ds, :ds].set(sh.w)
    return sh.replace(norm=norm(sh.norm), w=w, b=b.zeros((kk, db)).at[:, :ds].set(sh.b))
  fs = sh.width
  w_h, w_e, bias = b.rand((kk, db, width)), b.rand((kk, kk, db, width)), b.rand((kk, width))
  return sh.replace(
      norm_h=norm(sh.norm_h), norm_e=norm(sh.norm_e), w_h=w_h.at[:, :ds, :fs].set(sh.w_h),
      w_e=w_e.at[:, :, :ds, :fs].set(sh.w_e), b=bias.at[:, :fs].set(sh.b),
      w_o=b.zeros((kk, width, db)).at[:, :fs, :ds].set(sh.w_o))


def widen_heads(config: ModelConfig, big: ModelConfig, heads, *, key, scale: float = 0.02,
                width: int | None = None):
  """Widen Medusa ``heads.Heads`` or root-conditioned ``cond_heads.CondHeads`` of ``config`` for
  ``big = widened_config(config, shape)``: they propose the same tokens on the widened model.

  A head's output columns on the padded dims are zero (it writes the residual stream), its input
  rows there random, its norm scales times sqrt(r) like the model's. ``CondHeads``' MLP width
  Dff -> ``width`` (default ceil(Dff * D' / D)); the extra columns have random input weights and
  biases and zero output rows.
  """
  from specroll_jax.heads import medusa as _mh
  _validate_heads(config, heads)
  scale = float_arg(scale, "scale", 0, lo_open=True)
  if big.vocab_size != config.vocab_size or big.hidden_size < config.hidden_size:
    raise ValueError(f"big (vocab {big.vocab_size}, hidden {big.hidden_size}) is not a widening "
                     f"of config (vocab {config.vocab_size}, hidden {config.hidden_size})")
  ds, db, dt = config.hidden_size, big.hidden_size, big.jnp_dtype
  rms = math.sqrt(ds / db)
  if isinstance(heads, _mh.Heads):
    if width is not None:
      raise ValueError(f"width applies to CondHeads only, got width={width!r} for Medusa heads")
    sh = heads.replace(norm=_prep(heads.norm, dt, rms), w=_prep(heads.w, dt),
                       b=_prep(heads.b, dt))
    return _build_heads(ds, db, db, float(scale), sh, key)
  fs = heads.width
  fb = -(-fs * db // ds) if width is None else width
  fb = int_arg(fb, "width", fs)  # at least the heads' width
  sh = heads.replace(norm_h=_prep(heads.norm_h, dt, rms), norm_e=_prep(heads.norm_e, dt, rms),
                     w_h=_prep(heads.w_h, dt), w_e=_prep(heads.w_e, dt), b=_prep(heads.b, dt),
                     w_o=_prep(heads.w_o, dt))
  return _build_heads(ds, db, fb, float(scale), sh, key)


__all__ = ["QWEN25_SHAPES", "ByteCount", "WideShape", "byte_count", "widen", "widen_heads",
           "widened_config"]
