"""The speculative engine: propose a tree per row, verify it exactly, commit the target's samples.

Concurrency-aware buckets (docs/design.md, "Buckets and compaction"): a batch of B rows runs in a
few compiled (rows, N) buckets
with rows * N about the node budget. Each bucket is a ``lax.while_loop`` that exits once no more
rows are active than the next bucket holds; then an in-graph compaction moves the active slots
first and keeps that many (one ``tree_map`` over the per-slot state: KV cache, history and the
proposer's per-row state move with their row). The whole rollout is one traceable function,
``speculative_rollout``, that a caller may run inside its own ``jax.jit`` / ``jax.shard_map``; no
host round trip between buckets. A bucket with N = 0 runs the vanilla decode step (no proposer, no
tree), so it costs what a vanilla step costs.

Loop state by lifetime: ``Slots`` (every leaf [R, ...], compacted), ``responses.Outputs`` ([B, ...],
written by global row) and ``Counters`` (scalars and per-depth sums).

Every token is sampled with the counter-based noise of (seed, sample id, position, token), exactly
as the vanilla engine samples it, so the result is the vanilla rollout token for token, whatever
the proposer proposes.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from specroll_jax._vma import vary_like
from specroll_jax.engines import buckets as _buckets
from specroll_jax.engines import responses as _resp
from specroll_jax.engines import verify as _verify
from specroll_jax.engines.config import DecodeSettings, SpecConfig
from specroll_jax.engines.results import Rollout, RolloutStats, SpecStats
from specroll_jax.engines.vanilla import decode_step
from specroll_jax.models import decoder as _dec
from specroll_jax.proposers import contract as _contract
from specroll_jax.proposers import tree as _tree
from specroll_jax.proposers.base import Feedback, ProposeInput, Proposer, RowsInit, Target


@flax.struct.dataclass
class Slots:
  """Per-slot state: every leaf has a leading [R] axis and moves with its row on compaction."""

  cache: _dec.KVCache  # committed tokens 0..L-1 of each row
  root: Int[Array, " R"]  # last emitted token at position L: the next tree's root (not cached)
  hidden: Float[Array, "R D"]  # pre-norm hidden at the root's anchor (what proposers read)
  row: Int[Array, " R"]  # global row index of the slot
  sample_ids: Int[Array, " R"]
  n_out: Int[Array, " R"]  # tokens emitted
  done: Bool[Array, " R"]
  history: Int[Array, "R C"]  # token at each position (prompt + response), -1 unknown
  proposer: Any  # the proposer's per-row state


@flax.struct.dataclass
class Counters:
  forwards: Int[Array, ""]  # verify / decode forwards after the prefill
  row_forwards: Int[Array, ""]  # active rows summed over forwards (prefill: all rows)
  depth_proposed: Int[Array, " Kd"]
  depth_accepted: Int[Array, " Kd"]
  nodes_verified: Int[Array, ""]
  active_trace: Int[Array, " F"]  # active rows at forward f
  bucket_forwards: Int[Array, " S"]  # forwards run in bucket s
  bucket_row_forwards: Int[Array, " S"]  # active rows summed over bucket s's forwards
  bucket_tokens: Int[Array, " S"]  # tokens committed in bucket s
  skipped: Int[Array, ""]  # gated steps that ran the plain decode step instead of the tree
  proposer: Any  # the proposer's statistics, summed


@flax.struct.dataclass
class SpecState:
  slots: Slots
  out: _resp.Outputs
  counters: Counters
  shared: Any  # the proposer's state shared across rows (never compacted)


def init_state(config, params, proposer: Proposer, proposer_params, prompt_tokens, prompt_lengths,
               sample_ids, eos_ids, seed, *, settings: DecodeSettings,
               spec: SpecConfig) -> SpecState:
  """Prefill, first token, the proposer's per-row state and zero counters."""
  b, p = prompt_tokens.shape
  c = settings.cache_length
  params = _dec.unstack_layers(params)
  st = _resp.start(config, params, prompt_tokens, prompt_lengths, sample_ids, eos_ids, seed,
                   settings)
  rows = jnp.arange(b, dtype=jnp.int32)
  known = jnp.arange(p)[None] < prompt_lengths[:, None]
  w = min(p, c)  # padding past the cache length holds no prompt token
  history = jnp.full((b, c), -1, jnp.int32).at[:, :w].set(
      jnp.where(known, prompt_tokens, -1).astype(jnp.int32)[:, :w])
  history = history.at[rows, prompt_lengths].set(st.token, mode="drop")
  target = Target(config=config, params=params, sampling=settings.sampling)
  _contract.check_properties(proposer, config.vocab_size)
  prow, pshared = proposer.split_state(proposer.init(target, proposer_params, RowsInit(
      prompt_tokens=prompt_tokens, prompt_lengths=prompt_lengths, sample_ids=sample_ids, row=rows,
      first_token=st.token, hidden=st.hidden)))
  _contract.check_rows_state(proposer, "init", prow, b)  # trace time: shapes only
  slots = Slots(cache=st.cache, root=st.token, hidden=st.hidden, row=rows, sample_ids=sample_ids,
                n_out=st.n_out, done=st.done, history=history, proposer=prow)
  kd = proposer.max_depth
  zk = jnp.zeros((kd,), jnp.int32)
  nb = len(spec.bucket_shapes(b, proposer.capacity))
  counters = Counters(
      forwards=jnp.int32(0), row_forwards=jnp.int32(b), depth_proposed=zk, depth_accepted=zk,
      nodes_verified=jnp.int32(0),
      active_trace=jnp.zeros((settings.max_new_tokens + 1,), jnp.int32),
      bucket_forwards=jnp.zeros((nb,), jnp.int32), bucket_row_forwards=jnp.zeros((nb,), jnp.int32),
      bucket_tokens=jnp.zeros((nb,), jnp.int32),
      skipped=jnp.int32(0),
      proposer=proposer.init_stats())
  state = SpecState(slots=slots, out=st.out, counters=counters, shared=pshared)
  return vary_like(state, params, proposer_params, prompt_tokens, prompt_lengths, sample_ids,
                   eos_ids, seed)


