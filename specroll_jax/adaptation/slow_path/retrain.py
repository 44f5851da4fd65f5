"""The guarded refresh: AdamW on the heads only (sparse distillation + token CE + proximal KL) on
the reservoir's training part, each head kept only when its held-out records confirm it
(docs/design.md, "Slow path")."""

from __future__ import annotations

import collections
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Int

from specroll_jax.adaptation.records import Records
from specroll_jax.adaptation.slow_path.config import SlowPathConfig
from specroll_jax.adaptation.slow_path.state import Evaluation, RefreshResult
from specroll_jax.heads import kinds as head_kinds
from specroll_jax.heads.medusa import Heads
from specroll_jax.models import decoder as _dec
from specroll_jax.models.config import ModelConfig
from specroll_jax.sampling import MASKED_LOGIT


def optimizer(cfg: SlowPathConfig) -> optax.GradientTransformation:
  """The per-head AdamW (applied to one head's parameters; ``init`` vmaps it over K). Gradients are
  clipped to global norm ``cfg.clip_norm`` per head before it (a stateless step kept out of the
  chain: orbax cannot save a state tree that starts with an empty node)."""
  def decay_mask(p):  # decay the weight matrices and biases, not the norm scales
    if head_kinds.is_conditioned(p):
      return p.replace(norm_h=False, norm_e=False, w_h=True, w_e=True, b=True, w_o=True)
    return p.replace(norm=False, w=True, b=True)

  return optax.adamw(cfg.learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                     weight_decay=cfg.weight_decay, mask=decay_mask)



def holdout_slots(cfg: SlowPathConfig, capacity: int) -> np.ndarray:
  """[C] bool: the reservoir slots held out of training (every 1/holdout_fraction-th slot; ring
  slots hold consecutive records, so the held-out set is a stratified sample over time)."""
  j = np.arange(capacity)
  return np.floor((j + 1) * cfg.holdout_fraction) > np.floor(j * cfg.holdout_fraction)


