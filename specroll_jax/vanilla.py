"""The vanilla engine: batched prefill, then one decode step per token in a ``lax.while_loop``.

``vanilla_rollout`` is traceable on device arrays: call it inside your own ``jax.jit`` or
``jax.shard_map`` (``rollout.generate`` validates host inputs and calls its jitted form). Finished
rows stay in the batch; it is the baseline the speculative engine is measured against.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from specroll_jax import responses as _resp
from specroll_jax import sampling as _sampling
from specroll_jax._vma import vary_like
from specroll_jax.config import DecodeSettings
from specroll_jax.models import decoder as _dec
from specroll_jax.results import Rollout, RolloutStats


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
class _State:
  cache: _dec.KVCache
  last: Int[Array, " B"]  # last emitted token (fed to the next step)
  n_out: Int[Array, " B"]
  done: Bool[Array, " B"]
  out: _resp.Outputs
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
  rows = jnp.arange(b)
  m = settings.max_new_tokens
  params = _dec.unstack_layers(params)  # per-layer slices taken once, outside the loop
  st = _resp.start(config, params, prompt_tokens, prompt_lengths, sample_ids, eos_ids, seed,
                   settings)
  state = _State(cache=st.cache, last=st.token, n_out=st.n_out, done=st.done, out=st.out,
                 forwards=jnp.int32(0), row_forwards=jnp.int32(b))
  state = vary_like(state, params, prompt_tokens, prompt_lengths, sample_ids, eos_ids, seed)

  def body(s: _State) -> _State:
    active = ~s.done
    hidden, cache, tok, lp, nf = decode_step(config, params, s.last, s.cache, active, seed,
                                             sample_ids, settings)
    em = _resp.emit(s.out, rows, s.n_out, s.done, tok[:, None], lp[:, None], hidden[:, None],
                    nf[:, None], jnp.ones((b, 1), bool), eos_ids, m)
    return s.replace(cache=cache, last=jnp.where(active, tok, s.last), n_out=em.n_out,
                     done=em.done, out=em.out, forwards=s.forwards + 1,
                     row_forwards=s.row_forwards + active.sum().astype(jnp.int32))

  s = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  tokens, logprobs = _resp.finish(s.out, settings.pad_id)
  stats = RolloutStats(target_forwards=s.forwards, row_forwards=s.row_forwards,
                       tokens=s.out.lengths.sum(), nonfinite=s.out.nonfinite)
  return Rollout(tokens=tokens, lengths=s.out.lengths, logprobs=logprobs, stats=stats,
                 hidden=s.out.hidden)
