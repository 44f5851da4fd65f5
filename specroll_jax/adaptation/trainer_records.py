"""Slow-path records from the trainer's forward of a finished rollout batch, not from the decode
loop (docs/design.md, "Records from the trainer").

Reflex writes a record when a head's prediction matures inside the decode loop: bookkeeping on
every feedback step, paid in rollout time. A GRPO trainer runs one teacher-forced forward of the
policy over every finished rollout anyway (its loss needs the log-probs), and that forward holds
the anchor hidden state of every response token. :func:`from_hidden` turns ``num_anchors``
anchors sampled from it into records of exactly the type and meaning Reflex's are
(``records.Records``): the heads' input at the anchor, the path a root-conditioned head reads
(the committed tokens), the target's sampling distribution at the predicted token on the same
sparse support (``reflex.feedback``: top(q), top(p), the token, the head's candidates), the
committed token, the head's candidates at that depth (its top ``ReflexConfig.topk[k]``: the ones a
ranked tree would hold on that path) and the sparse TV the monitor watches. No correction (the
heads as they are) and no tree: a record exists for every sampled anchor whose predicted token
was committed, whatever the rollout proposed.

One draw gives every head a record of the same predicted token: the draw picks column j (a
committed token j + 1 after it), and head k's record reads the anchor k columns back (j - k,
valid when >= 0), so the target's side (its unembedding, log-normaliser and top ids at token
j + 1) is computed once per draw, not once per head. Each head's anchors are still uniform over
the anchors whose prediction was committed, as with one anchor shared by all heads.

``grpo.TrainStep(..., return_hidden=True)`` hands the hidden states of its own forward out of the
update (the policy before the update: the one that rolled the batch out); ``grpo.trainer_hidden``
computes them for a trainer that cannot. ``adaptation`` takes the records through
``after_trainer`` when ``AdaptationConfig.records == "trainer"``.

Dimensions (besides the legend): n sampled anchors, K heads, Kc candidates, S support ids.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from specroll_jax import _topk
from specroll_jax._fields import int_arg
from specroll_jax.adaptation import records as _records
from specroll_jax.adaptation.reflex.config import ReflexConfig
from specroll_jax.adaptation.reflex.feedback import feedback
from specroll_jax.engines import check_seed
from specroll_jax.heads import kinds as head_kinds
from specroll_jax.models import decoder as _dec
from specroll_jax.models.config import ModelConfig
from specroll_jax.proposers.base import Target
from specroll_jax.sampling import SamplingConfig, allowed_floor, allowed_logits, draft_keys


def sample_anchors(key, lengths: Int[Array, " B"], max_len: int, num_anchors: int):
  """(rows [n], columns [n], found [n] bool): ``num_anchors`` distinct (row, j) pairs drawn
  uniformly from the anchors that predict at least one committed token (j + 1 < length); when
  fewer exist (``num_anchors`` may exceed B x M), every one of them is taken and the rest are
  marked not found (their rows and columns are in range, their records invalid)."""
  b = lengths.shape[0]
  j = jnp.arange(max_len)[None]
  ok = j + 1 < lengths[:, None]  # [B, M]
  score = jnp.where(ok, jax.random.uniform(key, (b, max_len)), -1.0).reshape(-1)
  score = jnp.pad(score, (0, max(0, num_anchors - b * max_len)), constant_values=-1.0)
  top, idx = jax.lax.top_k(score, num_anchors)
  idx = jnp.minimum(idx, b * max_len - 1)
  return (idx // max_len).astype(jnp.int32), (idx % max_len).astype(jnp.int32), top >= 0


def _build(cfg: ReflexConfig, config: ModelConfig, sampling: SamplingConfig, num_anchors: int,
           params, heads, hidden, tokens, lengths, prompt_lengths, key, seed=None,
           sample_ids=None):
  b, m, d = hidden.shape
  k = heads.num_heads
  target = Target(config=config, params=params, sampling=sampling)
  rows, cols, found = sample_anchors(key, lengths, m, num_anchors)
  # one predicted token per draw, shared by every head: token cols + 1 (committed when found);
  # head i reads the anchor i columns back (cols - i), so the target's side of the record (its
  # unembedding, logsumexp and top ids at the token) is computed once for all K heads
  label = jnp.clip(cols + 1, 0, m - 1)  # [n]
  hl = hidden[rows, label].astype(jnp.float32)  # [n, D]
  x = allowed_logits(_dec.logits_from_hidden(config, params, hl), sampling)
  lse = jax.nn.logsumexp(x, axis=-1)
  floor = allowed_floor(x, sampling)
  ids_p = jax.lax.top_k(x, cfg.top)[1]
  token = tokens[rows, label]
  depth = jnp.arange(k)
  anchor = cols[None] - depth[:, None]  # [K, n]
  at = jnp.clip(anchor, 0, m - 1)
  h = hidden[rows[None], at].astype(jnp.float32)  # [K, n, D]
  # the committed path from head i's root (token anchor) on: slots 0..i, predicting cols + 1
  ctx = tokens[rows[None, :, None], jnp.clip(at[..., None] + depth, 0, m - 1)]  # [K, n, K]
  path = jnp.where(depth[None, None] <= depth[:, None, None], ctx, -1)
  z = jnp.stack([head_kinds.output_states(config, params, heads, i, h[i], path[i])
                 for i in range(k)]).astype(jnp.float32)  # [K, n, D]
  q = _dec.logits_from_hidden(config, params, z)
  cmax = cfg.max_candidates
  position = prompt_lengths[rows] + label  # [n]: the predicted token's absolute position
  if seed is None:
    ids_q, cand = _topk.top_ids(q, cfg.top, cmax)  # one top-k over V, two prefixes
  else:  # the tree's candidates coupled to the target's noise at that position
    keys, _ = draft_keys(q, sampling, seed, sample_ids[rows][None], position[None], coupled=True)
    ids_q, cand = _topk.top_ids(q, cfg.top)[0], jax.lax.top_k(keys, cmax)[1]
  cand = jnp.where(jnp.arange(cmax) < jnp.asarray(cfg.topk)[:, None, None], cand, -1)
  every = lambda v: jnp.broadcast_to(v[None], (k,) + v.shape)  # the shared side, per head
  tok_k = every(token)
  mt = feedback(cfg, target, z, ids_q, every(ids_p), tok_k, cand, cand, cand, every(hl),
                every(lse), every(floor))
  valid = found[None] & (anchor >= 0) & jnp.isfinite(mt.tv) & jnp.isfinite(mt.p).all(-1)
  # count: records written per head (what the monitor counts, ``slow_path.batch_stats``)
  return _records.Records(
      hidden=h, support=mt.support, p=mt.p, p_tail=mt.p_tail, token=tok_k, candidates=cand,
      hit=_records.member(tok_k[..., None], cand)[..., 0], tv=mt.tv,
      position=every(position), valid=valid,
      path=path if head_kinds.is_conditioned(heads) else None, correction=jnp.zeros_like(h),
      count=valid.sum(1).astype(jnp.int32))


_build_jit = jax.jit(_build, static_argnums=(0, 1, 2, 3))


def from_hidden(cfg: ReflexConfig, config: ModelConfig, params, heads,
                hidden: Float[Array, "B M D"], tokens: Int[Array, "B M"], lengths: Int[Array, " B"],
                prompt_lengths: Int[Array, " B"], *, sampling: SamplingConfig, key,
                num_anchors: int, seed: int | None = None,
                sample_ids: Int[Array, " B"] | None = None) -> _records.Records:
  """Records [K, num_anchors] from the anchor hidden states of a teacher-forced forward
  (``hidden[b, j]``: the pre-norm hidden state whose logits sample response token j, as
  ``grpo.trainer_hidden`` and ``TrainStep(return_hidden=True)`` give them) of the finished
  responses ``tokens`` (``lengths``, EOS included) after prompts of ``prompt_lengths``, under the
  target ``params`` and the rollout's ``sampling``. ``key`` draws ``num_anchors`` columns j that
  predict a committed token (:func:`sample_anchors`); head k's record at draw (row, j) reads the
  anchor j - k and predicts token j + 1, and is valid when j - k >= 0. The records' shape does
  not depend on the batch: when it holds fewer than ``num_anchors`` anchors, all are taken and the
  remaining records are invalid (``valid`` False, ``count`` counts the valid ones). ``cfg``
  fixes the support and candidate shapes (those of the slow path's reservoir: ``slow_path.init``
  with ``support_size=cfg.support_size, num_candidates=cfg.max_candidates``). With the rollout's
  ``seed`` and its rows' ``sample_ids`` (and ``cfg.coupled``, T > 0) a head's candidates are ranked
  coupled to the target's noise at the predicted position, as the tree ranks them
  (``sampling.draft_keys``); otherwise by the head's probabilities. Jitted; ``cfg``, ``config``,
  ``sampling`` and ``num_anchors`` are static."""
  if not isinstance(cfg, ReflexConfig):
    raise ValueError(f"cfg must be a ReflexConfig, got {type(cfg).__name__}")
  head_kinds.validate(config, heads, cfg.num_heads)
  num_anchors = int_arg(num_anchors, "num_anchors", 1)
  if hidden.ndim != 3 or hidden.shape[-1] != config.hidden_size:
    raise ValueError(f"hidden must be [B, M, D={config.hidden_size}], got shape "
                     f"{tuple(hidden.shape)}")
  b, m = hidden.shape[:2]
  want = {"tokens": (b, m), "lengths": (b,), "prompt_lengths": (b,)}
  for name, arr in (("tokens", tokens), ("lengths", lengths), ("prompt_lengths", prompt_lengths)):
    if tuple(np.shape(arr)) != want[name]:
      raise ValueError(f"{name} has shape {tuple(np.shape(arr))}, expected {want[name]} "
                       f"(hidden is {tuple(hidden.shape)})")
  lens = np.asarray(lengths)
  if lens.size and (lens.min() < 0 or lens.max() > m):
    raise ValueError(f"lengths must lie in [0, M={m}] (the responses' columns), got min "
                     f"{lens.min()}, max {lens.max()}")
  coupled = ()
  if cfg.coupled and not sampling.greedy and seed is not None:
    check_seed(seed)
    if sample_ids is None or tuple(np.shape(sample_ids)) != (b,):
      raise ValueError(f"sample_ids must be given with seed, shape ({b},) (one per row), got "
                       f"{None if sample_ids is None else tuple(np.shape(sample_ids))}")
    coupled = (jnp.uint32(seed), jnp.asarray(sample_ids, jnp.int32))
  return _build_jit(cfg, config, sampling, int(num_anchors), params, heads, jnp.asarray(hidden),
                    jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32),
                    jnp.asarray(prompt_lengths, jnp.int32), key, *coupled)


@functools.partial(jax.jit, static_argnames=("config",))
def _anchor_hidden(params, prompt_tokens, prompt_lengths, tokens, lengths, *, config):
  from specroll_jax.grpo.logprobs import trainer_hidden
  return trainer_hidden(config, params, prompt_tokens, prompt_lengths, tokens, lengths)


def anchor_hidden(config: ModelConfig, params, prompt_tokens, prompt_lengths, tokens,
                  lengths) -> Float[Array, "B M D"]:
  """The anchor hidden states [B, M, D] of the trainer's teacher-forced forward
  (``grpo.trainer_hidden``, jitted here; ``config`` static): what :func:`from_hidden` reads."""
  return _anchor_hidden(params, jnp.asarray(prompt_tokens, jnp.int32),
                        jnp.asarray(prompt_lengths, jnp.int32), jnp.asarray(tokens, jnp.int32),
                        jnp.asarray(lengths, jnp.int32), config=config)


def from_rollout(cfg: ReflexConfig, config: ModelConfig, params, heads, prompt_tokens,
                 prompt_lengths, tokens, lengths, *, sampling: SamplingConfig, key,
                 num_anchors: int) -> _records.Records:
  """:func:`from_hidden` after a teacher-forced forward of its own (``grpo.trainer_hidden``): for
  a trainer that cannot hand out the hidden states of the forward it runs anyway. This forward
  is an extra cost; ``TrainStep(return_hidden=True)`` avoids it."""
  hid = anchor_hidden(config, params, prompt_tokens, prompt_lengths, tokens, lengths)
  return from_hidden(cfg, config, params, heads, hid, tokens, lengths, prompt_lengths,
                     sampling=sampling, key=key, num_anchors=num_anchors)


__all__ = ["anchor_hidden", "from_hidden", "from_rollout", "sample_anchors"]
