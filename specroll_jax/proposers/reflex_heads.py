"""``ReflexProposer``: future-token heads (Medusa or root-conditioned) with Reflex corrections
(the math in ``specroll_jax.adaptation.reflex``; docs/design.md, "Reflex")."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from specroll_jax import _topk
from specroll_jax import sampling as _sampling
from specroll_jax._vma import vary_like
from specroll_jax.adaptation import records as _records
from specroll_jax.adaptation.reflex.config import _TINY, ReflexConfig
from specroll_jax.adaptation.reflex.feedback import _Matured, feedback
from specroll_jax.adaptation.reflex.state import (
  FastState,
  Pending,
  ReflexGlobal,
  ReflexRows,
  ReflexShared,
  _reset,
  _zeros_fast,
)
from specroll_jax.adaptation.reflex.statistics import (
  ReflexStats,
  _rms,
  corrected_head_states,
  gate,
  welford_merge,
)
from specroll_jax.heads import kinds as head_kinds
from specroll_jax.heads.conditioned import CondHeads
from specroll_jax.heads.medusa import Heads
from specroll_jax.models import decoder as _dec
from specroll_jax.proposers import tree as _tree
from specroll_jax.proposers.base import Proposer, RowsShared, coupled_with
from specroll_jax.proposers.ranked_heads import RankedHeads
from specroll_jax.proposers.static_heads import effective_topk, plan_heads


@flax.struct.dataclass
class ReflexParams:
  """Parameters of ``ReflexProposer``: the heads (Medusa ``heads.Heads`` or root-conditioned
  ``cond_heads.CondHeads``) and Reflex's global safety per head (``ReflexGlobal``)."""

  heads: Heads | CondHeads
  reflex: ReflexGlobal


