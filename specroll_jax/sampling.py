"""Counter-based sampling noise, Gumbel-max sampling and logprobs.

The central invariant (docs/design.md): the token at absolute position ``t`` of response
``sample_id`` is

    x_t = argmax_v ( logits_{t-1}[v] * (1 / T) + Gumbel(u(seed, sample_id, t, v)) )   over allowed v

where ``u`` is a pure function of its four integer arguments, computed by a uint32 integer hash that
a Pallas kernel reproduces bit for bit (``pallas_kernels/counter_hash.py``, used by both). No
``jax.random`` array of shape [B, V] is ever drawn, so the noise a token sees does not depend on the
batch it sits in, on the tree that proposed it, or on the engine that verified it. Logits are
tempered by a multiply with one precomputed f32 ``1 / T`` (``inverse_temperature``), the same
constant the fused Pallas sampler uses, so both paths see the same numbers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from pallas_kernels.counter_hash import (
  gumbel_from_bits,
  inverse_temperature,
  mix32,
  row_key,
  token_bits,
  uniform_from_bits,
)
from pallas_kernels.fused_sampler import finish, fused_sample, fused_sample_partials, merge_shards
from specroll_jax import _topk
from specroll_jax._fields import check_float, check_int, int_arg
from specroll_jax.kernels import REFERENCE, Kernels, per_shard
from specroll_jax.models import decoder as _dec

__all__ = ["SamplingConfig", "allowed_logits", "draft_keys", "first_argmax", "group_sample_ids",
           "gumbel_from_bits", "gumbel_noise", "inverse_temperature", "mix32", "row_key", "sample",
           "sample_from_hidden", "token_bits", "token_logprobs", "uniform_from_bits"]

MASKED_LOGIT = -1e30  # a masked logit: large negative finite value (stays NaN-free in kernels);
#   the library's one masking constant (pallas_kernels imports nothing from us: it keeps its own)


def gumbel_noise(seed, sample_id, position, vocab_size: int) -> Float[Array, "*R V"]:
  """Gumbel noise for every token id: [..., V] for broadcast (seed, sample_id, position)."""
  key = row_key(seed, sample_id, position)[..., None]
  return gumbel_from_bits(token_bits(key, jnp.arange(vocab_size, dtype=jnp.uint32)))



def group_sample_ids(prompt_indices, group_size: int):
  """The sample-id rule for GRPO (docs/design.md, "The sample-id rule for GRPO"), written once:
  member i of global prompt p has sample id ``p * group_size + i``; rows come prompt-major
  ([P] indices -> [P * G] ids). numpy in, numpy out; a jax array (or tracer) in, jnp out, in the
  indices' dtype."""
  group_size = int_arg(group_size, "group_size", 1)
  xp = jnp if isinstance(prompt_indices, jax.Array) else np
  idx = xp.asarray(prompt_indices)
  return (idx[:, None] * group_size + xp.arange(group_size, dtype=idx.dtype)[None]).reshape(-1)

@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How the target samples. Frozen and hashable (a static jit argument).

  temperature: 0 is greedy argmax; > 0 samples softmax(logits / temperature).
  top_k: 0 means no top-k restriction; else keep the k largest logits.
  top_p: nucleus mass in (0, 1]; 1.0 means no restriction. Applied after top-k, as in
    transformers.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    check_float(self, "temperature", 0)
    check_int(self, "top_k", 0)  # 0: off
    check_float(self, "top_p", 0, 1, lo_open=True)

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def plain(self) -> bool:
    """True when no top-k / top-p restriction applies (what the fused Pallas sampler supports)."""
    return self.top_k == 0 and self.top_p >= 1.0