def compact(slots: Slots, rows: int) -> Slots:
  """Active slots first, ``rows`` slots kept (static); every per-slot leaf moves with its row."""
  return _buckets.compact(slots, slots.done, rows)


def _pad_cols(x, width: int, value=0):
  """Pad axis 1 of x up to ``width``."""
  extra = width - x.shape[1]
  if extra <= 0:
    return x
  cfg = [(0, 0)] * x.ndim
  cfg[1] = (0, extra)
  return jnp.pad(x, cfg, constant_values=value)


@flax.struct.dataclass
class _Step:
  """What one step decided for every slot, whichever forward ran (the tree's verify forward or the
  plain decode step)."""

  tree: _tree.Tree  # the tree that was verified (root only for a plain step)
  em: _resp.Emitted
  cache: _dec.KVCache  # with this step's committed K/V and lengths
  path_len: Int[Array, " R"]
  tokens: Int[Array, "R D1"]
  path_hidden: Float[Array, "R D1 D"]
  path: Int[Array, "R D1"]
  target_tokens: Int[Array, "R N1"]
  accepted: Bool[Array, "R N1"]
  topm_ids: Any = None
  topm_logprobs: Any = None
  lse: Any = None
  floor: Any = None


def _plain(config, params, s: SpecState, eos_ids, seed, settings: DecodeSettings,
           d1: int) -> _Step:
  """The vanilla decode step (K/V appended in place) in the speculative loop's terms."""
  sl = s.slots
  active = ~sl.done
  hid, cache, tok, lp, nf = decode_step(config, params, sl.root, sl.cache, active, seed,
                                        sl.sample_ids, settings)
  r = sl.root.shape[0]
  tokens = _pad_cols(tok[:, None], d1)
  path_hidden = _pad_cols(hid[:, None], d1)
  j = jnp.arange(d1)[None]
  em = _resp.emit(s.out, sl.row, sl.n_out, sl.done, tokens, _pad_cols(lp[:, None], d1),
                  path_hidden, _pad_cols(nf[:, None], d1, False), j < 1, eos_ids,
                  settings.max_new_tokens)
  return _Step(tree=_tree.root_only(sl.root), em=em, cache=cache,
               path_len=jnp.ones((r,), jnp.int32), tokens=tokens, path_hidden=path_hidden,
               path=jnp.zeros((r, d1), jnp.int32), target_tokens=tok[:, None],
               accepted=jnp.ones((r, 1), bool))


