"""Matured prediction records: what the fast path (Reflex) hands to the slow path.

A record is written when a head's prediction for target position t matures (t is committed): the
heads' input at proposal time (the target's anchor hidden state), the correction Reflex applied to
that head's output, the target's distribution at t on a sparse support (renormalised on it, at the
sampling temperature) with the mass outside it, the committed token, the tree's candidates at that
depth and the sparse total variation between the (corrected) head and the target. Everything comes
from verify forwards: no extra target forward (docs/design.md, "Slow path").

Dimensions (besides the legend): C records per head, S support ids per record, Kc candidates per
record, Kp path slots, Cn new records in one write.

``Records`` is a bounded buffer per head (every leaf [K, C, ...]): a ring indexed by
``count[k] % C``, so the newest records overwrite the oldest (recent first). Static shapes; the
same type serves as the per-rollout buffer inside the decode loop and as the slow path's
cross-batch reservoir.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


@flax.struct.dataclass
class Records:
  hidden: Float[Array, "K C D"]  # anchor hidden state (the heads' input), f32
  correction: Float[Array, "K C D"]  # correction added to head k's output hidden (0 if none)
  support: Int[Array, "K C S"]  # support ids; -1 = unused entry
  p: Float[Array, "K C S"]  # target probabilities on the support (sum to 1 over used entries)
  p_tail: Float[Array, "K C"]  # target mass outside the support (full vocabulary)
  token: Int[Array, "K C"]  # the committed token at the predicted position
  candidates: Int[Array, "K C Kc"]  # the tree's candidate tokens at that depth; -1 = none
  hit: Bool[Array, "K C"]  # the committed token was among the candidates
  tv: Float[Array, "K C"]  # sparse TV between the head's (corrected) and the target's distribution
  position: Int[Array, "K C"]  # the target position the record is about
  valid: Bool[Array, "K C"]
  count: Int[Array, " K"]  # records ever written per head (ring index = count % C)
  # the tokens head k read besides the anchor (root-conditioned heads: the root and the path
  # above depth k; -1 = unused); None for Medusa heads, which read the anchor only
  path: Int[Array, "K C Kp"] | None = None

  @property
  def capacity(self) -> int:
    return self.valid.shape[1]

  @property
  def num_heads(self) -> int:
    return self.valid.shape[0]


FIELDS = ("hidden", "correction", "support", "p", "p_tail", "token", "candidates", "hit", "tv",
          "position", "path")


def empty(num_heads: int, capacity: int, hidden_size: int, support: int,
          num_candidates: int, path: int = 0) -> Records:
  """An empty buffer of ``capacity`` records per head; ``path`` > 0: with a path of that many
  tokens per record (root-conditioned heads)."""
  k, c = num_heads, capacity
  f = lambda *s: jnp.zeros((k, c) + s, jnp.float32)
  i = lambda *s: jnp.full((k, c) + s, -1, jnp.int32)
  return Records(hidden=f(hidden_size), correction=f(hidden_size), support=i(support), p=f(support),
                 p_tail=f(), token=i(), candidates=i(num_candidates),
                 hit=jnp.zeros((k, c), bool), tv=f(), position=i(),
                 valid=jnp.zeros((k, c), bool), count=jnp.zeros((k,), jnp.int32),
                 path=i(path) if path else None)


def write(buf: Records, new: Records, mask: Bool[Array, "K Cn"]) -> Records:
  """Append the entries of ``new`` (leaves [K, N, ...]) where ``mask`` to ``buf``, per head, in
  order of N; when more than the capacity arrive, the last ones win (recent first)."""
  c = buf.capacity
  rank = jnp.cumsum(mask, axis=1) - 1  # [K, N]
  n_new = mask.sum(1).astype(jnp.int32)
  slot = (buf.count[:, None] + rank) % c
  # entries that a later entry of the same call overwrites are dropped first
  keep = mask & (rank >= n_new[:, None] - c)
  slot = jnp.where(keep, slot, c)  # out of range: dropped
  kk = jnp.broadcast_to(jnp.arange(buf.num_heads)[:, None], slot.shape)

  def put(b, x):
    return b.at[kk, slot].set(x.astype(b.dtype), mode="drop")

  fields = {f: put(getattr(buf, f), getattr(new, f)) for f in FIELDS if getattr(buf, f) is not None}
  valid = buf.valid.at[kk, slot].set(True, mode="drop")
  return buf.replace(**fields, valid=valid, count=buf.count + n_new)


def merge(reservoir: Records, batch: Records) -> Records:
  """Append a batch buffer's valid records to a (usually larger) reservoir, oldest first."""
  c = batch.capacity
  # the batch ring's entries in write order: oldest at count % C when it has wrapped
  start = jnp.where(batch.count > c, batch.count % c, 0)
  order = (start[:, None] + jnp.arange(c)[None]) % c  # [K, C]
  take = lambda x: jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)
  ordered = batch.replace(**{f: take(getattr(batch, f)) for f in FIELDS + ("valid",)
                             if getattr(batch, f) is not None})
  return write(reservoir, ordered, ordered.valid)


def member(ids, sets) -> Bool[Array, "..."]:
  """ids [.., U], sets [.., C] (-1 = none) -> [.., U]: ids[u] is in sets."""
  return ((ids[..., :, None] == sets[..., None, :]) & (sets[..., None, :] >= 0)).any(-1)


def regret(rec: Records) -> Float[Array, "K C"]:
  """Per record, the target mass its candidates miss against the target's own best candidates of
  the same number: sum of the ``n`` largest target probabilities on the support minus the target
  mass on the candidates (n = candidates present). In [0, 1]; 0 where the tree proposed the
  target's top tokens, and 0 for a record without candidates. The support holds the target's top
  ids (``reflex.feedback``), so the top ``n`` are on it when n is at most their number."""
  used = rec.support >= 0
  mass = jnp.where(used, rec.p, 0.0) * (1.0 - rec.p_tail)[..., None]  # [K, C, S]
  on_c = used & member(rec.support, rec.candidates)
  n = (rec.candidates >= 0).sum(-1)  # [K, C]
  ranked = -jnp.sort(-mass, axis=-1)
  best = jnp.where(jnp.arange(mass.shape[-1]) < n[..., None], ranked, 0.0).sum(-1)
  return jnp.clip(best - jnp.where(on_c, mass, 0.0).sum(-1), 0.0, 1.0)