def _chunks(cfg: SlowPathConfig, capacity: int, slots=None) -> tuple[np.ndarray, np.ndarray]:
  """([nc, cs] slot index, [nc, cs] inside) over ``slots`` (default: every slot), in nc chunks of
  ``chunk_size``, strided: chunk j holds slots j, j + nc, j + 2 nc, ... of ``slots``, so every
  chunk is spread over the ring (ring slots hold consecutive records: over time), whatever its
  size. Positions past the end repeat the last slot, marked outside."""
  slots = np.arange(capacity) if slots is None else np.asarray(slots)
  cs = min(cfg.chunk_size, len(slots))
  nc = -(-len(slots) // cs)
  pos = np.arange(nc * cs).reshape(cs, nc).T  # pos[j, i] = i * nc + j
  return slots[np.minimum(pos, len(slots) - 1)], pos < len(slots)


def step_groups(cfg: SlowPathConfig, capacity: int) -> np.ndarray | None:
  """[G, step_chunks] chunk ids of the minibatch groups (None: full-batch steps). Group g holds
  chunks g, g + G, g + 2G, ... (mod the chunk count); each chunk is itself spread over the ring
  (:func:`_chunks`), so every group is a sample over time."""
  nc = len(_chunks(cfg, capacity)[0])
  k = cfg.step_chunks
  if k == 0 or k >= nc:
    return None
  g = -(-nc // k)
  return (np.arange(g)[:, None] + g * np.arange(k)[None, :]) % nc


# log-prob of the tail bucket when the softmax is over the support alone (``sparse``): the CE's
# tail term has p_tail = 0 (``_sparse_records``) and the proximal KL's is exp(-100) x 0 = 0
_NO_TAIL = -100.0


def _support_log_probs(model_config, params, z, r: Records, inv_t):
  """(log-probs on the support [c, S] (0 where unused), tail [c] (``_NO_TAIL``), committed
  token [c]) of the head's softmax over each record's support alone: |S| unembedding rows per
  record, not the V x D unembedding. The token is on the support (``reflex.feedback``)."""
  used = r.support >= 0
  rows = _dec.unembedding_rows(model_config, params, jnp.where(used, r.support, 0))  # [c, S, D]
  normed = _dec.final_norm(model_config, params, z)
  x = jnp.einsum("cd,csd->cs", normed, rows.astype(normed.dtype)).astype(jnp.float32) * inv_t
  # the full path's finite mask: an empty slot (no id on its support, weight 0) stays finite
  x = jnp.where(used, x, MASKED_LOGIT)
  lq_s = jnp.where(used, x - jax.nn.logsumexp(x, axis=-1, keepdims=True), 0.0)
  tok = jnp.where(used & (r.support == r.token[:, None]), lq_s, 0.0).sum(-1)
  return lq_s, jnp.full(r.token.shape, _NO_TAIL, jnp.float32), tok


def _log_probs(cfg, model_config, params, heads, rec: Records, active=None, sparse=False):
  """Head log-probs on a chunk (leaves [K, c, ...]): on the support [K, c, S] (0 where unused),
  of the tail bucket (everything off the support) [K, c], of the committed token [K, c].
  Root-conditioned heads read each record's path (``rec.path``). ``active`` [K] bool (None: every
  head): a head outside it is skipped (``lax.cond``: no unembedding, no softmax over V) and comes
  back as zeros, so a refresh of one head of K costs one head's work. ``sparse``: the softmax
  over the support alone (``SlowPathConfig.refresh_vocab="support"``, :func:`_support_log_probs`;
  pair it with :func:`_sparse_records` in the terms)."""
  inv_t = 1.0 / cfg.temperature if cfg.temperature > 0 else 1.0

  def one(i, r: Records):  # head i on its records r (leaves [c, ...])
    z = head_kinds.output_states(model_config, params, heads, i, r.hidden, r.path)  # [c, D]
    if cfg.use_correction:
      z = z + r.correction.astype(z.dtype)
    if sparse:
      return _support_log_probs(model_config, params, z, r, inv_t)
    logits = _dec.logits_from_hidden(model_config, params, z) * inv_t  # [c, V] f32
    v = logits.shape[-1]
    lse = jax.nn.logsumexp(logits, axis=-1)
    used = r.support >= 0
    lq_s = jnp.take_along_axis(logits, jnp.where(used, r.support, 0), -1) - lse[..., None]
    rows = np.arange(logits.shape[0])[:, None]
    on_s = jnp.zeros(logits.shape, bool).at[rows, jnp.where(used, r.support, v)].set(
        True, mode="drop")
    lse_tail = jax.nn.logsumexp(jnp.where(on_s, MASKED_LOGIT, logits), axis=-1)
    lq_tail = jnp.maximum(lse_tail - lse, -100.0)
    tok = jnp.take_along_axis(logits, jnp.maximum(r.token, 0)[..., None], -1)[..., 0] - lse
    return jnp.where(used, lq_s, 0.0), lq_tail, tok

  outs = []
  for i in range(heads.num_heads):
    r = jax.tree.map(lambda x, i=i: x[i], rec)
    f = functools.partial(one, i)
    if active is None:
      outs.append(f(r))
    else:
      skip = lambda r: (jnp.zeros(r.support.shape, jnp.float32),
                        jnp.zeros(r.token.shape, jnp.float32),
                        jnp.zeros(r.token.shape, jnp.float32))
      outs.append(jax.lax.cond(active[i], f, skip, r))
  return tuple(jnp.stack(x) for x in zip(*outs, strict=True))


def _terms(rec: Records, lq_s, lq_tail, lq_tok):
  """Per record [K, c]: sparse distillation CE, sparse TV, token CE."""
  used = rec.support >= 0
  p_s = jnp.where(used, rec.p, 0.0) * (1.0 - rec.p_tail)[..., None]
  ce = -(p_s * lq_s).sum(-1) - rec.p_tail * lq_tail
  q = jnp.where(used, jnp.exp(lq_s - jax.nn.logsumexp(jnp.where(used, lq_s, -jnp.inf), -1,
                                                      keepdims=True)), 0.0)
  tv = 0.5 * jnp.abs(jnp.where(used, rec.p, 0.0) - q).sum(-1)
  return ce, tv, -lq_tok


def _sparse_records(rec: Records, sparse: bool) -> Records:
  """The records as the support-only objective reads them: the target's p on the support (already
  renormalised there) with no tail mass."""
  return rec.replace(p_tail=jnp.zeros_like(rec.p_tail)) if sparse else rec


def _take(rec: Records, idx) -> Records:
  return jax.tree.map(lambda x: jnp.take(x, idx, axis=1) if x.ndim >= 2 else x, rec)


def _forward(cfg, model_config, params, heads: Heads, reservoir: Records, select, keep_terms,
             active=None, slots=None, sparse=False):
  """Chunked forward of the heads in ``active`` (None: all) over the reservoir's ``slots`` (None:
  every slot): the Evaluation over ``select`` (and valid; NaN for a head outside ``active``) and,
  with ``keep_terms``, the log-probs on the support and tail per chunk ([nc, K, cs, ...]; zeros
  outside ``active``). ``sparse``: the support-only softmax (its Evaluation is on the support)."""
  idx, inside = _chunks(cfg, reservoir.capacity, slots)

  def body(acc, xs):
    i, ok = xs
    rec = _take(reservoir, i)
    w = (jnp.take(select, i, axis=1) & rec.valid & ok).astype(jnp.float32)
    lq_s, lq_tail, lq_tok = _log_probs(cfg, model_config, params, heads, rec, active, sparse)
    ce, tv, tok = _terms(_sparse_records(rec, sparse), lq_s, lq_tail, lq_tok)
    acc = jax.tree.map(jnp.add, acc, ((ce * w).sum(1), (tv * w).sum(1), (tok * w).sum(1),
                                      w.sum(1)))
    return acc, ((lq_s, lq_tail) if keep_terms else None)

  zeros = jnp.zeros((reservoir.num_heads,), jnp.float32)
  (ce, tv, tok, n), terms = jax.lax.scan(body, (zeros,) * 4, (jnp.asarray(idx),
                                                               jnp.asarray(inside)))
  on = n > 0 if active is None else (n > 0) & active
  mean = lambda s: jnp.where(on, s / jnp.maximum(n, 1.0), jnp.nan)
  return Evaluation(ce=mean(ce), tv=mean(tv), token_ce=mean(tok), n=n), terms


def evaluate(cfg: SlowPathConfig, model_config: ModelConfig, params, heads: Heads,
             reservoir: Records, select: Bool[Array, "K C"]) -> Evaluation:
  """Mean sparse CE, sparse TV and token CE per head over the records where ``select`` and valid
  (NaN for a head without such records)."""
  return _forward(cfg, model_config, params, heads, reservoir, select, False)[0]


def keep_rule(cfg: SlowPathConfig, trained: Bool[Array, " K"], before: Evaluation,
              after: Evaluation) -> Bool[Array, " K"]:
  """Keep a trained head when held-out CE <= keep_ce_ratio x before and held-out TV went down
  (every trained head when ``cfg.guard`` is off). NaN (no held-out records) rolls back."""
  if not cfg.guard:
    return trained
  return trained & (after.ce <= cfg.keep_ce_ratio * before.ce) & (after.tv < before.tv)


def _select(mask: Bool[Array, " K"], new, old):
  """Per head (leading K axis of every leaf): ``new`` where mask, else ``old`` bit for bit."""
  return jax.tree.map(lambda a, b: jnp.where(mask.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                      new, old)


def refresh(cfg: SlowPathConfig, model_config: ModelConfig, params, heads: Heads,
            opt_state: optax.OptState, reservoir: Records, mask: Bool[Array, " K"],
            num_steps: Int[Array, ""]) -> tuple[Heads, optax.OptState, RefreshResult]:
  """Train the heads in ``mask`` for ``num_steps`` AdamW steps on the reservoir's training records
  (full-batch, or minibatches of ``cfg.step_chunks`` chunks: :func:`step_groups`), then keep or
  roll back each one by :func:`keep_rule` on the held-out records (the "after" evaluation reads
  only the held-out slots).

  ``cfg`` and ``model_config`` are static (``cfg.refresh_settings()`` gives the same result with
  fewer distinct programs); ``mask`` and ``num_steps`` are traced, so one compiled
  program serves every head selection, step count and reservoir content (shapes are fixed by the
  reservoir capacity). Only the trained heads are computed (``lax.cond`` per head: a refresh of
  one head of K costs one head's unembeddings); the others' held-out evaluations are NaN. Heads
  outside ``mask``, and rolled-back heads, come back with their input parameters and optimiser
  state bit for bit.
  The target ``params`` are only read (final norm and unembedding).
  """
  tx, clip = optimizer(cfg), optax.clip_by_global_norm(cfg.clip_norm)
  c = reservoir.capacity
  held_slot = holdout_slots(cfg, c)  # [C] static
  held = jnp.asarray(held_slot)[None] & reservoir.valid  # [K, C]
  train = ~held & reservoir.valid
  n_train = train.sum(1).astype(jnp.float32)
  trained = mask & (n_train > 0)
  sparse = cfg.refresh_vocab == "support"
  held_only = np.flatnonzero(held_slot)
  # held-out evaluation before, and the pre-refresh head on every record (proximal term); with
  # the support-only objective, the evaluation stays over the full vocabulary (held-out slots
  # only) and the proximal term is on the support
  if sparse:
    before = _forward(cfg, model_config, params, heads, reservoir, held, False, trained,
                      slots=held_only)[0]
    old = _forward(cfg, model_config, params, heads, reservoir, held, True, trained,
                   sparse=True)[1]
  else:
    before, old = _forward(cfg, model_config, params, heads, reservoir, held, True, trained)
  idx, inside = _chunks(cfg, c)
  xs = (jnp.asarray(idx), jnp.asarray(inside))
  groups = step_groups(cfg, c)
  if groups is not None:  # training records per head in each chunk [K, nc]
    per_chunk = (jnp.take(train, jnp.asarray(idx), axis=1) & jnp.asarray(inside)).sum(-1)

  def chunk_loss(hd, rec, w, lo_s, lo_tail, weight):
    lq_s, lq_tail, lq_tok = _log_probs(cfg, model_config, params, hd, rec, trained, sparse)
    ce, tv, tok = _terms(_sparse_records(rec, sparse), lq_s, lq_tail, lq_tok)
    used = rec.support >= 0
    kl = (jnp.where(used, jnp.exp(lo_s) * (lo_s - lq_s), 0.0).sum(-1)
          + jnp.exp(lo_tail) * (lo_tail - lq_tail))
    per = cfg.distill_weight * ce + cfg.token_weight * tok + cfg.proximal_weight * kl
    if cfg.tv_weight > 0:
      per = per + cfg.tv_weight * tv
    per_head = (per * w).sum(1) * weight  # [K]
    return per_head.sum(), per_head

  def grads(hd, i):
    chunks = xs + old
    n = n_train
    if groups is not None:  # step i's minibatch: group i mod G, its own mean
      sel = jnp.asarray(groups)[i % len(groups)]
      chunks = jax.tree.map(lambda a: jnp.take(a, sel, axis=0), chunks)
      n = jnp.take(per_chunk, sel, axis=1).sum(1).astype(jnp.float32)
    weight = jnp.where(trained, 1.0 / jnp.maximum(n, 1.0), 0.0)  # [K]

    def body(acc, x):
      j, ok, lo_s, lo_tail = x
      rec = _take(reservoir, j)
      w = (jnp.take(train, j, axis=1) & ok).astype(jnp.float32)
      (_, per_head), g = jax.value_and_grad(chunk_loss, has_aux=True)(hd, rec, w, lo_s, lo_tail,
                                                                      weight)
      return jax.tree.map(jnp.add, acc, (g, per_head)), None

    zero = (jax.tree.map(jnp.zeros_like, hd), jnp.zeros((hd.num_heads,), jnp.float32))
    return jax.lax.scan(body, zero, chunks)[0]

  def step(i, carry):
    hd, opt, first_loss = carry
    g, loss = grads(hd, i)
    g = jax.vmap(lambda x: clip.update(x, optax.EmptyState())[0])(g)
    upd, new_opt = jax.vmap(tx.update)(g, opt, hd)
    new_hd = optax.apply_updates(hd, upd)
    first_loss = jnp.where(i == 0, loss, first_loss)
    return _select(trained, new_hd, hd), _select(trained, new_opt, opt), first_loss

  nan = jnp.full((heads.num_heads,), jnp.nan, jnp.float32)
  new_heads, new_opt, loss = jax.lax.fori_loop(0, num_steps, step, (heads, opt_state, nan))
  # the "after" evaluation reads only the held-out slots
  after = _forward(cfg, model_config, params, new_heads, reservoir, held, False, trained,
                   slots=held_only)[0]
  keep = keep_rule(cfg, trained, before, after)
  return (_select(keep, new_heads, heads), _select(keep, new_opt, opt_state),
          RefreshResult(trained=trained, keep=keep, before=before, after=after,
                        loss=jnp.where(trained, loss, jnp.nan), n_train=n_train))


refresh_jit = jax.jit(refresh, static_argnums=(0, 1))

# Compiled refresh programs, keyed by static arguments and argument signature, so that
# ``after_batch`` can time compilation apart from the run (see ``refresh_compiles``). Bounded: the
# least recently used program is dropped beyond ``CACHE_SIZE`` (a long job that changes shapes,
# configs or models does not hold every program it ever compiled).
CACHE_SIZE = 8
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_NUM_COMPILES = 0


def refresh_compiles() -> int:
  """How many refresh programs :func:`after_batch` has compiled in this process."""
  return _NUM_COMPILES


def _compiled_refresh(cfg, model_config, args) -> tuple[object, float]:
  global _NUM_COMPILES
  leaves, treedef = jax.tree.flatten(args)
  key = (cfg, model_config, treedef, tuple(
      (x.shape, x.dtype, getattr(x, "sharding", None), getattr(x, "weak_type", False))
      for x in leaves))
  if key in _COMPILED:
    _COMPILED.move_to_end(key)
    return _COMPILED[key], 0.0
  t0 = time.perf_counter()
  _COMPILED[key] = refresh_jit.lower(cfg, model_config, *args).compile()
  _NUM_COMPILES += 1
  while len(_COMPILED) > CACHE_SIZE:
    _COMPILED.popitem(last=False)
  return _COMPILED[key], time.perf_counter() - t0