def _verified(config, params, s: SpecState, res: _verify.VerifyResult, tr: _tree.Tree, eos_ids,
              settings: DecodeSettings) -> _Step:
  """Emit the target's samples along a verified tree's accepted path and commit their K/V."""
  sl = s.slots
  length = sl.cache.lengths
  j = jnp.arange(res.tokens.shape[1])[None]
  em = _resp.emit(s.out, sl.row, sl.n_out, sl.done, res.tokens, res.logprobs, res.hidden,
                  res.nonfinite, j < res.path_len[:, None], eos_ids, settings.max_new_tokens)
  # commit path node j's K/V at L + j for every emitted token j
  cache = _dec.write_cache(sl.cache, res.k_path, res.v_path,
                           jnp.where(em.keep, length[:, None] + j, -1))
  cache = cache.replace(lengths=length + em.keep.sum(1).astype(jnp.int32))
  return _Step(tree=tr, em=em, cache=cache, path_len=res.path_len, tokens=res.tokens,
               path_hidden=res.hidden, path=res.path, target_tokens=res.target_tokens,
               accepted=res.accepted, topm_ids=res.topm_ids, topm_logprobs=res.topm_logprobs,
               lse=res.lse, floor=res.floor)


def _gated_verify(config, params, s: SpecState, tr: _tree.Tree, go, seed,
                  settings: DecodeSettings, max_depth: int, topm: int):
  """(the verify result, the tree it verified): ``tr`` where ``go``, else the root alone (a
  plain step through the same forward). The cache is only read inside the branches (written once
  after them), so the conditional copies no KV buffer."""
  sl = s.slots
  n1 = tr.tokens.shape[1]
  run = lambda t: _verify.verify(config, params, t, sl.cache, seed, sl.sample_ids,
                                 settings.sampling, max_depth=max_depth, kernels=settings.kernels,
                                 topm=topm)

  def tree_branch():
    return run(tr), tr

  def root_branch():
    root = _tree.root_only(sl.root)
    res = run(root)
    return res.replace(target_tokens=_pad_cols(res.target_tokens, n1),
                       accepted=_pad_cols(res.accepted, n1, False)), _tree.pad(root, n1 - 1)

  return jax.lax.cond(go, tree_branch, root_branch)


