"""Future-token heads whose tree is ranked by calibrated acceptance, expanded depth by depth
(docs/design.md, "Root-conditioned heads" and "One tree from every source").

Works with both head families: root-conditioned heads (``cond_heads.CondHeads``: head k reads the
root and the path above depth k) and Medusa heads (``heads.Heads``: head k reads the anchor only,
so every partial path at depth k - 1 gets the same candidates). At depth 1 head 1 proposes its
top ``topk[0]`` tokens under the root; at depth k the ``beams[k-1]`` best partial paths of depth
k - 1 (by score) are extended by head k's first ``topk[k-1]`` candidates (one head evaluation per
extended path; Medusa heads are evaluated once). Candidates are ranked coupled to the target's
own noise (``coupled``, the default; ``sampling.draft_keys``): the head's logits under the
sampler's rule plus the Gumbel noise the target adds at the guessed position, a Gumbel-top-k
draw whose first entry is the target's sample with probability near 1 - TV; ``coupled=False``
ranks by the head's probabilities alone. A node's score is its parent's plus the log of its
calibrated acceptance probability, read from a table by (depth, the candidate's rank when coupled,
half-octave bin of the head's probability q of the token at T = 1) that the caller calibrates from
the engine's counts (``calibration.py``); within a bin the raw q breaks ties. The row's tree is
the best of these paths (``tree.select``). At T = 0 coupling changes nothing but the table's
layout and prior (``SpecRoll`` runs ``coupled=False`` there).

``correct`` (Reflex): a hook that rewrites head k's output states before the unembedding.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from specroll_jax import sampling as _sampling
from specroll_jax._fields import check_bool, check_int, int_arg, int_tuple
from specroll_jax.heads import conditioned as _cond
from specroll_jax.heads import medusa as _heads
from specroll_jax.models import decoder as _dec
from specroll_jax.proposers import tree as _tree
from specroll_jax.proposers.base import coupled_with
from specroll_jax.proposers.ranked import RankedProposer, log_table

_TIE = 1e-3  # weight of the raw log q inside a calibration bin (ties only)
# What Gumbel coupling earns a candidate of rank r beyond the head's own probability q of it (at
# T = 1), for heads far from the target (teacher-forced on the target's GSM8K rollouts at T = 1
# with the shipped heads, made for another task: rank 0 is accepted at 0.17-0.20 whatever its q
# below 0.35, rank 1 at 0.07-0.15, ranks 2-3 at 0.03-0.05; docs/benchmarks.md, "Drafts coupled to
# the noise"): the prior of an uncalibrated table, q + (1 - q) * floor[rank]
_COUPLED_FLOOR = (0.15, 0.05, 0.02, 0.01)


@flax.struct.dataclass
class HeadsParams:
  """Parameters of ``RankedHeads``: the heads and the calibrated acceptance table [K, Bd] by
  (depth, bin: ``RankedHeads.depth_bins`` per depth)."""

  heads: _heads.Heads | _cond.CondHeads
  acceptance: Float[Array, "K Bd"]


def q_bin(q, num_bins: int):
  """Half-octave bin of probabilities q: 0 for (2^-1/2, 1], 1 for (1/2, 2^-1/2], ..."""
  b = jnp.floor(-2.0 * jnp.log2(jnp.maximum(q, 1e-30)))
  return jnp.clip(b, 0, num_bins - 1).astype(jnp.int32)


def head_states_at(target, heads, k: int, h, ctx):
  """Head k's output states [R, P, D] for P partial paths per row (ctx [R, P, k]: root and path
  tokens). Medusa heads ignore the path."""
  if isinstance(heads, _cond.CondHeads):
    hb = jnp.broadcast_to(h[:, None], ctx.shape[:2] + h.shape[-1:])
    return _cond.head_state(target.config, target.params, heads, k, hb, ctx)
  sub = jax.tree.map(lambda a: a[k - 1:k], heads)
  z = _heads.head_states(target.config, sub, h)[:, 0]  # [R, D]
  return jnp.broadcast_to(z[:, None], ctx.shape[:2] + z.shape[-1:])


@dataclasses.dataclass(frozen=True)
class RankedHeads(RankedProposer):
  """K heads; ``topk[k-1]`` candidates under each of the ``beams[k-1]`` best partial paths at depth
  k - 1 (beams[0] = 1: the root). coupled: rank candidates with the target's own noise (module
  docstring; False: by the head's probabilities). Parameters: ``HeadsParams``
  (``RankedHeads.params(heads)``)."""

  num_heads: int = 3
  topk: tuple[int, ...] = (4, 3, 2)
  beams: tuple[int, ...] = (1, 2, 2)
  max_nodes: int = 16
  q_bins: int = 12
  coupled: bool = True

  def __post_init__(self):
    k = check_int(self, "num_heads", 1, owner="RankedHeads")
    for name in ("topk", "beams"):
      object.__setattr__(self, name, int_tuple(getattr(self, name), f"RankedHeads.{name}", 1,
                                               length=k, count=f"num_heads={k}"))
    if self.beams[0] != 1:
      raise ValueError(f"RankedHeads.beams[0] must be 1 (depth 1 extends the root), got "
                       f"{self.beams}")
    for name in ("max_nodes", "q_bins"):
      check_int(self, name, 1, owner="RankedHeads")
    check_bool(self, "coupled", owner="RankedHeads")

  @classmethod
  def for_heads(cls, num_heads: int, **kw) -> RankedHeads:
    """The default tree for ``num_heads`` heads: (4, 3, 2, 2, ...) candidates per depth, the
    best 2 partial paths extended below depth 1."""
    k = int_arg(num_heads, "num_heads", 1)
    return cls(num_heads=k, topk=((4, 3) + (2,) * k)[:k], beams=(1,) + (2,) * (k - 1), **kw)

  @property
  def max_depth(self) -> int:
    return self.num_heads

  @property
  def capacity(self) -> int:
    return min(self.max_nodes, sum(b * t for b, t in zip(self.beams, self.topk, strict=True)))

  @property
  def ranks(self) -> int:
    """Candidate ranks the table tells apart per depth (1 when not coupled)."""
    return max(self.topk) if self.coupled else 1

  @property
  def depth_bins(self) -> int:
    """Bins per depth: (rank, q bin) when coupled, q bin otherwise."""
    return self.ranks * self.q_bins

  @property
  def num_bins(self) -> int:
    return self.num_heads * self.depth_bins

  def default_acceptance(self) -> np.ndarray:
    """The uncalibrated table [K, depth_bins]: each bin's central q (the head's own estimate),
    coupled: plus what coupling earns a candidate of its rank (``_COUPLED_FLOOR``)."""
    centre = 2.0 ** (-(np.arange(self.q_bins) + 0.5) / 2)
    if self.coupled:
      floor = np.asarray([_COUPLED_FLOOR[min(r, len(_COUPLED_FLOOR) - 1)]
                          for r in range(self.ranks)])
      centre = (centre[None] + (1 - centre[None]) * floor[:, None]).reshape(-1)
    return np.broadcast_to(centre, (self.num_heads, self.depth_bins)).astype(np.float32)

  def params(self, heads, acceptance=None) -> HeadsParams:
    acc = self.default_acceptance() if acceptance is None else acceptance
    return HeadsParams(heads=heads, acceptance=jnp.asarray(acc, jnp.float32))

  def validate(self, config, params) -> None:
    if not isinstance(params, HeadsParams):
      raise ValueError(f"RankedHeads params must be a HeadsParams (RankedHeads.params(heads)), got "
                       f"{type(params).__name__}")
    if isinstance(params.heads, _cond.CondHeads):
      _cond.validate(config, params.heads, self.num_heads)
    else:
      _heads.validate(config, params.heads, self.num_heads)
    shape = tuple(np.shape(params.acceptance))
    if shape != (self.num_heads, self.depth_bins):
      raise ValueError(f"HeadsParams.acceptance has shape {shape}, expected "
                       f"({self.num_heads}, {self.depth_bins}) (heads x bins per depth: "
                       f"{self.ranks} ranks x {self.q_bins} q bins)")

  def expand(self, target, params: HeadsParams, inp, *, num_nodes: int, correct=None):
    """Candidates [R, M] from depth-by-depth expansion of ``inp`` (a ``ProposeInput``: the
    anchor, the root, and for coupling its position, sample id and seed), and the trunk: along
    the best path, each used head's raw and corrected output states [R, K', D], corrected logits
    [R, K', V] and the tokens it read [R, K', K] (root, then the path; -1 padded).
    K' = min(K, num_nodes) heads are used. (What Reflex records.)"""
    h, root = inp.hidden, inp.root
    coupled = coupled_with(target, inp, self.coupled, "RankedHeads")
    r = root.shape[0]
    kmax = min(self.num_heads, num_nodes)
    table = params.acceptance.reshape(-1)
    f_paths = jnp.zeros((r, 1, 0), jnp.int32)  # frontier: partial paths and their scores
    f_score = jnp.zeros((r, 1), jnp.float32)
    out_paths, out_depth, out_score, out_bin = [], [], [], []
    trunk_raw, trunk_z, trunk_logits, trunk_ctx = [], [], [], []
    for k in range(1, kmax + 1):
      p = f_paths.shape[1]
      ctx = jnp.concatenate([jnp.broadcast_to(root[:, None, None], (r, p, 1)), f_paths], axis=2)
      z = head_states_at(target, params.heads, k, h, ctx)  # [R, P, D]
      trunk_raw.append(z[:, 0])
      if correct is not None:
        z = correct(k, z)
      logits = _dec.logits_from_hidden(target.config, target.params, z)  # [R, P, V]
      trunk_z.append(z[:, 0])
      trunk_logits.append(logits[:, 0])
      trunk_ctx.append(jnp.pad(ctx[:, 0], ((0, 0), (0, self.num_heads - k)), constant_values=-1))
      kk = min(self.topk[k - 1], num_nodes)
      if coupled:  # the noise of position L + k, the same under every partial path
        keys, _ = _sampling.draft_keys(
            logits, target.sampling, inp.seed[:, None], inp.sample_ids[:, None],
            (inp.position + k)[:, None], coupled=True)
        key, tok = jax.lax.top_k(keys, kk)  # [R, P, kk]: a Gumbel-top-k draw from q
        lq = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tok, axis=-1)
        rank = jnp.arange(kk, dtype=jnp.int32) * self.q_bins
      else:
        lq, tok = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), kk)  # [R, P, kk]
        key, rank = lq, 0
      bins = (k - 1) * self.depth_bins + rank + q_bin(jnp.exp(lq), self.q_bins)
      score = f_score[..., None] + log_table(table, bins) + _TIE * jnp.maximum(lq, -1e4)
      score = jnp.where(jnp.isfinite(key), score, -jnp.inf)  # tokens the sampler excludes
      paths = jnp.concatenate([jnp.broadcast_to(f_paths[:, :, None], (r, p, kk, k - 1)),
                               tok[..., None]], axis=3).reshape(r, p * kk, k)
      score, bins = score.reshape(r, p * kk), bins.reshape(r, p * kk)
      out_paths.append(jnp.pad(paths, ((0, 0), (0, 0), (0, self.num_heads - k)),
                               constant_values=-1))
      out_depth.append(jnp.full((r, p * kk), k, jnp.int32))
      out_score.append(score)
      out_bin.append(bins)
      if k < kmax:
        nb = min(self.beams[k], p * kk)
        f_score, keep = jax.lax.top_k(score, nb)
        f_paths = jnp.take_along_axis(paths, keep[:, :, None], axis=1)
    cands = _tree.Candidates(paths=jnp.concatenate(out_paths, 1),
                             depth=jnp.concatenate(out_depth, 1),
                             score=jnp.concatenate(out_score, 1), bin=jnp.concatenate(out_bin, 1))
    trunk = (jnp.stack(trunk_raw, 1), jnp.stack(trunk_z, 1), jnp.stack(trunk_logits, 1),
             jnp.stack(trunk_ctx, 1))
    return cands, trunk

  def candidates(self, target, params, shared, inp, *, num_nodes: int):
    cands, _ = self.expand(target, params, inp, num_nodes=num_nodes)
    return cands, jnp.zeros((inp.root.shape[0], 3), bool)


__all__ = ["HeadsParams", "RankedHeads", "head_states_at", "q_bin"]
