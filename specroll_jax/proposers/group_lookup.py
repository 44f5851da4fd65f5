"""Group-aware lookup: n-gram copy from the row's own text, its GRPO siblings' responses and
earlier responses to the same prompt, ranked by measured acceptance (docs/design.md, "Group-aware
lookup").

Three sources, each a set of token segments searched for the row's last n committed tokens (the
root included; n from ``max_ngram`` down to ``min_ngram``, the longest n with a match, its latest
occurrence per segment):

* ``OWN``: the row's own prompt + response so far (prompt lookup);
* ``SIBLING``: the committed responses of the other rows of its group in this batch (rows that
  share a prompt: the caller's ``group_ids``, or ``sample_id // group_size``). Siblings are found
  through group ids in per-batch state, never through slot order, so a sibling that finished (and
  left the bucket) or sits anywhere in the batch still counts; under ``shard_map`` only rows of the
  same shard are seen, so a group must sit on one shard (``check_groups_on_shards``);
* ``PRIOR``: earlier responses to the row's prompt, passed in by the caller (``ResponseStore``,
  filled from finished batches: SPEC-RL-style reuse across epochs). They are proposals only: a
  stored response that is the row's own future text is still verified token by token.

Every continuation (up to ``max_chain`` tokens) becomes a chain of candidate nodes; distinct
continuations become branches, identical ones one path. A node's score is the log of its estimated
acceptance probability, from a table by (source, match length n, depth) that the caller calibrates
online from the engine's counts (``calibration.py``), so the tree holds the branches most likely
to be accepted, and a merged proposer can rank them against other sources' candidates. No FLOPs
beyond indexing and comparisons.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from specroll_jax._fields import check_int
from specroll_jax.proposers import tree as _tree
from specroll_jax.proposers.ranked import RankedProposer, log_table

OWN, SIBLING, PRIOR = 0, 1, 2
SOURCES = ("own", "sibling", "prior")


@flax.struct.dataclass
class LookupContext:
  """The proposer's parameters for one batch (traced; changing them never recompiles).

  acceptance [3, max_ngram + 1, max_chain]: estimated probability that a node is accepted given
    its parent was, by (source, match length n, depth - 1) (``calibration.Calibration``).
  group_ids [B] (optional): rows with the same id share a prompt (a GRPO group); None: derived
    as ``sample_id // group_size``.
  prior [B, K, W] (optional): K earlier responses to each row's prompt, -1 padded.
  Under ``shard_map`` ``group_ids`` and ``prior`` are split with the rows, ``acceptance``
  replicated.
  """

  acceptance: Float[Array, "S Nn C"]
  group_ids: Int[Array, " B"] | None = None
  prior: Int[Array, "B K W"] | None = None


@flax.struct.dataclass
class LookupShared:
  """Per batch (not compacted), indexed by row."""

  siblings: Int[Array, "B Gs"]  # the other rows of each row's group (-1: none)


def find_continuations(corpus: Int[Array, "R S W"], limit: Int[Array, "R S"],
                       suffix: Int[Array, "R Nm"], suffix_len: Int[Array, " R"], *,
                       max_ngram: int, min_ngram: int, max_chain: int):
  """Per segment: the continuation of the latest occurrence of the row's longest matching suffix.

  corpus[r, s, p] is token p of segment s (known for p < limit[r, s]; -1 never matches).
  suffix[r, -n:] are the row's last n tokens (suffix_len[r] of them known). A match must leave at
  least one known token after it. Returns (tokens [R, S, max_chain] (-1 past the length),
  length [R, S], n [R, S] (0: no match)).
  """
  r, s, w = corpus.shape
  p = jnp.arange(w)[None, None]
  ext = jnp.concatenate([corpus, jnp.full((r, s, max_ngram), -2, corpus.dtype)], axis=2)
  best = jnp.full((r, s), -1, jnp.int32)
  best_n = jnp.zeros((r, s), jnp.int32)
  for n in range(max_ngram, min_ngram - 1, -1):
    ok = (p + n <= limit[..., None] - 1) & (suffix_len[:, None, None] >= n)
    for i in range(n):
      ok = ok & (ext[:, :, i:i + w] == suffix[:, -n + i][:, None, None])
    start = jnp.max(jnp.where(ok, p, -1), axis=-1).astype(jnp.int32)
    take = (best < 0) & (start >= 0)
    best = jnp.where(take, start, best)
    best_n = jnp.where(take, n, best_n)
  j = jnp.arange(max_chain)[None, None]
  idx = best[..., None] + best_n[..., None] + j
  tokens = jnp.take_along_axis(corpus, jnp.clip(idx, 0, w - 1), axis=2)
  ok = (best[..., None] >= 0) & (idx < limit[..., None]) & (tokens >= 0)
  ok = jnp.cumprod(ok, axis=2).astype(bool)
  return jnp.where(ok, tokens, -1), ok.sum(2).astype(jnp.int32), best_n


def own_suffix(history: Int[Array, "R C"], position: Int[Array, " R"], max_ngram: int):
  """(the row's last ``max_ngram`` tokens ending at ``position`` [R, max_ngram], how many are
  known [R])."""
  c = history.shape[1]
  idx = position[:, None] - max_ngram + 1 + jnp.arange(max_ngram)[None]
  tok = jnp.take_along_axis(history, jnp.clip(idx, 0, c - 1), axis=1)
  return jnp.where(idx >= 0, tok, -1), jnp.minimum(position + 1, max_ngram).astype(jnp.int32)


def sibling_table(group_ids: Int[Array, " B"], size: int) -> Int[Array, "B Gs"]:
  """For every row, the other rows with its group id (the first ``size`` of them; -1 padded)."""
  b = group_ids.shape[0]
  same = (group_ids[:, None] == group_ids[None, :]) & ~jnp.eye(b, dtype=bool)
  order = jnp.argsort(~same, axis=1, stable=True)[:, :size].astype(jnp.int32)
  return jnp.where(jnp.take_along_axis(same, order, axis=1), order, -1)


@dataclasses.dataclass(frozen=True)
class GroupLookup(RankedProposer):
  """n-gram copy from the row's own text, its siblings and earlier responses (module docstring).

  max_ngram, min_ngram: suffix lengths tried, longest first. max_chain: tokens per continuation
  (the deepest node). group_size: the largest GRPO group (siblings per row: group_size - 1);
  0 or 1: no sibling source. max_branches: distinct continuations kept per row (the best by their
  first node's estimate). max_nodes: the most nodes a row's tree holds (``capacity``).
  Parameters: ``LookupContext``.
  """

  max_ngram: int = 3
  min_ngram: int = 1
  max_chain: int = 6
  group_size: int = 0
  max_branches: int = 4
  max_nodes: int = 16

  def __post_init__(self):
    for name in ("max_ngram", "min_ngram", "max_chain", "max_branches", "max_nodes"):
      check_int(self, name, 1, owner="GroupLookup")
    check_int(self, "group_size", 0, owner="GroupLookup")
    if self.min_ngram > self.max_ngram:
      raise ValueError(f"GroupLookup.min_ngram={self.min_ngram} exceeds max_ngram="
                       f"{self.max_ngram}")

  # -- sizes

  @property
  def max_depth(self) -> int:
    return self.max_chain

  @property
  def capacity(self) -> int:
    return min(self.max_nodes, self.max_branches * self.max_chain)

  @property
  def num_bins(self) -> int:
    return len(SOURCES) * (self.max_ngram + 1) * self.max_chain

  @property
  def acceptance_shape(self) -> tuple[int, int, int]:
    return (len(SOURCES), self.max_ngram + 1, self.max_chain)

  def default_acceptance(self) -> np.ndarray:
    """Prior acceptance table before any calibration: longer matches and deeper nodes (once a
    copy is on track) more likely."""
    n = np.arange(self.max_ngram + 1)[None, :, None]
    d = np.arange(self.max_chain)[None, None, :]
    base = np.array([0.10, 0.08, 0.10])[:, None, None]
    p = np.clip(base * n + 0.05 * d, 0.0, 0.9) * (n > 0)
    return np.broadcast_to(p, self.acceptance_shape).astype(np.float32)

  def context(self, acceptance=None, group_ids=None, prior=None) -> LookupContext:
    """The parameters for a batch (host arrays in, device arrays out)."""
    acc = self.default_acceptance() if acceptance is None else acceptance
    return LookupContext(acceptance=jnp.asarray(acc, jnp.float32),
                         group_ids=None if group_ids is None else jnp.asarray(group_ids, jnp.int32),
                         prior=None if prior is None else jnp.asarray(prior, jnp.int32))

  # -- checks (host, before tracing)

  def validate(self, config, params) -> None:
    if not isinstance(params, LookupContext):
      raise ValueError(f"GroupLookup params must be a LookupContext (GroupLookup.context(...)), "
                       f"got {type(params).__name__}")
    shape = tuple(np.shape(params.acceptance))
    if shape != self.acceptance_shape:
      raise ValueError(f"LookupContext.acceptance has shape {shape}, expected "
                       f"{self.acceptance_shape} (sources x (max_ngram + 1) x max_chain)")
    if params.prior is not None:
      pr = np.asarray(params.prior)
      if pr.ndim != 3:
        raise ValueError(f"LookupContext.prior must be [B, K, W], got shape {pr.shape}")
      if pr.size and (pr.min() < -1 or pr.max() >= config.vocab_size):
        raise ValueError(f"LookupContext.prior holds ids outside [-1, vocab_size="
                         f"{config.vocab_size}): range [{pr.min()}, {pr.max()}]")

  def validate_batch(self, config, params: LookupContext, prompt_tokens, prompt_lengths,
                     sample_ids) -> None:
    b = len(prompt_lengths)
    if params.prior is not None and np.shape(params.prior)[0] != b:
      raise ValueError(f"LookupContext.prior has {np.shape(params.prior)[0]} rows, the batch {b}")
    if params.group_ids is None and self.group_size < 2:
      return
    gids = self.group_ids(params, np.asarray(sample_ids))
    if gids.shape != (b,):
      raise ValueError(f"LookupContext.group_ids must have shape ({b},) (one id per row), got "
                       f"{gids.shape}")
    check_groups(gids, np.asarray(prompt_tokens), np.asarray(prompt_lengths),
                 max(self.group_size, 1))

  def group_ids(self, params: LookupContext, sample_ids):
    if params.group_ids is not None:
      return np.asarray(params.group_ids)
    return np.asarray(sample_ids) // max(self.group_size, 1)

  # -- the proposer

  def init_shared(self, target, params, rows):
    gs = max(self.group_size - 1, 0)
    if gs == 0:
      return LookupShared(siblings=jnp.zeros((rows.row.shape[0], 0), jnp.int32))
    gids = rows.sample_ids // self.group_size if params.group_ids is None else params.group_ids
    return LookupShared(siblings=sibling_table(gids, gs))

  def segments(self, params: LookupContext, shared: LookupShared, inp):
    """(corpus, limit, source) of every segment a row searches: its own history, its siblings'
    responses, its earlier responses. corpus widths differ per source, so a list of triples."""
    segs = [(inp.history[:, None], (inp.position + 1)[:, None], OWN)]
    if shared.siblings.shape[1] > 0:
      sib = shared.siblings[inp.row]  # [R, Gs]
      resp = inp.responses[jnp.maximum(sib, 0)]  # [R, Gs, M]
      lim = jnp.where(sib >= 0, inp.response_lengths[jnp.maximum(sib, 0)], 0)
      segs.append((resp, lim, SIBLING))
    if params.prior is not None:
      pr = params.prior[inp.row]  # [R, K, W]
      segs.append((pr, (pr >= 0).sum(-1).astype(jnp.int32), PRIOR))
    return segs

  def candidates(self, target, params: LookupContext, shared: LookupShared, inp, *,
                 num_nodes: int = 0) -> tuple:
    """(Candidates [R, max_branches * max_chain], found [R, sources]) for every row."""
    c = self.max_chain
    suffix, slen = own_suffix(inp.history, inp.position, self.max_ngram)
    toks, lens, ns, srcs = [], [], [], []
    for corpus, limit, src in self.segments(params, shared, inp):
      t, ln, n = find_continuations(corpus, limit, suffix, slen, max_ngram=self.max_ngram,
                                    min_ngram=self.min_ngram, max_chain=c)
      toks.append(t)
      lens.append(ln)
      ns.append(n)
      srcs.append(jnp.full(ln.shape, src, jnp.int32))
    toks, lens, ns, srcs = (jnp.concatenate(x, axis=1) for x in (toks, lens, ns, srcs))
    r, s = lens.shape
    found = jnp.stack([((srcs == k) & (lens > 0)).any(1) for k in range(len(SOURCES))], axis=1)
    # per-depth log acceptance of each segment's chain: acc[src, n, d]
    bins = (srcs * (self.max_ngram + 1) + ns)[..., None] * c + jnp.arange(c)[None, None]
    logp = log_table(params.acceptance.reshape(-1), bins)  # [R, S, C]
    d = jnp.arange(c)[None, None]
    live = d < lens[..., None]
    score = jnp.cumsum(jnp.where(live, logp, 0.0), axis=2)
    # identical continuations: keep the best-scoring segment; then the max_branches best
    same = (toks[:, :, None, :] == toks[:, None, :, :]).all(-1) & (
        lens[:, :, None] == lens[:, None, :])
    first = jnp.where(lens > 0, score[..., 0], -jnp.inf)
    idx = jnp.arange(s)
    better = (first[:, None, :] > first[:, :, None]) | (
        (first[:, None, :] == first[:, :, None]) & (idx[None, None, :] < idx[None, :, None]))
    dup = (same & better & (lens[:, None, :] > 0)).any(-1)
    key = jnp.where(dup | (lens == 0), -jnp.inf, first + 1e-3 * lens)
    nb = min(self.max_branches, s)
    _, keep = jax.lax.top_k(key, nb)
    gather = lambda x: jnp.take_along_axis(x, keep.reshape((r, nb) + (1,) * (x.ndim - 2)), axis=1)
    toks, lens, score, bins = (gather(x) for x in (toks, lens, score, bins))
    kept = jnp.take_along_axis(key, keep, axis=1) > -jnp.inf
    lens = jnp.where(kept, lens, 0)
    # chain (b, depth d) -> candidate b * C + d with the path toks[b, :d + 1]
    paths = jnp.where(jnp.arange(c)[None, None, None, :] <= jnp.arange(c)[None, None, :, None],
                      toks[:, :, None, :], -1)  # [R, nb, C(depth), C(path)]
    depth = jnp.where(jnp.arange(c)[None, None] < lens[..., None], jnp.arange(1, c + 1)[None, None],
                      0)
    cands = _tree.Candidates(paths=paths.reshape(r, nb * c, c), depth=depth.reshape(r, nb * c),
                             score=score.reshape(r, nb * c), bin=bins.reshape(r, nb * c))
    return cands, found


def check_groups(group_ids, prompt_tokens, prompt_lengths, group_size: int) -> None:
  """ValueError unless every group holds at most ``group_size`` rows that share one prompt."""
  gids = np.asarray(group_ids)
  uniq, first, counts = np.unique(gids, return_index=True, return_counts=True)
  big = counts > group_size
  if big.any():
    raise ValueError(f"group id {uniq[big][0]} has {counts[big][0]} rows, more than "
                     f"group_size={group_size}")
  ref = first[np.searchsorted(uniq, gids)]
  lens = np.asarray(prompt_lengths)
  w = np.arange(prompt_tokens.shape[1])[None]
  live = w < lens[:, None]
  same = (lens == lens[ref]) & (np.where(live, prompt_tokens, -1)
                                == np.where(live[ref], prompt_tokens[ref], -1)).all(1)
  if not same.all():
    bad = int(np.flatnonzero(~same)[0])
    raise ValueError(f"rows {int(ref[bad])} and {bad} share group id {int(gids[bad])} (given as "
                     "group_ids, or sample_id // group_size) but not a prompt; siblings must share "
                     "their prompt (sample id = prompt index * G + member)")


def check_groups_on_shards(group_ids, num_shards: int) -> None:
  """ValueError unless every group's rows fall in one of ``num_shards`` equal contiguous shards
  (what a group-aware proposer under ``shard_map`` over rows needs: it sees one shard's rows)."""
  gids = np.asarray(group_ids)
  b = gids.shape[0]
  if num_shards < 1 or b % num_shards:
    raise ValueError(f"{b} rows do not split into num_shards={num_shards} equal shards")
  shard = np.arange(b) // (b // num_shards)
  for g in np.unique(gids):
    on = np.unique(shard[gids == g])
    if len(on) > 1:
      raise ValueError(f"group {int(g)} spans shards {on.tolist()}: a group-aware proposer sees "
                       "one shard's rows only; put each GRPO group on one shard (prompts per "
                       "shard a whole number)")