def spec_step(config, params, proposer: Proposer, proposer_params, s: SpecState, eos_ids, seed, *,
              settings: DecodeSettings, num_nodes: int, bucket: int,
              gate: float | None = None) -> SpecState:
  """One speculative step for every slot: propose, verify, commit, feed back (N = num_nodes).

  ``gate`` (static): verify the tree only when the active rows' expected accepted nodes
  (``Proposer.expected_gain``) average at least ``gate``; otherwise run the plain decode step
  (the proposal is discarded; ``update`` sees a root-only tree). None: always verify.
  """
  sl = s.slots
  d1 = proposer.max_depth + 1
  active = ~sl.done
  length = sl.cache.lengths  # L: position of the root
  target = Target(config=config, params=params, sampling=settings.sampling)
  pstate = start = proposer.join_state(sl.proposer, s.shared)
  topm = proposer.feedback_topm
  ct = s.counters
  skipped = jnp.int32(0)
  if num_nodes == 0:  # nothing to propose: the vanilla decode step
    st = _plain(config, params, s, eos_ids, seed, settings, d1)
  else:
    budget = jnp.where(active, num_nodes, 0)
    tr, pstate = _contract.check_propose_output(proposer, proposer.propose(
        target, proposer_params, pstate, ProposeInput(
            hidden=sl.hidden, root=sl.root, position=length, history=sl.history, budget=budget,
            row=sl.row, sample_ids=sl.sample_ids, responses=s.out.tokens,
            response_lengths=s.out.lengths,
            seed=jnp.broadcast_to(jnp.asarray(seed), sl.row.shape)),
        num_nodes=num_nodes), sl.root.shape[0], num_nodes)
    tr = _tree.sanitize(tr, sl.root, proposer.max_depth)  # a bad tree: slow, never wrong
    proposed = pstate
    gain = None if gate is None else proposer.expected_gain(pstate, num_nodes)
    _contract.check_gain(proposer, gain, sl.root.shape[0])
    if gain is None:
      res = _verify.verify(config, params, tr, sl.cache, seed, sl.sample_ids, settings.sampling,
                           max_depth=proposer.max_depth, kernels=settings.kernels, topm=topm)
    else:
      n_act = jnp.maximum(active.sum(), 1).astype(jnp.float32)
      go = jnp.where(active, gain, 0.0).sum() >= jnp.float32(gate) * n_act
      res, tr = _gated_verify(config, params, s, tr, go, seed, settings, proposer.max_depth,
                              topm)
      skipped = (~go).astype(jnp.int32)
    st = _verified(config, params, s, res, tr, eos_ids, settings)
  tr, em, cache, path_len, tokens = st.tree, st.em, st.cache, st.path_len, st.tokens
  path_hidden = st.path_hidden
  j = jnp.arange(d1)[None]
  last = jnp.maximum(path_len - 1, 0)
  new_root = jnp.take_along_axis(tokens, last[:, None], axis=1)[:, 0]
  new_hidden = jnp.take_along_axis(path_hidden, last[:, None, None], axis=1)[:, 0]
  c = sl.history.shape[1]
  r_idx = jnp.broadcast_to(jnp.arange(sl.root.shape[0])[:, None], em.keep.shape)
  history = sl.history.at[r_idx, jnp.where(em.keep, length[:, None] + 1 + j, c)].set(
      tokens, mode="drop")
  pstats = proposer.init_stats()
  if num_nodes > 0:  # a step without a tree proposed nothing: no feedback to give
    fb = Feedback(tree=tr, target_tokens=st.target_tokens, accepted=st.accepted, path=st.path,
                  path_len=jnp.where(active, path_len, 0), tokens=tokens, keep=em.keep,
                  position=length, hidden=sl.hidden, path_hidden=path_hidden, active=active,
                  done=em.done, row=sl.row, sample_ids=sl.sample_ids, topm_ids=st.topm_ids,
                  topm_logprobs=st.topm_logprobs, lse=st.lse, floor=st.floor, history=history)
    pstate, pstats = _contract.check_update_output(
        proposer, proposer.update(target, proposer_params, pstate, fb))
    _contract.check_step_state(proposer, start, proposed, pstate)  # trace time: shapes only
    _contract.check_stats(proposer, pstats, ct.proposer)
  prow, pshared = proposer.split_state(pstate)
  slots = sl.replace(cache=cache, root=jnp.where(active, new_root, sl.root),
                     hidden=jnp.where(active[:, None], new_hidden, sl.hidden), n_out=em.n_out,
                     done=em.done, history=history, proposer=prow)
  n_active = active.sum().astype(jnp.int32)
  ks = jnp.arange(1, proposer.max_depth + 1)[None]
  tree_depth = jnp.where(active, jnp.max(jnp.where(tr.valid, tr.depth, 0), axis=1), -1)
  acc_depth = jnp.where(active, path_len - 1, -1)
  counters = ct.replace(
      forwards=ct.forwards + 1, row_forwards=ct.row_forwards + n_active,
      depth_proposed=ct.depth_proposed + (tree_depth[:, None] >= ks).sum(0).astype(jnp.int32),
      depth_accepted=ct.depth_accepted + (acc_depth[:, None] >= ks).sum(0).astype(jnp.int32),
      nodes_verified=ct.nodes_verified + jnp.where(active, tr.valid.sum(1) - 1, 0).sum().astype(
          jnp.int32),
      active_trace=ct.active_trace.at[ct.forwards].add(n_active, mode="drop"),
      bucket_forwards=ct.bucket_forwards.at[bucket].add(1),
      bucket_row_forwards=ct.bucket_row_forwards.at[bucket].add(n_active),
      bucket_tokens=ct.bucket_tokens.at[bucket].add(em.keep.sum().astype(jnp.int32)),
      skipped=ct.skipped + skipped,
      proposer=jax.tree.map(jnp.add, ct.proposer, pstats))
  return SpecState(slots=slots, out=em.out, counters=counters, shared=pshared)