def allowed_logits(logits: Float[Array, "*R V"], cfg: SamplingConfig) -> Float[Array, "*R V"]:
  """Tempered logits (f32) with disallowed tokens set to a large negative value.

  Greedy (T = 0) uses the untempered logits: the policy distribution it reports logprobs under is
  softmax(logits), and argmax is the same either way.
  """
  x = logits.astype(jnp.float32)
  if not cfg.greedy:
    x = x * inverse_temperature(cfg.temperature)
  if cfg.greedy or cfg.plain:
    return x
  vocab = x.shape[-1]
  if cfg.top_k and cfg.top_k < vocab:
    kth = _topk.top_k(x, cfg.top_k)[0][..., -1:]  # not a full sort on a CPU (_topk)
    x = jnp.where(x >= kth, x, MASKED_LOGIT)
  if cfg.top_p < 1.0:
    srt = -jnp.sort(-x, axis=-1)  # descending
    p = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(p, axis=-1) - p  # mass strictly above each sorted entry
    keep = before < jnp.float32(cfg.top_p)  # smallest prefix with mass >= top_p (first always kept)
    thresh = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x >= thresh, x, MASKED_LOGIT)
  return x


def allowed_floor(x: Float[Array, "*R V"], cfg: SamplingConfig) -> Float[Array, "*R"]:
  """The smallest allowed logit of ``allowed_logits``' output ``x``: the tokens sampling may
  draw are exactly those with ``x >= floor`` (top-k and top-p each keep a prefix of the sorted
  logits, ties included). -inf when every token is allowed (greedy's reported distribution, or no
  top-k / top-p), so a token's probability recomputed elsewhere from its logit and the logsumexp
  of ``x`` is the sampler's only where that logit is at least the floor (``reflex.feedback``)."""
  if cfg.greedy or cfg.plain:
    return jnp.full(x.shape[:-1], -jnp.inf, jnp.float32)
  return jnp.min(jnp.where(x > MASKED_LOGIT / 2, x, jnp.inf), axis=-1)


def first_argmax(x):
  """argmax over the last axis with jnp.argmax's rule (first maximal index), via max + min-index:
  several times faster than jnp.argmax on XLA CPU. A row without a maximum (NaN) gives index 0."""
  m = jnp.max(x, axis=-1, keepdims=True)
  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  idx = jnp.min(jnp.where(x == m, iota, x.shape[-1]), axis=-1)
  return jnp.where(idx == x.shape[-1], 0, idx)


def sample(
    logits: Float[Array, "*R V"],
    seed,
    sample_ids: Int[Array, "*R"],
    positions: Int[Array, "*R"],
    cfg: SamplingConfig,
):
  """Sample the token for absolute position ``positions`` from ``logits`` (the previous position's).

  Returns (tokens int32 [*R], logprobs f32 [*R], nonfinite bool [*R]). The logprob is that of the
  chosen token under the sampling distribution (tempered, restricted, renormalised; greedy:
  softmax(logits)). ``nonfinite`` flags rows whose logits hold NaN or inf; their token is
  meaningless and callers must not commit it.
  """
  x = allowed_logits(logits, cfg)
  nonfinite = ~jnp.all(jnp.isfinite(logits), axis=-1)
  if cfg.greedy:
    tok = first_argmax(x)
  else:
    g = gumbel_noise(seed, sample_ids, positions, x.shape[-1])
    tok = first_argmax(x + g)
  lse = jax.nn.logsumexp(x, axis=-1)
  lp = jnp.take_along_axis(x, tok[..., None], axis=-1)[..., 0] - lse
  return tok.astype(jnp.int32), lp, nonfinite


def draft_keys(logits: Float[Array, "*R V"], cfg: SamplingConfig, seed,
               sample_ids: Int[Array, "*R"], positions: Int[Array, "*R"], *, coupled: bool):
  """How a drafter ranks its candidates for the token at ``positions``: (keys [*R, V], log q
  [*R, V]), its candidates being the top entries of ``keys`` and q its distribution over them.

  coupled (docs/design.md, "Drafts coupled to the noise"): q is the drafter's logits under the
  sampler's own rule (``allowed_logits``: tempered, top-k / top-p restricted) and the keys add the
  target's own noise at the guessed position, the Gumbel of (seed, sample id, position, token)
  ``sample`` adds. The first key's token is the one the target would sample were its logits the
  drafter's (so it is the target's sample with probability at least (1 - TV) / (1 + TV) between
  the two distributions: Gumbel coupling), and the top-k is a Gumbel-top-k draw without
  replacement from q. Tokens the rule excludes key at -inf. Greedy (T = 0): no noise, the keys
  are the logits: today's ranking. Not coupled: keys = log q = log_softmax(logits) at T = 1 (the
  head's own probabilities, deterministic top-k)."""
  if not coupled:
    lq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return lq, lq
  x = allowed_logits(logits, cfg)
  lq = jax.nn.log_softmax(x, axis=-1)
  if cfg.greedy:
    return x, lq
  keys = x + gumbel_noise(seed, sample_ids, positions, x.shape[-1])
  return jnp.where(x > MASKED_LOGIT / 2, keys, -jnp.inf), lq


