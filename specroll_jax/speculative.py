"""The speculative engine: heads propose a sparse tree, the target verifies it exactly.

The decode runs bucket by bucket: a bucket is a compiled ``lax.while_loop`` over (rows, N) static
shapes (rows slots, N tree nodes per row). When few enough rows remain active the host compacts the
active rows (KV cache included) into the next smaller bucket, whose rows get larger trees
(N = min(max_nodes, node_budget // rows)): the long tail of GRPO responses gets big trees cheaply.

Outputs are written to global [B, M] arrays by each slot's global row index, so compaction never
moves results, and sampling depends on (seed, sample id, position, token) only: the result is the
vanilla rollout, token for token.
"""

from __future__ import annotations

import functools
import time

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from specroll_jax import heads as _heads
from specroll_jax import responses as _responses
from specroll_jax import tree as _tree
from specroll_jax import verify as _verify
from specroll_jax.models import decoder as _dec


@flax.struct.dataclass
class SpecState:
  # per slot [R]
  cache: _dec.KVCache
  root: Int[Array, " R"]  # last emitted token: the next tree's root (not yet in the cache)
  h: Float[Array, "R D"]  # pre-norm hidden at the root's anchor (what the heads read)
  row: Int[Array, " R"]  # global row index of the slot
  sample_ids: Int[Array, " R"]
  n_out: Int[Array, " R"]
  done: Bool[Array, " R"]
  proposer: tuple  # proposer state (empty for static heads; Reflex plugs in here)
  # global [B, ...]
  out: _responses.Outputs  # [B, M] tokens / logprobs (/ hidden), by global row
  lengths: Int[Array, " B"]
  nonfinite: Bool[Array, " B"]
  # stats
  forwards: Int[Array, ""]
  row_forwards: Int[Array, ""]
  head_proposed: Int[Array, " K"]
  head_accepted: Int[Array, " K"]
  nodes_verified: Int[Array, ""]
  active_trace: Int[Array, " F"]  # active rows at forward f (f < max_new + 1)


@functools.partial(jax.jit, static_argnames=("config", "sampling", "max_new", "cache_length",
                                             "attn_impl", "return_hidden", "num_heads"))
def _prefill(config, params, tokens, lengths, sample_ids, eos_ids, seed, *, sampling, max_new,
             cache_length, attn_impl, return_hidden, num_heads):
  b = tokens.shape[0]
  st = _responses.start(config, params, tokens, lengths, sample_ids, eos_ids, seed,
                        sampling=sampling, max_new=max_new, cache_length=cache_length,
                        attn_impl=attn_impl, return_hidden=return_hidden)
  zk = jnp.zeros((num_heads,), jnp.int32)
  return SpecState(cache=st.cache, root=st.token, h=st.hidden, row=jnp.arange(b, dtype=jnp.int32),
                   sample_ids=sample_ids, n_out=st.n_out, done=st.done, proposer=(), out=st.out,
                   lengths=st.n_out, nonfinite=st.nonfinite, forwards=jnp.int32(0),
                   row_forwards=jnp.int32(b), head_proposed=zk, head_accepted=zk,
                   nodes_verified=jnp.int32(0), active_trace=jnp.zeros((max_new + 1,), jnp.int32))


def spec_step(config, params, heads, s: SpecState, eos_ids, seed, *, sampling, max_new, num_nodes,
              topk, attn_impl) -> SpecState:
  """One speculative step for every slot: propose, plan, verify, commit."""
  k_heads = len(topk)
  active = ~s.done
  head_lp = jax.nn.log_softmax(_heads.apply(config, params, heads, s.h), axis=-1)  # [R, K, V]
  budget = jnp.where(active, num_nodes, 0)
  tr = _tree.plan(s.root, head_lp, budget, num_nodes=num_nodes, topk=topk)
  res = _verify.verify(config, params, tr, s.cache, seed, s.sample_ids, sampling,
                       max_depth=k_heads, attn_impl=attn_impl)
  d1 = k_heads + 1
  j = jnp.arange(d1)[None]
  nf_cum = jnp.cumsum(res.nonfinite, axis=1) > 0  # token j unusable from the first NaN on
  avail = active[:, None] & (j < res.path_len[:, None]) & ~nf_cum
  keep, done = _responses.stop_mask(res.tokens, s.n_out, eos_ids, max_new, avail)
  row_nf = active & (nf_cum & (j < res.path_len[:, None])).any(1)
  # Commit: path node j's K/V at L + j, for every emitted token (the root and accepted nodes).
  L = s.cache.lengths
  slots = jnp.where(keep, L[:, None] + j, -1)
  cache = _dec.write_cache(s.cache, res.k_path, res.v_path, slots)
  cache = cache.replace(lengths=L + keep.sum(1).astype(jnp.int32))
  out = _responses.append(s.out, s.row, s.n_out, keep, res.tokens, res.logprobs, res.hidden)
  n_out = s.n_out + keep.sum(1).astype(jnp.int32)
  last = jnp.maximum(res.path_len - 1, 0)
  new_root = jnp.take_along_axis(res.tokens, last[:, None], axis=1)[:, 0]
  new_h = jnp.take_along_axis(res.hidden, last[:, None, None], axis=1)[:, 0]
  new_done = s.done | done | row_nf
  lengths = s.lengths.at[s.row].set(jnp.where(active, n_out, s.lengths[s.row]))
  nonfinite = s.nonfinite.at[s.row].max(row_nf)
  depth_reached = jnp.where(active, res.path_len - 1, -1)
  tree_depth = jnp.where(active, jnp.max(jnp.where(tr.valid, tr.depth, 0), axis=1), -1)
  ks = jnp.arange(1, k_heads + 1)[None]
  return s.replace(
      cache=cache, root=jnp.where(active, new_root, s.root),
      h=jnp.where(active[:, None], new_h, s.h), n_out=n_out, done=new_done,
      out=out, lengths=lengths,
      nonfinite=nonfinite, forwards=s.forwards + 1, row_forwards=s.row_forwards + active.sum(),
      active_trace=s.active_trace.at[s.forwards].add(active.sum().astype(jnp.int32), mode="drop"),
      head_proposed=s.head_proposed + (tree_depth[:, None] >= ks).sum(0).astype(jnp.int32),
      head_accepted=s.head_accepted + (depth_reached[:, None] >= ks).sum(0).astype(jnp.int32),
      nodes_verified=s.nodes_verified + (tr.valid.sum(1) - 1).sum().astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("config", "sampling", "max_new", "num_nodes", "topk",
                                             "attn_impl", "exit_rows"),
                   donate_argnames=("s",))