def run_bucket(config, params, proposer: Proposer, proposer_params, state: SpecState, eos_ids,
               seed, *, settings: DecodeSettings, spec: SpecConfig, bucket: int,
               nodes=None) -> SpecState:
  """Compact into bucket ``bucket`` (static) and loop there until few enough rows are active.
  With ``spec.choices``, ``nodes`` [S] (traced, one count per bucket fraction) picks this
  bucket's count: a ``lax.switch`` over one step per choice (a count not among them: the
  bucket's first, its plain step where it has 0)."""
  params = _dec.unstack_layers(params)
  b = state.out.tokens.shape[0]
  shapes = spec.bucket_shapes(b, proposer.capacity)
  rows, n = shapes[bucket]
  gate = spec.gate_of(b, bucket)
  slots = state.slots
  if rows < slots.root.shape[0]:
    slots = compact(slots, rows)
  exit_rows = _buckets.exit_rows(tuple(r for r, _ in shapes), bucket)

  def cond(s: SpecState):
    n_active = jnp.sum(~s.slots.done)
    return (n_active > 0) & (n_active > exit_rows)

  def step(s: SpecState, num_nodes: int) -> SpecState:
    return spec_step(config, params, proposer, proposer_params, s, eos_ids, seed,
                     settings=settings, num_nodes=num_nodes, bucket=bucket, gate=gate)

  fraction = _buckets.kept_buckets(b, spec.bucket_fractions)[bucket][1]
  counts = None if spec.choices is None else [min(c, n) for c in spec.choices[fraction]]
  if counts is None or len(counts) == 1:
    body = lambda s: step(s, n if counts is None else counts[0])
  else:
    hit = jnp.asarray(counts, jnp.int32) == jnp.asarray(nodes, jnp.int32)[fraction]
    pick = jnp.where(hit.any(), jnp.argmax(hit), 0)  # not compiled for it: the first count
    branches = [functools.partial(step, num_nodes=c) for c in counts]
    body = lambda s: jax.lax.switch(pick, branches, s)

  return jax.lax.while_loop(cond, body, state.replace(slots=slots))


def finish(state: SpecState, settings: DecodeSettings) -> Rollout:
  out, ct = state.out, state.counters
  tokens, logprobs = _resp.finish(out, settings.pad_id)
  spec_stats = SpecStats(depth_proposed=ct.depth_proposed, depth_accepted=ct.depth_accepted,
                         nodes_verified=ct.nodes_verified, active_trace=ct.active_trace,
                         bucket_forwards=ct.bucket_forwards, skipped=ct.skipped,
                         bucket_row_forwards=ct.bucket_row_forwards,
                         bucket_tokens=ct.bucket_tokens, proposer=ct.proposer)
  stats = RolloutStats(target_forwards=ct.forwards, row_forwards=ct.row_forwards,
                       tokens=out.lengths.sum(), nonfinite=out.nonfinite, spec=spec_stats)
  return Rollout(tokens=tokens, lengths=out.lengths, logprobs=logprobs, stats=stats,
                 hidden=out.hidden, proposer_state=state.shared)


def speculative_rollout(config, params, proposer: Proposer, proposer_params, prompt_tokens,
                        prompt_lengths, sample_ids, eos_ids, seed, *, settings: DecodeSettings,
                        spec: SpecConfig, nodes=None) -> Rollout:
  """Sample one response per row with speculative decoding: the vanilla rollout, token for token.

  Traceable (no host work): every bucket runs inside the caller's trace. Arguments as in
  ``vanilla.vanilla_rollout``, plus the proposer (static settings), its parameters (traced) and
  ``spec`` (static); with ``spec.choices``, ``nodes`` [S] (traced): each bucket fraction's node
  count. ``config``, ``proposer``, ``settings`` and ``spec`` are static.
  """
  if (spec.choices is None) != (nodes is None):
    raise ValueError("nodes (each bucket's node count at run time) goes with SpecConfig.choices "
                     f"and only with it; got choices={spec.choices}, nodes "
                     f"{'given' if nodes is not None else 'None'}")
  if nodes is not None and tuple(jnp.shape(nodes)) != (len(spec.bucket_fractions),):
    raise ValueError(f"nodes must hold one count per bucket fraction "
                     f"({len(spec.bucket_fractions)}), got shape {tuple(jnp.shape(nodes))}")
  state = init_state(config, params, proposer, proposer_params, prompt_tokens, prompt_lengths,
                     sample_ids, eos_ids, seed, settings=settings, spec=spec)
  for i in range(len(spec.bucket_shapes(prompt_tokens.shape[0], proposer.capacity))):
    state = run_bucket(config, params, proposer, proposer_params, state, eos_ids, seed,
                       settings=settings, spec=spec, bucket=i, nodes=nodes)
  return finish(state, settings)