@dataclasses.dataclass(frozen=True)
class ReflexProposer(Proposer):
  """Future-token heads with Reflex corrections. Parameters: ``ReflexParams``
  (``ReflexProposer.params``); state: ``RowsShared(ReflexRows, ReflexShared)``."""

  config: ReflexConfig = ReflexConfig()

  @property
  def max_depth(self) -> int:
    return self.config.num_heads

  @property
  def ranked(self) -> RankedHeads:
    """The depth-by-depth expansion root-conditioned heads propose with."""
    c = self.config
    return RankedHeads(num_heads=c.num_heads, topk=c.topk, beams=c.beams, max_nodes=c.max_nodes,
                       coupled=c.coupled)

  @property
  def capacity(self) -> int:
    if self.config.conditioned:
      return self.ranked.capacity
    total, width = 0, 1
    for k in self.config.topk:
      width *= k
      total += width
    return total

  @property
  def feedback_topm(self) -> int:
    return self.config.top

  def params(self, heads: Heads | CondHeads, glob: ReflexGlobal) -> ReflexParams:
    """The parameters from the heads and Reflex's global state (``reflex.init_global``)."""
    return ReflexParams(heads=heads, reflex=glob)

  def validate(self, config, params) -> None:
    if not isinstance(params, ReflexParams) or not isinstance(params.reflex, ReflexGlobal):
      raise ValueError("ReflexProposer params must be a ReflexParams(heads, reflex.ReflexGlobal) "
                       f"(ReflexProposer.params(...)), got {type(params).__name__}")
    head_kinds.validate(config, params.heads, self.config.num_heads)
    if head_kinds.is_conditioned(params.heads) != self.config.conditioned:
      raise ValueError(f"ReflexConfig.conditioned={self.config.conditioned} but the heads are "
                       f"{type(params.heads).__name__} (root-conditioned heads need "
                       "conditioned=True, Medusa heads False)")
    if params.reflex.safety.shape != (self.config.num_heads,):
      raise ValueError(f"ReflexGlobal.safety has shape {params.reflex.safety.shape}, expected "
                       f"({self.config.num_heads},)")

  def split_state(self, state):
    return state.rows, state.shared

  def join_state(self, rows, shared):
    return RowsShared(rows=rows, shared=shared)

  def init(self, target, params, rows):
    cfg = self.config
    r = rows.row.shape[0]
    k, s, d = cfg.num_heads, cfg.slots, target.config.hidden_size
    c, t = cfg.max_candidates, cfg.top
    f = lambda *sh: jnp.zeros((r, k, s) + sh, jnp.float32)
    i = lambda *sh: jnp.full((r, k, s) + sh, -1, jnp.int32)
    pending = Pending(position=i(), hidden=f(d), head=f(d), correction=f(d), qtop=i(t), cand=i(c),
                      corr_top=i(c), raw_top=i(c), sigma=f(cfg.sketch_dim),
                      has_sigma=jnp.zeros((r, k, s), bool), applied=jnp.zeros((r, k, s), bool),
                      path=i(k))
    zk = jnp.zeros((r, k), jnp.int32)
    share = cfg.share_group > 0
    row_state = ReflexRows(fast=None if share else _zeros_fast(r, k, d), pending=pending,
                           steps=jnp.zeros((r,), jnp.int32),
                           proposed=jnp.zeros((r,), jnp.int32), applied=zk,
                           ratio_sum=jnp.zeros((r, k), jnp.float32),
                           lcb_sum=jnp.zeros((r, k), jnp.float32), lcb_n=zk,
                           expected=(jnp.zeros((r, self.capacity + 1), jnp.float32)
                                     if cfg.conditioned else None))
    groups = -(-r // cfg.share_group) if share else 0
    recs = None
    if cfg.record_capacity > 0:
      recs = _records.empty(k, cfg.record_capacity, d, cfg.support_size, c,
                            path=k if cfg.conditioned else 0)
    shared = ReflexShared(batch_rows=jnp.int32(r),
                          group=_zeros_fast(groups, k, d) if share else None, records=recs)
    return RowsShared(rows=row_state, shared=shared)

  # -- fast state views (per row, or gathered from the row's group)

  def _view(self, rows: ReflexRows, shared: ReflexShared, row_ids) -> FastState:
    if self.config.share_group > 0:
      g = row_ids // self.config.share_group
      return jax.tree.map(lambda x: x[g], shared.group)
    return rows.fast

  def propose(self, target, params, state, inp, *, num_nodes):
    tr, state, _ = self.propose_with(target, params, state, inp, num_nodes=num_nodes)
    return tr, state

  def propose_with(self, target, params, state, inp, *, num_nodes: int, table=None, extra=None,
                   ranks: int | None = None):
    """``propose`` for a composite (``proposers.MergedReflex``): root-conditioned heads score
    their nodes with the calibrated ``table`` ([K * Q] by (depth, bin of q); None: each bin's own
    q), ``extra`` (``tree.Candidates`` of another source, bins already offset) joins the one
    ranked tree, and ``ranks`` sizes ``Selection.expected`` (default: this proposer's capacity
    + 1). Returns (tree, state, the ``tree.Selection``; None for Medusa heads)."""
    cfg = self.config
    rows, shared = state
    if num_nodes == 0:
      return _tree.root_only(inp.root), state, None
    heads, glob = params.heads, params.reflex
    k = cfg.num_heads
    active = inp.budget > 0
    fast = self._view(rows, shared, inp.row)
    expected = sel = None
    if cfg.conditioned:
      tr, z, zc, c, logits, ctx, eligible, ratio, low, sel = self._propose_conditioned(
          target, heads, glob, fast, inp, num_nodes, active, table=table, extra=extra,
          ranks=self.capacity + 1 if ranks is None else ranks)
      expected = sel.expected[:, : self.capacity + 1]
    else:
      if table is not None or extra is not None:
        raise ValueError("ReflexProposer.propose_with: table and extra need root-conditioned "
                         "heads (ReflexConfig.conditioned=True)")
      z, zc, c, eligible, ratio, low = corrected_head_states(target, heads, glob, cfg, fast,
                                                             inp.hidden)
      eligible = eligible & active[:, None]
      logits = _dec.logits_from_hidden(target.config, target.params, zc)  # [R, K, V]
      topk = effective_topk(cfg.topk, num_nodes)
      tr = plan_heads(target, logits[:, : len(topk)], inp, num_nodes=num_nodes, topk=topk,
                      coupled=cfg.coupled)
      ctx = jnp.full(z.shape[:2] + (k,), -1, jnp.int32)
    # prediction records, on feedback rounds (skipped, as a whole, when no row records)
    n_active = active.sum()
    stride = jnp.maximum(cfg.stride, jnp.ceil(cfg.stride_rows * n_active / shared.batch_rows)
                         ).astype(jnp.int32)
    rnd = active & (rows.steps % stride == 0)
    if cfg.conditioned:  # heads the tree did not reach (num_nodes < K) record nothing
      rnd_k = rnd[:, None] & (jnp.arange(k) < min(k, num_nodes))[None]
    else:
      rnd_k = jnp.broadcast_to(rnd[:, None], (rnd.shape[0], k))

    def record():
      return self._record(target, fast, inp, tr, z, zc, c, logits, ctx, eligible, rnd, rnd_k,
                          rows.pending)

    pend = jax.lax.cond(rnd_k.any(), record, lambda: rows.pending)
    finite_low = jnp.isfinite(low) & active[:, None]
    rows = rows.replace(pending=pend, steps=rows.steps + active.astype(jnp.int32),
                        proposed=rows.proposed + active.astype(jnp.int32),
                        applied=rows.applied + eligible.astype(jnp.int32),
                        ratio_sum=rows.ratio_sum + jnp.where(eligible, ratio, 0.0),
                        lcb_sum=rows.lcb_sum + jnp.where(finite_low, low, 0.0),
                        lcb_n=rows.lcb_n + finite_low.astype(jnp.int32),
                        expected=(None if expected is None
                                  else jnp.where(active[:, None], expected, 0.0)))
    return tr, RowsShared(rows=rows, shared=shared), sel

  def _record(self, target, fast: FastState, inp, tr, z, zc, c, logits, ctx, eligible, rnd,
              rnd_k, pend: Pending) -> Pending:
    """The pending records with each recording (row, head)'s prediction written to its slot."""
    cfg = self.config
    k = cfg.num_heads
    cmax = cfg.max_candidates
    kc = jnp.asarray(cfg.topk)[None, :, None]
    jj = jnp.arange(cmax)[None, None]
    ks = jnp.arange(1, k + 1)
    pos = inp.position[:, None] + ks[None]  # [R, K]: position head k predicts
    if coupled_with(target, inp, cfg.coupled, "ReflexConfig"):  # the tree's ranking
      def ranked(lg):
        keys, _ = _sampling.draft_keys(lg, target.sampling, inp.seed[:, None],
                                       inp.sample_ids[:, None], pos, coupled=True)
        return jax.lax.top_k(keys, cmax)[1]
      qtop, corr_top = _topk.top_ids(logits, cfg.top)[0], ranked(logits)
    else:
      ranked = lambda lg: jax.lax.top_k(lg, cmax)[1]
      qtop, corr_top = _topk.top_ids(logits, cfg.top, cmax)  # one top-k over V, two prefixes
    corr_top = jnp.where(jj < kc, corr_top, -1)
    raw_top = jax.lax.cond(  # the raw head's logits: only when a corrected head is recorded
        (eligible & rnd[:, None]).any(),
        lambda: jnp.where(jj < kc, ranked(_dec.logits_from_hidden(
            target.config, target.params, z)), -1),
        lambda: corr_top)
    at_depth = tr.valid[:, None, :] & (tr.depth[:, None, :] == ks[None, :, None])  # [R, K, N1]
    present = ((tr.tokens[:, None, None, :] == corr_top[..., None])
               & at_depth[:, :, None, :]).any(-1)
    cand = jnp.where(present, corr_top, -1)
    rms_m = _rms(fast.m)
    sk = (fast.m / jnp.maximum(rms_m, _TINY)[..., None]) @ cfg.sketch(fast.m.shape[-1])
    sigma = sk / jnp.maximum(jnp.linalg.norm(sk, axis=-1, keepdims=True), _TINY)
    has_sigma = (rms_m > 0) & jnp.isfinite(rms_m)
    slot = pos % cfg.slots
    sel = (jnp.arange(cfg.slots)[None, None] == slot[..., None]) & rnd_k[..., None]  # [R, K, S]
    put = lambda old, new: jnp.where(sel.reshape(sel.shape + (1,) * (old.ndim - 3)),
                                     jnp.expand_dims(new, 2).astype(old.dtype), old)
    hid = jnp.broadcast_to(inp.hidden[:, None].astype(jnp.float32), z.shape)
    return Pending(position=put(pend.position, pos), hidden=put(pend.hidden, hid),
                   head=put(pend.head, zc.astype(jnp.float32)), correction=put(pend.correction, c),
                   qtop=put(pend.qtop, qtop), cand=put(pend.cand, cand),
                   corr_top=put(pend.corr_top, corr_top), raw_top=put(pend.raw_top, raw_top),
                   sigma=put(pend.sigma, sigma), has_sigma=put(pend.has_sigma, has_sigma),
                   applied=put(pend.applied, eligible), path=put(pend.path, ctx))

  def _propose_conditioned(self, target, heads, glob: ReflexGlobal, fast: FastState, inp,
                           num_nodes: int, active, *, table=None, extra=None, ranks: int):
    """Root-conditioned heads: the ranked depth-by-depth tree with each head's evaluations
    corrected (scored by ``table``; joined by ``extra`` candidates), and the trunk (best path)
    evaluations padded to K heads for the records."""
    cfg = self.config
    k = cfg.num_heads
    eligible, _, ratio, low = gate(cfg, fast, glob.safety)
    eligible = eligible & active[:, None]
    rms_m = jnp.maximum(_rms(fast.m), _TINY)  # [R, K]

    def bounded(i, zz):  # head i's correction of states zz [R, P, D]
      scale = ratio[:, i, None] * _rms(zz.astype(jnp.float32)) / rms_m[:, i, None]
      return jnp.where(eligible[:, i, None, None], scale[..., None] * fast.m[:, None, i], 0.0)

    def correct(kk, zz):
      c = bounded(kk - 1, zz)
      return jnp.where(eligible[:, kk - 1, None, None],
                       (zz.astype(jnp.float32) + c).astype(zz.dtype), zz)

    rh = self.ranked
    cands, (z, zc, logits, ctx) = rh.expand(target, rh.params(heads, table), inp,
                                            num_nodes=num_nodes, correct=correct)
    depth = k
    if extra is not None:
      depth = max(k, extra.paths.shape[2])
      cands = _tree.concat_candidates(cands, extra)
    tr, sel = _tree.select(inp.root, cands, inp.budget, num_nodes=num_nodes, max_depth=depth,
                           ranks=ranks)
    c = jnp.concatenate([bounded(i, z[:, i:i + 1]) for i in range(z.shape[1])], axis=1)
    pad = lambda x, v=0: jnp.pad(x, ((0, 0), (0, k - x.shape[1])) + ((0, 0),) * (x.ndim - 2),
                                 constant_values=v)
    used = jnp.arange(k) < z.shape[1]
    return (tr, pad(z), pad(zc), pad(c), pad(logits), pad(ctx, -1), eligible & used[None],
            ratio, low, sel)

  def update(self, target, params, state, fb):
    cfg = self.config
    rows, shared = state
    pend = rows.pending
    r, k, s = pend.position.shape
    d1 = fb.tokens.shape[1]
    # which records mature now: their position was committed in this step
    j = pend.position - fb.position[:, None, None] - 1
    jc = jnp.clip(j, 0, d1 - 1)
    kept = jnp.take_along_axis(fb.keep, jc.reshape(r, -1), axis=1).reshape(jc.shape)
    due = (pend.position >= 0) & (j >= 0) & (j < fb.path_len[:, None, None]) & kept
    fast = self._view(rows, shared, fb.row)
    n_commit = fb.keep.sum(1).astype(jnp.float32)[:, None, None]  # [R, 1, 1]
    rho = jnp.asarray(cfg.rho, jnp.float32)[None, :, None]  # [1, K, 1]

    def matured():  # (every leaf varying like the rows under a caller's shard_map, as idle's)
      return vary_like(self._mature(target, pend, fb, due, j, jc, n_commit, rho, shared.records),
                       pend.position, fb.position)

    def idle():  # nothing matures: what ``matured`` gives then, without computing it
      zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(matured))
      return vary_like(zeros, pend.position, fb.position)._replace(records=shared.records)

    mat = jax.lax.cond(due.any(), matured, idle)
    # m decays once per committed token; a matured record adds at its token's place in order
    m = rho ** n_commit * fast.m + mat.dm
    m = m / jnp.maximum(1.0, _rms(m))[..., None]
    bad_row = ~jnp.isfinite(m).all(-1) | mat.bad  # [R, K]
    if cfg.share_group == 0:
      new = welford_merge(fast, mat.cnt, mat.tot, mat.sq).replace(
          m=m, severity=fast.severity + mat.sev_add)
      bad = bad_row | ~(jnp.isfinite(new.mean) & jnp.isfinite(new.m2))
      rows = rows.replace(fast=_reset(new, bad))
    else:  # a group takes its rows' observations and the mean change of its active rows' m
      gid = fb.row // cfg.share_group
      grp = shared.group
      seg = lambda x: jax.ops.segment_sum(x, gid, num_segments=grp.m.shape[0])
      w = fb.active.astype(jnp.float32)
      gm = grp.m + seg((m - fast.m) * w[:, None, None]) / jnp.maximum(seg(w), 1)[:, None, None]
      gm = gm / jnp.maximum(1.0, _rms(gm))[..., None]
      newg = welford_merge(grp, seg(mat.cnt), seg(mat.tot), seg(mat.sq)).replace(
          m=gm, severity=grp.severity + seg(mat.sev_add))
      badg = (seg(bad_row.astype(jnp.int32)) > 0) | ~(
          jnp.isfinite(newg.m).all(-1) & jnp.isfinite(newg.mean) & jnp.isfinite(newg.m2))
      shared = shared.replace(group=_reset(newg, badg))
      bad = badg[gid] & fb.active[:, None]
    shared = shared.replace(records=mat.records)
    # matured records leave the ring; a finished row drops its pending records
    position = jnp.where(due | fb.done[:, None, None], -1, pend.position)
    per_head = lambda x: x.sum(axis=tuple(i for i in range(x.ndim) if i != 1))
    on = (rows.proposed > 0) & fb.active
    stats = mat.stats.replace(
        row_head_steps=jnp.broadcast_to(rows.proposed.sum(), (k,)).astype(jnp.int32),
        applied=per_head(rows.applied), ratio_sum=per_head(rows.ratio_sum),
        lcb_sum=per_head(rows.lcb_sum), lcb_n=per_head(rows.lcb_n),
        resets=per_head(bad.astype(jnp.int32)),
        # expected accepted nodes by tree size, for goodput (root-conditioned heads)
        expected=jnp.where(on[:, None], rows.expected, 0.0).sum(0) if cfg.conditioned else None,
        expected_n=on.sum().astype(jnp.int32) if cfg.conditioned else None)
    zk = jnp.zeros_like(rows.applied)
    rows = rows.replace(pending=pend.replace(position=position), applied=zk,
                        proposed=jnp.zeros_like(rows.proposed),
                        ratio_sum=jnp.zeros_like(rows.ratio_sum),
                        lcb_sum=jnp.zeros_like(rows.lcb_sum), lcb_n=zk)
    return RowsShared(rows=rows, shared=shared), stats

  def _mature(self, target, pend: Pending, fb, due, j, jc, n_commit, rho, records) -> _Matured:
    """What the records that mature in this step contribute (all zeros, and ``records`` as is,
    when none does): the feedback math, the observations, the state's increment and the slow
    path's records."""
    cfg = self.config
    r, k, s = pend.position.shape
    mature = due
    if cfg.conditioned:  # a head's prediction counts only if the path it read was committed
      start = pend.position - jnp.arange(k)[None, :, None] - 1  # the root's position
      at = (start[..., None] + jnp.arange(k)).reshape(r, -1)
      seen = jnp.take_along_axis(fb.history, jnp.clip(at, 0, fb.history.shape[1] - 1), axis=1)
      mature = due & ((pend.path < 0) | (seen.reshape(pend.path.shape) == pend.path)).all(-1)
    take_j = lambda x: jnp.take_along_axis(
        x, jc.reshape((r, -1) + (1,) * (x.ndim - 2)), axis=1).reshape(jc.shape + x.shape[2:])
    token = take_j(fb.tokens)
    mt = self._feedback_due(target, due, (
        pend.head, pend.qtop, take_j(fb.topm_ids)[..., : cfg.top], token, pend.cand,
        pend.corr_top, pend.raw_top, take_j(fb.path_hidden), take_j(fb.lse))
        + (() if fb.floor is None else (take_j(fb.floor),)))
    finite = jnp.isfinite(mt.g).all(-1) & jnp.isfinite(mt.severity)
    ok = mature & finite
    use = ok & (mt.severity >= cfg.severity_floor)
    # alignment observations: cosine between the state's sketch then and g's sketch now
    gs = mt.g @ cfg.sketch(mt.g.shape[-1])
    gs = gs / jnp.maximum(jnp.linalg.norm(gs, axis=-1, keepdims=True), _TINY)
    cos = (pend.sigma * gs).sum(-1)
    obs = ok & pend.has_sigma & (jnp.linalg.norm(mt.g, axis=-1) > 0)
    cnt = obs.sum(-1)
    tot = jnp.where(obs, cos, 0.0).sum(-1)
    sq = jnp.where(obs, cos * cos, 0.0).sum(-1)
    sev_add = jnp.where(use, mt.severity, 0.0).sum(-1)
    unit = jnp.where(use[..., None], mt.g / jnp.maximum(_rms(mt.g), _TINY)[..., None], 0.0)
    weight = jnp.where(use, (1 - rho) * mt.severity * rho ** (n_commit - 1 - j), 0.0)
    dm = jnp.einsum("rks,rksd->rkd", weight, unit)
    # records for the slow path
    hit = _records.member(token[..., None], pend.cand)[..., 0]
    if records is not None:
      kflat = lambda x: jnp.swapaxes(x, 0, 1).reshape((k, r * s) + x.shape[3:])
      batch = _records.Records(
          hidden=kflat(pend.hidden), correction=kflat(pend.correction), support=kflat(mt.support),
          p=kflat(mt.p), p_tail=kflat(mt.p_tail), token=kflat(token), candidates=kflat(pend.cand),
          hit=kflat(hit), tv=kflat(mt.tv), position=kflat(pend.position),
          valid=kflat(ok), count=jnp.zeros((k,), jnp.int32),
          path=kflat(pend.path) if cfg.conditioned else None)
      records = _records.write(records, batch, kflat(ok))
    applied = ok & pend.applied
    per_head = lambda x: x.sum(axis=tuple(i for i in range(x.ndim) if i != 1))
    stats = self.init_stats().replace(
        matured=per_head(ok.astype(jnp.int32)), updates=per_head(use.astype(jnp.int32)),
        tv_sum=per_head(jnp.where(ok, mt.tv, 0.0)), hits=per_head((ok & hit).astype(jnp.int32)),
        gain_sum=per_head(jnp.where(applied, mt.gain, 0.0)),
        gain_sq=per_head(jnp.where(applied, mt.gain * mt.gain, 0.0)),
        gain_n=per_head(applied.astype(jnp.int32)))
    return _Matured(cnt=cnt, tot=tot, sq=sq, sev_add=sev_add, dm=dm,
                    bad=(mature & ~finite).any(-1), records=records, stats=stats)

  def _feedback_due(self, target, due, args):
    """``feedback`` of the records [R, K, S] over ``args`` (leaves [R, K, S, ...]), computed only
    for the ``due`` ones: they are gathered into R * K entries (one per (row, head): what a step
    matures unless feedback rounds come closer than K steps apart) and the results scattered
    back (zeros where not due: every later use is masked by ``due``); more due records than that
    take the dense path over all R * K * S slots. Per entry the math is the same, so both paths
    give the same feedback; the compact one does 1/S of the work (S = K + 2 slots)."""
    cfg = self.config
    shape = due.shape
    n_all = due.size
    m = min(n_all, shape[0] * shape[1])

    def dense():
      return feedback(cfg, target, *args)

    def compact():
      idx = jnp.nonzero(due.reshape(-1), size=m, fill_value=n_all)[0]  # padding: out of range
      take = lambda x: jnp.take(x.reshape((n_all,) + x.shape[3:]), idx, axis=0, mode="clip")
      mt = feedback(cfg, target, *(take(x) for x in args))
      back = lambda x: jnp.zeros((n_all,) + x.shape[1:], x.dtype).at[idx].set(
          x, mode="drop").reshape(shape + x.shape[1:])
      return jax.tree.map(back, mt)

    if m == n_all:
      return dense()
    # (dense first: a test that forces every cond's first branch keeps the exact dense path)
    return jax.lax.cond(due.sum() > m, dense, compact)

  def expected_gain(self, state, num_nodes: int):
    rows = state.rows
    if rows.expected is None:
      return None
    return rows.expected[:, min(num_nodes, self.capacity)]

  def init_stats(self) -> ReflexStats:
    return ReflexStats.zeros(self.config.num_heads,
                             self.capacity + 1 if self.config.conditioned else None)

