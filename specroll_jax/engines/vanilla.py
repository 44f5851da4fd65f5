"""The vanilla engine: batched prefill, then one decode step per token in a ``lax.while_loop``
per concurrency bucket.

Like a serving engine, it frees finished rows: the batch runs through the row buckets of
``DecodeSettings.bucket_fractions`` (``buckets.py``), and once no more rows are active than the
next bucket holds, the live rows (KV cache included) are compacted into it, in-graph. Outputs are
written by global row and the noise of every token is a function of (seed, sample id, position,
token), so compaction never changes a token; ``bucket_fractions=(1.0,)`` keeps every row until the
longest response ends (the engine before compaction). It is the baseline every speculative figure
is measured against.

``vanilla_rollout`` is traceable on device arrays: call it inside your own ``jax.jit`` or
``jax.shard_map`` (``rollout.generate`` validates host inputs and calls its jitted form).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from specroll_jax import sampling as _sampling
from specroll_jax._vma import vary_like
from specroll_jax.engines import buckets as _buckets
from specroll_jax.engines import responses as _resp
from specroll_jax.engines.config import DecodeSettings
from specroll_jax.engines.results import Rollout, RolloutStats
from specroll_jax.models import decoder as _dec


def decode_step(config, params, root, cache: _dec.KVCache, active, seed, sample_ids,
                settings: DecodeSettings):
  """One token for every active row: the root (at position L = cache.lengths, not yet cached) is
  appended to the cache in place and the next token (position L + 1) is sampled from its hidden
  state. Returns (hidden [R, D], cache with lengths advanced where active, token, logprob,
  nonfinite) for every row."""
  pos = cache.lengths
  hidden, cache = _dec.append_step(config, params, root[:, None], cache,
                                   jnp.where(active, pos, -1)[:, None], kernels=settings.kernels)
  cache = cache.replace(lengths=pos + active.astype(jnp.int32))
  tok, lp, nf = _sampling.sample_from_hidden(config, params, hidden[:, 0], seed, sample_ids,
                                             pos + 1, settings.sampling, settings.kernels)
  return hidden[:, 0], cache, tok, lp, nf


@flax.struct.dataclass
class _Slots:
  """Per-slot state (every leaf [R, ...]; compacted with its row)."""

  cache: _dec.KVCache
  last: Int[Array, " R"]  # last emitted token (fed to the next step)
  row: Int[Array, " R"]  # global row of the slot
  sample_ids: Int[Array, " R"]
  n_out: Int[Array, " R"]
  done: Bool[Array, " R"]


@flax.struct.dataclass
class _State:
  slots: _Slots
  out: _resp.Outputs  # [B, ...], by global row
  forwards: Int[Array, ""]
  row_forwards: Int[Array, ""]


def vanilla_rollout(config, params, prompt_tokens, prompt_lengths, sample_ids, eos_ids, seed, *,
                    settings: DecodeSettings) -> Rollout:
  """Sample one response per row with plain decoding. Traceable (no host work).

  prompt_tokens [B, P] int32 right-padded, prompt_lengths [B] (>= 1), sample_ids [B] (noise
  coordinates), eos_ids [E] (-1 entries never match), seed: uint32 scalar. ``config`` and
  ``settings`` are static. The caller guarantees P + max_new_tokens <= settings.cache_length.
  """
  b = prompt_tokens.shape[0]
  m = settings.max_new_tokens
  params = _dec.unstack_layers(params)  # per-layer slices taken once, outside the loops
  st = _resp.start(config, params, prompt_tokens, prompt_lengths, sample_ids, eos_ids, seed,
                   settings)
  slots = _Slots(cache=st.cache, last=st.token, row=jnp.arange(b, dtype=jnp.int32),
                 sample_ids=sample_ids, n_out=st.n_out, done=st.done)
  state = _State(slots=slots, out=st.out, forwards=jnp.int32(0), row_forwards=jnp.int32(b))
  state = vary_like(state, params, prompt_tokens, prompt_lengths, sample_ids, eos_ids, seed)

  def body(s: _State) -> _State:
    sl = s.slots
    active = ~sl.done
    hidden, cache, tok, lp, nf = decode_step(config, params, sl.last, sl.cache, active, seed,
                                             sl.sample_ids, settings)
    em = _resp.emit(s.out, sl.row, sl.n_out, sl.done, tok[:, None], lp[:, None], hidden[:, None],
                    nf[:, None], jnp.ones_like(active)[:, None], eos_ids, m)
    slots = sl.replace(cache=cache, last=jnp.where(active, tok, sl.last), n_out=em.n_out,
                       done=em.done)
    return s.replace(slots=slots, out=em.out, forwards=s.forwards + 1,
                     row_forwards=s.row_forwards + active.sum().astype(jnp.int32))

  rows = _buckets.bucket_rows(b, settings.bucket_fractions)
  for i, r in enumerate(rows):
    if r < state.slots.row.shape[0]:
      state = state.replace(slots=_buckets.compact(state.slots, state.slots.done, r))
    floor = _buckets.exit_rows(rows, i)

    def cond(s: _State, floor=floor):
      n_active = jnp.sum(~s.slots.done)
      return (n_active > 0) & (n_active > floor)

    state = jax.lax.while_loop(cond, body, state)
  tokens, logprobs = _resp.finish(state.out, settings.pad_id)
  stats = RolloutStats(target_forwards=state.forwards, row_forwards=state.row_forwards,
                       tokens=state.out.lengths.sum(), nonfinite=state.out.nonfinite)
  return Rollout(tokens=tokens, lengths=state.out.lengths, logprobs=logprobs, stats=stats,
                 hidden=state.out.hidden)
