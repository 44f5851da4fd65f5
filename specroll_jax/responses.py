"""Response bookkeeping shared by the vanilla and speculative engines: the EOS / length cut,
appending committed tokens to the [B, M] outputs, and the prefill that samples each row's first
response token. One copy, so both engines stop and record exactly alike."""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from specroll_jax import sampling as _sampling
from specroll_jax.models import decoder as _dec


@flax.struct.dataclass
class Outputs:
  tokens: Int[Array, "B M"]
  logprobs: Float[Array, "B M"]
  hidden: Float[Array, "B M D"] | None  # pre-norm hidden at the anchor of token j (optional)


@flax.struct.dataclass
class Start:
  cache: _dec.KVCache  # the prompts' K/V, lengths = prompt lengths
  hidden: Float[Array, "B D"]  # pre-norm hidden at each row's last prompt token
  token: Int[Array, " B"]  # the first response token (already in ``out`` where kept)
  out: Outputs
  n_out: Int[Array, " B"]  # 1, or 0 where the first token was not kept
  done: Bool[Array, " B"]
  nonfinite: Bool[Array, " B"]


def stop_mask(tokens, n_out, eos_ids, max_new: int, avail):
  """Which of a row's new tokens [B, J] (available where avail, a prefix) are emitted, and whether
  the row is done after them: cut after the first EOS and at ``max_new`` tokens, as vanilla does."""
  j = tokens.shape[1]
  is_eos = (tokens[..., None] == eos_ids).any(-1)
  eos_before = jnp.cumsum(is_eos, axis=1) - is_eos  # EOS strictly before j
  keep = avail & (eos_before == 0) & (n_out[:, None] + jnp.arange(j)[None] < max_new)
  n_new = n_out + keep.sum(1)
  done = (keep & is_eos).any(1) | (n_new >= max_new)
  return keep, done


def append(out: Outputs, rows: Int[Array, " R"], n_out: Int[Array, " R"], keep: Bool[Array, "R J"],
           tokens, logprobs, hidden=None) -> Outputs:
  """Write token j of slot r at out[rows[r], n_out[r] + j] where keep[r, j] (a prefix of j).
  ``hidden`` [R, J, D] is written only when ``out`` records hidden states."""
  r, j = keep.shape
  slots = jnp.where(keep, n_out[:, None] + jnp.arange(j)[None], out.tokens.shape[1])
  rr = jnp.broadcast_to(rows[:, None], (r, j))
  put = lambda buf, v: buf.at[rr, slots].set(v.astype(buf.dtype), mode="drop")
  return Outputs(tokens=put(out.tokens, tokens), logprobs=put(out.logprobs, logprobs),
                 hidden=None if out.hidden is None else put(out.hidden, hidden))


def start(config, params, tokens, lengths, sample_ids, eos_ids, seed, *, sampling, max_new: int,
          cache_length: int, attn_impl: str, return_hidden: bool) -> Start:
  """Prefill the prompts into a fresh cache and sample (and record) each row's first token."""
  b = tokens.shape[0]
  cache = _dec.init_cache(config, b, cache_length)
  cache, _, hidden = _dec.prefill(config, params, tokens, lengths, cache, attn_impl=attn_impl)
  tok, lp, nf = _sampling.sample_from_hidden(config, params, hidden, seed, sample_ids, lengths,
                                             sampling, impl=attn_impl)
  out = Outputs(tokens=jnp.zeros((b, max_new), jnp.int32),
                logprobs=jnp.zeros((b, max_new), jnp.float32),
                hidden=(jnp.zeros((b, max_new, config.hidden_size), hidden.dtype)
                        if return_hidden else None))
  n0 = jnp.zeros((b,), jnp.int32)
  keep, done = stop_mask(tok[:, None], n0, eos_ids, max_new, ~nf[:, None])
  out = append(out, jnp.arange(b), n0, keep, tok[:, None], lp[:, None], hidden[:, None])
  return Start(cache=cache, hidden=hidden, token=tok, out=out,
               n_out=keep.sum(1).astype(jnp.int32), done=done | nf, nonfinite=nf)