def _run_bucket(config, params, heads, s: SpecState, eos_ids, seed, *, sampling, max_new,
                num_nodes, topk, attn_impl, exit_rows):
  """Loop in this bucket until at most ``exit_rows`` rows are active. ``s`` is donated."""
  params = _dec.unstack_layers(params)  # per-layer slices taken once, outside the loop
  def cond(s):
    n_active = jnp.sum(~s.done)
    return (n_active > 0) & (n_active > exit_rows)

  body = functools.partial(spec_step, config, params, heads, eos_ids=eos_ids, seed=seed,
                           sampling=sampling, max_new=max_new, num_nodes=num_nodes, topk=topk,
                           attn_impl=attn_impl)
  return jax.lax.while_loop(cond, body, s)


@functools.partial(jax.jit, static_argnames=("rows",))
def _compact(s: SpecState, *, rows: int) -> SpecState:
  """Move the active slots first and keep ``rows`` slots (the KV cache moves with them)."""
  order = jnp.argsort(s.done, stable=True)[:rows]
  g = lambda x: x[order]
  cache = s.cache.take_rows(order)
  return s.replace(cache=cache, root=g(s.root), h=g(s.h), row=g(s.row),
                   sample_ids=g(s.sample_ids), n_out=g(s.n_out), done=g(s.done),
                   proposer=jax.tree.map(g, s.proposer))


def generate(config, params, heads, batch, *, sampling, spec, max_new, seed, attn_impl,
             return_hidden):
  """Speculative rollout of a prepared batch (see ``rollout.generate``). Returns the raw outputs."""
  _heads.validate(config, heads, spec.num_heads)
  b = batch.tokens.shape[0]
  s = _prefill(config, params, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths),
               jnp.asarray(batch.sample_ids), jnp.asarray(batch.eos_ids), jnp.uint32(seed),
               sampling=sampling, max_new=max_new, cache_length=batch.cache_length,
               attn_impl=attn_impl, return_hidden=return_hidden, num_heads=spec.num_heads)
  eos = jnp.asarray(batch.eos_ids)
  shapes = spec.bucket_shapes(b)
  times = []
  for i, (rows, n) in enumerate(shapes):
    if not bool(jnp.any(~s.done)):
      break
    if rows < s.root.shape[0]:
      s = _compact(s, rows=rows)
    exit_rows = shapes[i + 1][0] if i + 1 < len(shapes) else 0
    f0 = int(s.forwards)
    t0 = time.perf_counter()
    s = _run_bucket(config, params, heads, s, eos, jnp.uint32(seed), sampling=sampling,
                    max_new=max_new, num_nodes=n, topk=spec.topk, attn_impl=attn_impl,
                    exit_rows=exit_rows)
    steps = int(s.forwards) - f0  # syncs: also the wall-clock end of the bucket
    times.append((rows, n, steps, time.perf_counter() - t0))
  from specroll_jax.rollout import RolloutStats
  stats = RolloutStats(target_forwards=s.forwards, row_forwards=s.row_forwards,
                       tokens=s.lengths.sum(), nonfinite=s.nonfinite,
                       head_proposed=s.head_proposed, head_accepted=s.head_accepted,
                       nodes_verified=s.nodes_verified,
                       active_trace=s.active_trace[: max(int(s.forwards), 1)],
                       bucket_times=tuple(times))
  return s.out.tokens, s.out.logprobs, s.out.hidden, s.lengths, stats
