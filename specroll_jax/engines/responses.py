"""Response bookkeeping shared by the vanilla and the speculative engine: the prefill that samples
each row's first token, the one commit rule (NaN, EOS and length cuts, then the write into the
[B, M] outputs by global row) and the final padding. One copy, so both engines stop and record
exactly alike."""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from specroll_jax import sampling as _sampling
from specroll_jax.engines.config import DecodeSettings
from specroll_jax.models import decoder as _dec


@flax.struct.dataclass
class Outputs:
  """Per-batch outputs, written by global row."""

  tokens: Int[Array, "B M"]
  logprobs: Float[Array, "B M"]
  hidden: Float[Array, "B M D"] | None  # pre-norm hidden at the anchor of token j (optional)
  lengths: Int[Array, " B"]  # tokens emitted so far
  nonfinite: Bool[Array, " B"]  # the row met NaN/inf logits and stopped


@flax.struct.dataclass
class Start:
  cache: _dec.KVCache  # the prompts' K/V, lengths = prompt lengths
  hidden: Float[Array, "B D"]  # pre-norm hidden at each row's last prompt token
  token: Int[Array, " B"]  # the first response token (already in ``out`` where kept)
  out: Outputs
  n_out: Int[Array, " B"]  # 1, or 0 where the first token was not kept
  done: Bool[Array, " B"]


@flax.struct.dataclass
class Emitted:
  out: Outputs
  keep: Bool[Array, "R J"]  # which of the offered tokens were emitted (a prefix)
  n_out: Int[Array, " R"]
  done: Bool[Array, " R"]  # finished after this step (finished rows stay finished)


def stop_mask(tokens, n_out, eos_ids, max_new: int, avail):
  """Which of a row's new tokens [R, J] (available where avail, a prefix) are emitted, and whether
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
  return out.replace(tokens=put(out.tokens, tokens), logprobs=put(out.logprobs, logprobs),
                     hidden=None if out.hidden is None else put(out.hidden, hidden))


def emit(out: Outputs, rows, n_out, done, tokens, logprobs, hidden, nonfinite, avail, eos_ids,
         max_new: int) -> Emitted:
  """The commit rule of both engines for J candidate tokens per slot [R, J] (available where avail,
  a prefix): a token is emitted unless it comes at or after the first token whose logits were
  non-finite, after an EOS, or past ``max_new``; a row with non-finite logits stops and is flagged.
  Finished slots emit nothing."""
  active = ~done
  avail = avail & active[:, None]
  nf_cum = jnp.cumsum(nonfinite & avail, axis=1) > 0
  keep, stop = stop_mask(tokens, n_out, eos_ids, max_new, avail & ~nf_cum)
  row_nf = (avail & nf_cum).any(1)
  out = append(out, rows, n_out, keep, tokens, logprobs, hidden)
  n_new = n_out + keep.sum(1).astype(jnp.int32)
  out = out.replace(lengths=out.lengths.at[rows].set(jnp.where(active, n_new, out.lengths[rows])),
                    nonfinite=out.nonfinite.at[rows].max(row_nf))
  return Emitted(out=out, keep=keep, n_out=n_new, done=done | (active & (stop | row_nf)))


def start(config, params, tokens, lengths, sample_ids, eos_ids, seed,
          settings: DecodeSettings) -> Start:
  """Prefill the prompts into a fresh cache and sample (and record) each row's first token."""
  b = tokens.shape[0]
  m = settings.max_new_tokens
  cache = _dec.init_cache(config, b, settings.cache_length)
  cache, _, hidden = _dec.prefill(config, params, tokens, lengths, cache, kernels=settings.kernels)
  tok, lp, nf = _sampling.sample_from_hidden(config, params, hidden, seed, sample_ids, lengths,
                                             settings.sampling, settings.kernels)
  out = Outputs(tokens=jnp.zeros((b, m), jnp.int32), logprobs=jnp.zeros((b, m), jnp.float32),
                hidden=(jnp.zeros((b, m, config.hidden_size), hidden.dtype)
                        if settings.return_hidden else None),
                lengths=jnp.zeros((b,), jnp.int32), nonfinite=jnp.zeros((b,), bool))
  em = emit(out, jnp.arange(b), jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), tok[:, None],
            lp[:, None], hidden[:, None], nf[:, None], jnp.ones((b, 1), bool), eos_ids, m)
  return Start(cache=cache, hidden=hidden, token=tok, out=em.out, n_out=em.n_out, done=em.done)


def finish(out: Outputs, pad_id: int):
  """(tokens with pad_id after each row's end, logprobs with 0 there)."""
  live = jnp.arange(out.tokens.shape[1])[None, :] < out.lengths[:, None]
  return jnp.where(live, out.tokens, pad_id), jnp.where(live, out.logprobs, 0.0)
