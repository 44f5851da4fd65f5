"""Public rollout entry: vanilla and speculative (SpecRoll) generation with one sampling rule.

``generate(config, params, prompts, sampling=..., max_new_tokens=..., seed=...)`` runs the vanilla
engine: batched prefill, then the whole decode in one jitted ``lax.while_loop``. With
``spec=SpecConfig(...)`` and ``heads=...`` it runs the speculative engine (``speculative.py``),
which
returns the same tokens: both sample position t of response ``sample_id`` with the counter-based
noise
u(seed, sample_id, t, v) (``sampling.py``), so the speculative rollout is the target's own sample.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from specroll_jax import sampling as _sampling
from specroll_jax.models import decoder as _dec
from specroll_jax.models.config import ModelConfig
from specroll_jax.responses import Outputs, append, start, stop_mask
from specroll_jax.sampling import SamplingConfig

__all__ = ["Rollout", "RolloutStats", "SamplingConfig", "SpecConfig", "generate",
           "PreparedBatch", "prepare_batch"]

_PROMPT_BUCKET = 16  # pad prompt length up to a multiple of this (fewer recompiles)


@flax.struct.dataclass
class RolloutStats:
  target_forwards: Int[Array, ""]  # decode / verify forwards after prefill (batch steps)
  row_forwards: Int[Array, ""]  # sum over those forwards of rows still active
  tokens: Int[Array, ""]  # committed response tokens in all rows
  nonfinite: Bool[Array, " B"]  # row stopped because its logits held NaN/inf
  head_proposed: Int[Array, " K"]  # row-steps whose tree reached depth k (speculative only)
  head_accepted: Int[Array, " K"]  # row-steps whose accepted path reached depth k
  nodes_verified: Int[Array, ""]  # tree nodes (root excluded) verified in all row-steps
  active_trace: Int[Array, " F"] | None = None  # active rows at each verify forward (speculative)
  bucket_times: tuple = flax.struct.field(pytree_node=False, default=())  # (rows, N, steps, s)

  @property
  def tokens_per_forward(self) -> float:
    """tau: committed tokens per row-forward (1.0 for vanilla)."""
    return float(self.tokens) / max(int(self.row_forwards), 1)

  @property
  def head_acceptance(self) -> np.ndarray:
    p = np.asarray(self.head_proposed, np.float64)
    return np.asarray(self.head_accepted, np.float64) / np.maximum(p, 1)


@flax.struct.dataclass
class Rollout:
  tokens: Int[Array, "B M"]  # response tokens; pad_id after each row's end
  lengths: Int[Array, " B"]  # response length (an EOS, when sampled, is included)
  logprobs: Float[Array, "B M"]  # logprob of each token under the sampling distribution, 0 after
  stats: RolloutStats
  hidden: Float[Array, "B M D"] | None = None  # pre-norm hidden at the anchor before token j


@dataclasses.dataclass(frozen=True)
class SpecConfig:
  """Speculative decoding settings (DESIGN.md, "One speculative step" and the concurrency budget).

  node_budget: global number of tree nodes (root excluded) per verify forward, shared by active
  rows.
  max_nodes: per-row cap N_max. Per-row N = min(max_nodes, node_budget // rows in the bucket).
  topk: candidates per depth (one entry per head, len == num_heads).
  bucket_rows: row counts of the compiled buckets as fractions of the batch, descending (1.0 first);
    rows move to the next bucket (compacted, cache included) when few enough remain active.
  """

  num_heads: int = 3
  node_budget: int = 64
  max_nodes: int = 16
  topk: tuple[int, ...] = (4, 3, 2)
  bucket_fractions: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125)

  def __post_init__(self):
    if not isinstance(self.num_heads, int) or self.num_heads < 1:
      raise ValueError(f"SpecConfig.num_heads must be an int >= 1, got {self.num_heads!r}")
    if not isinstance(self.node_budget, int) or self.node_budget < 0:
      raise ValueError(f"SpecConfig.node_budget must be an int >= 0, got {self.node_budget!r}")
    if not isinstance(self.max_nodes, int) or self.max_nodes < 0:
      raise ValueError(f"SpecConfig.max_nodes must be an int >= 0, got {self.max_nodes!r}")
    topk = tuple(self.topk)
    if len(topk) < self.num_heads:
      raise ValueError(
          f"SpecConfig.topk has {len(topk)} entries {topk}, fewer than num_heads={self.num_heads}")
    if any((not isinstance(k, int)) or k < 1 for k in topk):
      raise ValueError(f"SpecConfig.topk entries must be ints >= 1, got {topk}")
    object.__setattr__(self, "topk", topk[: self.num_heads])
    fr = tuple(self.bucket_fractions)
    if not fr or fr[0] != 1.0 or any(not (0 < b <= 1) for b in fr) or list(fr) != sorted(fr)[::-1]:
      raise ValueError(
          f"SpecConfig.bucket_fractions must start at 1.0 and descend within (0, 1], got {fr}")
    if self.max_nodes > self.tree_capacity:
      object.__setattr__(self, "max_nodes", self.tree_capacity)

  @property
  def tree_capacity(self) -> int:
    """Nodes of the full candidate tree (product of per-depth top-k)."""
    total, width = 0, 1
    for k in self.topk:
      width *= k
      total += width
    return total

  @classmethod
  def for_cpu(cls) -> SpecConfig:
    """CPU: a verify forward's cost grows quickly with tokens; keep ~64 tree nodes per forward."""
    return cls()

  @classmethod
  def for_h200(cls) -> SpecConfig:
    """H200 bf16: verify stays memory-bound up to ~200 tokens per forward (DESIGN.md)."""
    return cls(node_budget=192, max_nodes=12, topk=(4, 3, 2))

  def bucket_shapes(self, batch: int) -> list[tuple[int, int]]:
    """Static (rows, N) buckets for a batch: rows descending, N = min(max_nodes, budget // rows)."""
    shapes = []
    for f in self.bucket_fractions:
      rows = max(1, int(np.ceil(batch * f)))
      if shapes and rows >= shapes[-1][0]:
        continue
      shapes.append((rows, min(self.max_nodes, self.node_budget // rows)))
    return shapes


# ---------------------------------------------------------------------------------------------
# Input preparation and validation (before tracing)


@dataclasses.dataclass(frozen=True)
class PreparedBatch:
  tokens: np.ndarray  # [B, P] int32, right-padded
  lengths: np.ndarray  # [B] int32
  sample_ids: np.ndarray  # [B] int32
  eos_ids: np.ndarray  # [E] int32 (padded with -1)
  cache_length: int


def prepare_batch(config: ModelConfig, prompts, *, max_new_tokens: int, prompt_lengths=None,
                  sample_ids=None, eos_ids=None, cache_length: int | None = None) -> PreparedBatch:
  """Validate and pad a batch of prompts. Raises ValueError naming the argument, value and limit."""
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
    raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
  if isinstance(prompts, (np.ndarray, jax.Array)):
    arr = np.asarray(prompts)
    if arr.ndim != 2:
      raise ValueError(f"prompts as an array must be 2-D [B, P], got shape {arr.shape}")
    if prompt_lengths is None:
      lens = np.full((arr.shape[0],), arr.shape[1], np.int64)
    else:
      lens = np.asarray(prompt_lengths).astype(np.int64)
      if lens.shape != (arr.shape[0],):
        raise ValueError(
            f"prompt_lengths must have shape ({arr.shape[0]},), got {lens.shape}")
      if (lens > arr.shape[1]).any():
        raise ValueError(
            f"prompt_lengths {lens.max()} exceeds the padded prompt width {arr.shape[1]}")
    rows = [arr[i, : lens[i]].tolist() for i in range(arr.shape[0])]
  elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
    if prompt_lengths is not None:
      raise ValueError("prompt_lengths is only for a padded prompt array, got a list of prompts")
    rows = [list(p) for p in prompts]
  else:
    raise ValueError(
        f"prompts must be a list of token-id lists or a 2-D array, got {type(prompts)}")
  if not rows:
    raise ValueError("prompts is empty (batch of 0 prompts)")
  for i, r in enumerate(rows):
    if len(r) == 0:
      raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
    bad = [t for t in r if not (0 <= int(t) < config.vocab_size)]
    if bad:
      raise ValueError(
          f"prompts[{i}] holds token id {bad[0]} outside [0, vocab_size={config.vocab_size})")
  b = len(rows)
  lens = np.array([len(r) for r in rows], np.int32)
  need = int(lens.max()) + int(max_new_tokens)
  if cache_length is None:
    cache_length = need
  if need > cache_length:
    raise ValueError(
        f"prompt length {int(lens.max())} + max_new_tokens {max_new_tokens} = {need} exceeds "
        f"cache_length {cache_length}")
  if cache_length > config.max_position_embeddings:
    raise ValueError(
        f"prompt length {int(lens.max())} + max_new_tokens {max_new_tokens} = {cache_length} "
        f"exceeds the model's max_position_embeddings {config.max_position_embeddings}")
  width = int(-(-lens.max() // _PROMPT_BUCKET) * _PROMPT_BUCKET)
  toks = np.zeros((b, width), np.int32)
  for i, r in enumerate(rows):
    toks[i, : len(r)] = r
  if sample_ids is None:
    sids = np.arange(b, dtype=np.int32)
  else:
    sids = np.asarray(sample_ids)
    if sids.shape != (b,):
      raise ValueError(f"sample_ids must have shape ({b},), got {sids.shape}")
    if sids.min() < 0 or sids.max() >= 2**31:
      raise ValueError(f"sample_ids must be in [0, 2**31), got range [{sids.min()}, {sids.max()}]")
    sids = sids.astype(np.int32)
  if eos_ids is None:
    eos_ids = config.eos_token_ids
  eos = np.asarray(list(eos_ids) or [-1], np.int64)
  if ((eos >= config.vocab_size) | (eos < -1)).any():
    raise ValueError(f"eos_ids {list(eos_ids)} must lie in [0, vocab_size={config.vocab_size})")
  return PreparedBatch(toks, lens, sids, eos.astype(np.int32), int(cache_length))


def _check_seed(seed):
  if not isinstance(seed, (int, np.integer)) or not (0 <= int(seed) < 2**32):
    raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")


# ---------------------------------------------------------------------------------------------
# Vanilla engine


@flax.struct.dataclass
class _VanillaState:
  cache: _dec.KVCache
  last: Int[Array, " B"]  # last emitted token (fed to the next step)
  out: Outputs
  n_out: Int[Array, " B"]
  done: Bool[Array, " B"]
  nonfinite: Bool[Array, " B"]
  forwards: Int[Array, ""]
  row_forwards: Int[Array, ""]


@functools.partial(jax.jit, static_argnames=("config", "sampling", "max_new", "cache_length",
                                             "attn_impl", "return_hidden"))
def _vanilla(config, params, tokens, lengths, sample_ids, eos_ids, seed, *, sampling, max_new,
             cache_length, attn_impl, return_hidden):
  b = tokens.shape[0]
  rows = jnp.arange(b)
  params = _dec.unstack_layers(params)  # per-layer slices taken once, outside the loop
  st = start(config, params, tokens, lengths, sample_ids, eos_ids, seed, sampling=sampling,
             max_new=max_new, cache_length=cache_length, attn_impl=attn_impl,
             return_hidden=return_hidden)
  state = _VanillaState(cache=st.cache, last=st.token, out=st.out, n_out=st.n_out, done=st.done,
                        nonfinite=st.nonfinite, forwards=jnp.int32(0), row_forwards=jnp.int32(b))

  def body(s: _VanillaState) -> _VanillaState:
    pos = s.cache.lengths  # position of s.last
    active = ~s.done
    hidden, cache = _dec.append_step(config, params, s.last[:, None], s.cache,
                                     jnp.where(active, pos, -1)[:, None], attn_impl=attn_impl)
    cache = cache.replace(lengths=pos + active.astype(jnp.int32))
    tok, lp, nf = _sampling.sample_from_hidden(config, params, hidden[:, 0], seed, sample_ids,
                                               pos + 1, sampling, impl=attn_impl)
    nf = nf & active
    keep, done = stop_mask(tok[:, None], s.n_out, eos_ids, max_new, (active & ~nf)[:, None])
    out = append(s.out, rows, s.n_out, keep, tok[:, None], lp[:, None], hidden)
    return s.replace(cache=cache, last=jnp.where(active, tok, s.last), out=out,
                     n_out=s.n_out + keep.sum(1).astype(jnp.int32),
                     done=s.done | done | nf, nonfinite=s.nonfinite | nf,
                     forwards=s.forwards + 1, row_forwards=s.row_forwards + active.sum())

  s = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
  return s.out.tokens, s.out.logprobs, s.out.hidden, s.n_out, s.nonfinite, s.forwards, \
      s.row_forwards


def _finish(out_tokens, out_logprobs, n_out, pad_id):
  m = out_tokens.shape[1]
  live = jnp.arange(m)[None, :] < n_out[:, None]
  return jnp.where(live, out_tokens, pad_id), jnp.where(live, out_logprobs, 0.0)


_DEFAULT_SAMPLING = SamplingConfig()


def generate(config: ModelConfig, params, prompts, *, sampling: SamplingConfig = _DEFAULT_SAMPLING,
             max_new_tokens: int, seed: int = 0, sample_ids=None, eos_ids=None,
             prompt_lengths=None, cache_length: int | None = None, pad_id: int = 0,
             spec: SpecConfig | None = None, heads=None, kernels: str = "auto",
             return_hidden: bool = False, on_nonfinite: str = "raise") -> Rollout:
  """Sample one response per prompt from the target.

  prompts: a list of token-id lists (ragged) or a padded [B, P] array with ``prompt_lengths``.
  sample_ids: global response ids (default 0..B-1); the noise of a token depends on (seed, sample
  id,
    position, token) only, so a response does not depend on its batch slot or batch mates.
  eos_ids: ids that end a response (default: the config's); the EOS itself is part of the response.
  spec, heads: run the speculative engine with these future-token heads (same tokens as vanilla).
  kernels: "auto" (Pallas on GPU/TPU, jnp references on CPU), "reference", "pallas",
    "pallas_interpret".
  return_hidden: also return the pre-norm hidden state at the anchor of each response token
    (what ``heads.fit_heads`` trains on).
  on_nonfinite: "raise" (FloatingPointError naming the rows) or "flag" (rows stop; see
    ``stats.nonfinite``). NaN/inf logits are never sampled.
  """
  if not isinstance(sampling, SamplingConfig):
    raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
  if on_nonfinite not in ("raise", "flag"):
    raise ValueError(f"on_nonfinite must be 'raise' or 'flag', got {on_nonfinite!r}")
  _check_seed(seed)
  from specroll_jax.models.attention import resolve
  attn_impl = resolve(kernels)
  batch = prepare_batch(config, prompts, max_new_tokens=max_new_tokens,
                        prompt_lengths=prompt_lengths, sample_ids=sample_ids, eos_ids=eos_ids,
                        cache_length=cache_length)
  if spec is not None:
    from specroll_jax import speculative
    if heads is None:
      raise ValueError("spec is set but heads is None; pass heads=heads.init(...) or fitted heads")
    result = speculative.generate(config, params, heads, batch, sampling=sampling, spec=spec,
                                  max_new=int(max_new_tokens), seed=int(seed),
                                  attn_impl=attn_impl, return_hidden=return_hidden)
  else:
    out_t, out_lp, out_h, n_out, nf, fwd, rfwd = _vanilla(
        config, params, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
        jnp.asarray(batch.sample_ids), jnp.asarray(batch.eos_ids), jnp.uint32(seed),
        sampling=sampling, max_new=int(max_new_tokens), cache_length=batch.cache_length,
        attn_impl=attn_impl, return_hidden=return_hidden)
    zeros = jnp.zeros((1,), jnp.int32)
    stats = RolloutStats(target_forwards=fwd, row_forwards=rfwd, tokens=n_out.sum(),
                         nonfinite=nf, head_proposed=zeros, head_accepted=zeros,
                         nodes_verified=jnp.int32(0))
    result = (out_t, out_lp, out_h, n_out, stats)
  out_t, out_lp, out_h, n_out, stats = result
  tokens, logprobs = _finish(out_t, out_lp, n_out, pad_id)
  nf = np.asarray(stats.nonfinite)
  if nf.any():
    msg = f"non-finite logits in rows {np.flatnonzero(nf).tolist()}; those rows were stopped"
    if on_nonfinite == "raise":
      raise FloatingPointError(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=2)
  return Rollout(tokens=tokens, lengths=n_out, logprobs=logprobs, stats=stats,
                 hidden=out_h)