def token_logprobs(logits: Float[Array, "*R V"], tokens: Int[Array, "*R"], cfg: SamplingConfig):
  """Logprob of given tokens under the sampling distribution (teacher forcing; as ``sample``)."""
  x = allowed_logits(logits, cfg)
  lse = jax.nn.logsumexp(x, axis=-1)
  return jnp.take_along_axis(x, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0] - lse


def uses_fused_sampler(cfg: SamplingConfig, kernels: Kernels) -> bool:
  """Whether ``sample_from_hidden`` uses the fused Pallas kernel (which writes no logits)."""
  return kernels.sampler == "pallas" and cfg.plain


def sample_from_hidden(config, params, hidden, seed, sample_ids, positions, cfg: SamplingConfig,
                       kernels: Kernels = REFERENCE):
  """Sample from pre-norm hidden states [..., D] (final norm + unembedding + ``sample``).

  With ``kernels.sampler == "pallas"`` and plain sampling (no top-k/top-p) the fused Pallas kernel
  computes the token and its logprob without writing [..., V] logits
  (``pallas_kernels.fused_sampler``); a non-finite logprob flags the row. Otherwise the jnp path.
  """
  if uses_fused_sampler(cfg, kernels):
    lead = hidden.shape[:-1]
    normed = _dec.final_norm(config, params, hidden).reshape(-1, hidden.shape[-1])
    flat = lambda a: jnp.broadcast_to(jnp.asarray(a), lead).reshape(-1).astype(jnp.int32)
    w, layout = _dec.unembedding_for_kernel(config, params)
    w = w.astype(normed.dtype)
    if kernels.mesh is None:
      tok, lp = fused_sample(normed, w, seed, flat(sample_ids), flat(positions),
                             temperature=float(cfg.temperature), interpret=kernels.interpret,
                             unembed_layout=layout)
    else:
      tok, lp = _fused_sample_sharded(normed, w, layout, seed, flat(sample_ids), flat(positions),
                                      float(cfg.temperature), kernels)
    return tok.reshape(lead), lp.reshape(lead), ~jnp.isfinite(lp.reshape(lead))
  logits = _dec.logits_from_hidden(config, params, hidden)
  return sample(logits, seed, sample_ids, positions, cfg)


def _fused_sample_sharded(normed, w, layout, seed, sample_ids, positions, temperature: float,
                          kernels: Kernels):
  """The fused sampler over a vocabulary-sharded unembedding: each model shard samples its slice
  (the noise of its global ids), then the shards' partials merge (``merge_shards``: the best
  perturbed value, the lowest id on ties, the logsumexp's parts), so the token is one device's."""
  mesh = kernels.mesh
  v_axis = 0 if layout == "vd" else 1

  def local(h, w, seed, sids, pos):
    offset = jax.lax.axis_index(mesh.model) * w.shape[v_axis]
    parts = fused_sample_partials(h, w, seed, sids, pos, temperature=temperature,
                                  vocab_offset=offset, interpret=kernels.interpret,
                                  unembed_layout=layout)
    return finish(*merge_shards(parts, mesh.model))

  w_spec = P(mesh.model, None) if layout == "vd" else P(None, mesh.model)
  ins = lambda r: (P(r, None), w_spec, P(), P(r), P(r))
  outs = lambda r: (P(r), P(r))
  return per_shard(local, mesh, ins, outs, mesh.rows(normed.shape[0]))(
      normed, w, jnp.asarray(seed), sample_ids, positions)
