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

from specroll_jax import _topk, head_kinds
from specroll_jax import records as _records
from specroll_jax.models import decoder as _dec
from specroll_jax.models.config import ModelConfig
from specroll_jax.proposers.base import Target
from specroll_jax.reflex.config import ReflexConfig
from specroll_jax.reflex.feedback import feedback
from specroll_jax.sampling import SamplingConfig, allowed_logits


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
           params, heads, hidden, tokens, lengths, prompt_lengths, key):
  b, m, d = hidden.shape
  k = heads.num_heads
  target = Target(config=config, params=params, sampling=sampling)
  rows, cols, found = sample_anchors(key, lengths, m, num_anchors)
  h = hidden[rows, cols].astype(jnp.float32)  # [n, D]
  # the committed path from the root (token j) on: head i reads slots 0..i, predicts j + i + 1
  at = jnp.clip(cols[:, None] + jnp.arange(k + 1)[None], 0, m - 1)  # [n, K + 1]
  toks = tokens[rows[:, None], at]
  cmax = cfg.max_candidates
  out = {f: [] for f in ("hidden", "support", "p", "p_tail", "token", "candidates", "hit", "tv",
                         "position", "valid", "path")}
  for i in range(k):
    path = jnp.where(jnp.arange(k)[None] <= i, toks[:, :k], -1)  # [n, K]
    z = head_kinds.output_states(config, params, heads, i, h, path).astype(jnp.float32)
    q = _dec.logits_from_hidden(config, params, z)
    ids_q, cand = _topk.top_ids(q, cfg.top, cmax)  # one top-k over V, two prefixes
    cand = jnp.where(jnp.arange(cmax)[None] < cfg.topk[i], cand, -1)
    label = jnp.clip(cols + i + 1, 0, m - 1)
    hl = hidden[rows, label].astype(jnp.float32)
    x = allowed_logits(_dec.logits_from_hidden(config, params, hl), sampling)
    lse = jax.nn.logsumexp(x, axis=-1)
    ids_p = jax.lax.top_k(x, cfg.top)[1]
    token = toks[:, i + 1]
    mt = feedback(cfg, target, z, ids_q, ids_p, token, cand, cand, cand, hl, lse)
    valid = found & (cols + i + 1 < lengths[rows])
    out["hidden"].append(h)
    out["support"].append(mt.support)
    out["p"].append(mt.p)
    out["p_tail"].append(mt.p_tail)
    out["token"].append(token)
    out["candidates"].append(cand)
    out["hit"].append(_records.member(token[:, None], cand)[:, 0])
    out["tv"].append(mt.tv)
    out["position"].append(prompt_lengths[rows] + cols + i + 1)
    out["valid"].append(valid & jnp.isfinite(mt.tv) & jnp.isfinite(mt.p).all(-1))
    out["path"].append(path)
  st = {f: jnp.stack(v) for f, v in out.items()}  # [K, n, ...]
  if not head_kinds.is_conditioned(heads):
    st["path"] = None
  # count: records written per head (what the monitor counts, ``slow_path.batch_stats``)
  return _records.Records(**st, correction=jnp.zeros_like(st["hidden"]),
                          count=st["valid"].sum(1).astype(jnp.int32))


_build_jit = jax.jit(_build, static_argnums=(0, 1, 2, 3))


def from_hidden(cfg: ReflexConfig, config: ModelConfig, params, heads,
                hidden: Float[Array, "B M D"], tokens: Int[Array, "B M"], lengths: Int[Array, " B"],
                prompt_lengths: Int[Array, " B"], *, sampling: SamplingConfig, key,
                num_anchors: int) -> _records.Records:
  """Records [K, num_anchors] from the anchor hidden states of a teacher-forced forward
  (``hidden[b, j]``: the pre-norm hidden state whose logits sample response token j, as
  ``grpo.trainer_hidden`` and ``TrainStep(return_hidden=True)`` give them) of the finished
  responses ``tokens`` (``lengths``, EOS included) after prompts of ``prompt_lengths``, under the
  target ``params`` and the rollout's ``sampling``. ``key`` draws the anchors; head k's record at
  an anchor is valid when its predicted token was committed. The records' shape does not depend
  on the batch: when it holds fewer than ``num_anchors`` anchors, all are taken and the remaining
  records are invalid (``valid`` False, ``count`` counts the valid ones). ``cfg`` fixes the
  support and candidate shapes (those of the slow path's reservoir: ``slow_path.init`` with
  ``support_size=cfg.support_size, num_candidates=cfg.max_candidates``). Jitted; ``cfg``,
  ``config``, ``sampling`` and ``num_anchors`` are static."""
  if not isinstance(cfg, ReflexConfig):
    raise ValueError(f"cfg must be a ReflexConfig, got {type(cfg).__name__}")
  head_kinds.validate(config, heads, cfg.num_heads)
  if isinstance(num_anchors, bool) or not isinstance(num_anchors, int | np.integer) \
      or num_anchors < 1:
    raise ValueError(f"num_anchors must be an int >= 1, got {num_anchors!r}")
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
  return _build_jit(cfg, config, sampling, int(num_anchors), params, heads, jnp.asarray(hidden),
                    jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32),
                    jnp.asarray(prompt_lengths, jnp.int32), key)


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
