"""The trainer's logprobs of rollout tokens: the rollout's decoder and ``SamplingConfig``, teacher
forced (docs/design.md, "No rollout/trainer mismatch").

Each row's sequence is its prompt followed by its response, contiguous, at absolute positions
0 .. prompt_length + length - 1 (exactly where the rollout placed them); one causal forward with a
validity mask gives the pre-norm hidden state at the anchor of every response token (position
prompt_length + j - 1 for token j), and ``sampling.token_logprobs`` scores the token under the
same tempered, top-k/top-p restricted distribution the rollout sampled from.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from specroll_jax import sampling as _sampling
from specroll_jax.grpo.loss import response_mask
from specroll_jax.kernels import REFERENCE, Kernels
from specroll_jax.models import decoder as _dec
from specroll_jax.models.config import ModelConfig
from specroll_jax.sampling import SamplingConfig


@flax.struct.dataclass
class TokenScores:
  logprobs: Float[Array, "B M"]  # log pi(token_j | prefix) under the sampling rule; 0 past length
  entropy: Float[Array, "B M"]  # entropy of that distribution at each anchor; 0 past length
  # with return_hidden: the pre-norm hidden state at the anchor of every response token
  # (stop-gradient; what the slow path's records read, ``trainer_records``)
  hidden: Float[Array, "B M D"] | None = None


def sequences(prompt_tokens: Int[Array, "B P"], prompt_lengths: Int[Array, " B"],
              tokens: Int[Array, "B M"], lengths: Int[Array, " B"]):
  """(sequence tokens [B, P+M], positions [B, P+M], causal validity mask [B, P+M, P+M],
  anchors [B, M]): prompt then response contiguous, 0 past the end; anchor j = prompt_length + j - 1
  is the position whose logits sample response token j."""
  b, p = prompt_tokens.shape
  m = tokens.shape[1]
  j = jnp.broadcast_to(jnp.arange(p + m, dtype=jnp.int32)[None], (b, p + m))
  plen = prompt_lengths.astype(jnp.int32)[:, None]
  from_prompt = jnp.take_along_axis(prompt_tokens, jnp.clip(j, 0, p - 1), axis=1)
  from_resp = jnp.take_along_axis(tokens, jnp.clip(j - plen, 0, m - 1), axis=1)
  valid = j < plen + lengths.astype(jnp.int32)[:, None]
  seq = jnp.where(valid, jnp.where(j < plen, from_prompt, from_resp), 0).astype(jnp.int32)
  mask = jnp.tril(jnp.ones((p + m, p + m), bool))[None] & valid[:, None, :]
  anchors = plen - 1 + jnp.arange(m, dtype=jnp.int32)[None]
  return seq, j, mask, anchors


def trainer_hidden(config: ModelConfig, params, prompt_tokens: Int[Array, "B P"],
                   prompt_lengths: Int[Array, " B"], tokens: Int[Array, "B M"],
                   lengths: Int[Array, " B"], *, kernels: Kernels = REFERENCE
                   ) -> Float[Array, "B M D"]:
  """The pre-norm hidden state at the anchor of every response token (hidden[b, j]: the state
  whose logits sample token j), from one causal forward of prompt + response. Traceable."""
  seq, pos, mask, anchors = sequences(prompt_tokens, prompt_lengths, tokens, lengths)
  out = _dec.step(config, params, seq, pos, None, mask, kernels=kernels, compute_logits=False)
  return jnp.take_along_axis(out.hidden, anchors[..., None], axis=1)


def trainer_logprobs(config: ModelConfig, params, prompt_tokens: Int[Array, "B P"],
                     prompt_lengths: Int[Array, " B"], tokens: Int[Array, "B M"],
                     lengths: Int[Array, " B"], sampling: SamplingConfig, *,
                     kernels: Kernels = REFERENCE, return_hidden: bool = False) -> TokenScores:
  """Teacher-forced logprobs (and entropies) of response ``tokens`` under ``params``. Traceable and
  differentiable in ``params`` (with the default jnp attention). prompt_tokens right-padded,
  prompt_lengths >= 1; positions past ``lengths`` give 0. ``config``, ``sampling``, ``kernels``
  and ``return_hidden`` (also return the anchor hidden states, stop-gradient) are static."""
  hidden_BxMxD = trainer_hidden(config, params, prompt_tokens, prompt_lengths, tokens, lengths,
                                kernels=kernels)
  logits_BxMxV = _dec.logits_from_hidden(config, params, hidden_BxMxD)
  live = response_mask(lengths, tokens.shape[1])
  lp = _sampling.token_logprobs(logits_BxMxV, tokens, sampling)
  x = jax.lax.stop_gradient(_sampling.allowed_logits(logits_BxMxV, sampling))
  logp_all = jax.nn.log_softmax(x, axis=-1)
  ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return TokenScores(logprobs=jnp.where(live, lp, 0.0), entropy=jnp.where(live, ent, 0.0),
                     hidden=jax.lax.stop_gradient(hidden_BxMxD) if return_hidden else None)
