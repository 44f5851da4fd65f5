"""Reflex's in-loop cost against one verify forward, on the tiny model and a 1.5B-shaped model.

  .venv/bin/python experiments/bench_reflex_cost.py                 # tiny + Qwen2.5-1.5B shape
  .venv/bin/python experiments/bench_reflex_cost.py --layers 4      # cut the 1.5B shape's layers
  .venv/bin/python experiments/bench_reflex_cost.py --quick         # smoke test (seconds)

For each model, at the same B rows and N tree nodes per row:

(a) one verify forward: ``verify.verify`` (what ``speculative.spec_step`` runs: the target on
    [root + N nodes] over a KV cache of --cache positions, sampling at every node and the exact
    acceptance), once with ``topm = 0`` (what the static heads ask for) and once with the top-16
    feedback Reflex asks for (``feedback_topm``); the difference is Reflex's share of the verify;
(b) the proposer's per-step work, isolated: ``propose`` + ``update`` for --steps consecutive
    steps in one jitted ``lax.scan`` (a synthetic feedback commits --accept tokens per step, so
    the prediction ring fills and matures as in a rollout), for the static ``HeadsProposer`` (its
    ``update`` is a no-op) and for ``ReflexProposer`` variants: gates open (every head eligible:
    corrections, the raw-head counterfactual, maturing records), in a full bucket (the row-adaptive
    feedback stride is 4) and in the tail (few rows left: records every step); a fresh state
    (gates closed); corrections off (records only); and with ``ReflexConfig.stride`` > 1;
(c) the heads' own proposal cost: the static proposer's time in (b);
(d) the slow path's host work, the rest of SpecRoll's adaptation cost (between batches, not in the
    decode loop): one guarded refresh of one head (``slow_path.retrain.refresh``: held-out
    evaluation before and after, the proximal term's pre-refresh pass and the AdamW
    steps, each over every record) on a reservoir of --refresh-records random valid records per
    head, timed at 0, 1 and 3 steps so that its cost splits into the passes (0 steps), the first
    step's extra (at the 1.5B shape, likely the [records, V] buffers it allocates for the later
    steps to reuse) and a per-step part, over the full vocabulary and with the support-only
    objective (``SlowPathConfig.refresh_vocab``); and the records drawn from a batch's anchor
    hidden states (``trainer_records.from_hidden``, what ``SpecRoll`` runs on the hidden states of
    the rows that verified trees; --trainer-anchors anchors). Both are linear in the records
    (their unembedding over V dominates), so the table also gives one refresh at the drift
    replay's setting (1536 records per head, 10 steps each over half of them:
    ``SlowPathConfig.for_small_models``, ``bench_adaptation.py``'s defaults),
    scaled from the measured ones, all in units of one verify forward of the same model.

The static baseline is the plain Medusa heads' proposer (``HeadsProposer``: the same heads and tree
plan, no Reflex and no slow path); in (b) root-conditioned heads are not timed. In (d) the tiny
model's slow path trains and reads its shipped root-conditioned heads (what the main job proposes
with), and the refresh the main job runs is also timed whole (``SlowPathConfig.for_small_models``,
one and two heads); the 1.5B shape's are random Medusa heads.

Reflex's extra = Reflex proposer ms - static proposer ms; its share = extra / verify ms (topm 0).
The 1.5B shape (hidden 1536, 28 layers, 12 / 2 heads, intermediate 8960, vocab 151936, tied
embeddings; --dtype, f32 by default) has random weights; its layers share one random layer's
arrays (same FLOPs and bytes per layer, 1/28 of the memory). With --layers L < 28 the verify is
also timed at 2 layers and extrapolated linearly to 28 (per-layer slope reported). The proposer's
work does not depend on the layer count (it reads only the embedding and final norm). Compile is
excluded (one warm-up call each); then --repeats rounds call every case of a model once in turn
(a machine shared with other jobs slows all alike); medians over the rounds (minimums in the
JSON). Writes JSON to --out.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
import time
import zlib
from pathlib import Path

import _common
import numpy as np

QWEN_1P5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                 num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=32768)
MODELS = ("tiny", "qwen1.5b")
TOPMS = (0, 16)  # the static heads' verify; with Reflex's top-16 feedback


# ------------------------------------------------------------------------------------- models


def tiny_model():
  """(name, config, params, heads, cond_heads) of the embedded default model and its shipped
  Medusa and root-conditioned heads (the main job proposes with the latter)."""
  from app import pipeline
  config, params, tok, path = pipeline.load_model(None, progress=False)
  heads = pipeline.default_heads(config, params, tok, path, progress=False)
  cond = pipeline.default_heads(config, params, tok, path, progress=False, conditioned=True)
  return f"tiny (d={config.hidden_size}, V={config.vocab_size}, {config.num_layers} layers)", \
      config, params, heads, cond


def qwen_shaped(layers: int, dtype: str, seed: int = 0):
  """(config, params) of a random-weight Qwen2.5-1.5B-shaped decoder with ``layers`` layers; the
  params are unstacked (a tuple of per-layer dicts) and every layer holds the same arrays (one
  random layer: the FLOPs and bytes per layer of distinct ones, 1/28 of the memory)."""
  import jax
  import jax.numpy as jnp

  from specroll_jax import models
  config = models.ModelConfig(**{**QWEN_1P5B, "num_layers": layers}, dtype=dtype)
  one = config.replace(num_layers=1)
  shapes = jax.eval_shape(lambda k: models.init_params(k, one), jax.random.key(0))
  key = jax.random.key(seed)

  def fill(path, s):
    name = jax.tree_util.keystr(path)
    k = jax.random.fold_in(key, zlib.crc32(name.encode()))
    if name.endswith("['scale']"):
      return jnp.ones(s.shape, s.dtype)
    if name.endswith("['bias']"):
      return jnp.zeros(s.shape, s.dtype)
    return (0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype)

  p = jax.tree_util.tree_map_with_path(fill, {k: v for k, v in shapes.items() if k != "embed"})
  # the embedding (tied: also the unembedding): a random block of V/8 rows tiled 8 times, each
  # row scaled by its own factor so no two logits tie (a full V x D draw takes seconds on CPU)
  v, d = config.vocab_size, config.hidden_size
  block = 0.02 * jax.random.normal(jax.random.fold_in(key, 1), (-(-v // 8), d), jnp.float32)
  row_scale = 1.0 + 0.25 * jnp.arange(v, dtype=jnp.float32) / v
  p["embed"] = {"embedding": (jnp.tile(block, (8, 1))[:v] * row_scale[:, None]).astype(
      config.jnp_dtype)}
  layer = jax.tree.map(lambda a: a[0], p["layers"])  # [1, ...] -> [...]
  params = {**{k: v for k, v in p.items() if k != "layers"}, "layers": (layer,) * layers}
  return config, params


# ----------------------------------------------------------------------------------- timing


def round_robin(cases: list[tuple], repeats: int) -> list[dict]:
  """Time ``cases`` [(fn, args), ...]: one warm-up call each (compile), then ``repeats`` rounds
  that call every case once in turn, so a machine shared with other jobs slows all cases alike.
  Per case: median and min seconds over the rounds, and the warm-up's extra (compile) seconds."""
  import jax
  first = []
  for fn, args in cases:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first.append(time.perf_counter() - t0)
  times = [[] for _ in cases]
  for _ in range(repeats):
    for i, (fn, args) in enumerate(cases):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[i].append(time.perf_counter() - t0)
  return [{"s": float(np.median(t)), "min_s": float(np.min(t)),
           "compile_s": f - float(np.median(t))} for t, f in zip(times, first, strict=True)]


def _inputs(config, rows: int, seed: int):
  import jax
  import jax.numpy as jnp
  k1, k2 = jax.random.split(jax.random.key(seed))
  hidden = jax.random.normal(k1, (rows, config.hidden_size), jnp.float32).astype(config.jnp_dtype)
  root = jax.random.randint(k2, (rows,), 0, config.vocab_size, jnp.int32)
  return hidden, root


def verify_cases(config, params, heads, *, rows: int, nodes: int, cache: int, num_heads: int,
                 seed: int, topms=TOPMS) -> list[tuple]:
  """(fn, args) of one verify forward at each top-m (a static heads tree over a cache of
  ``cache`` positions, nearly full)."""
  import jax
  import jax.numpy as jnp

  from specroll_jax.engines import verify
  from specroll_jax.kernels import Kernels
  from specroll_jax.models import decoder as dec
  from specroll_jax.proposers import HeadsProposer
  from specroll_jax.proposers.base import ProposeInput, Target
  from specroll_jax.sampling import SamplingConfig
  sampling = SamplingConfig(temperature=1.0)
  kernels = Kernels.resolve("auto")
  params = dec.unstack_layers(params)
  target = Target(config=config, params=params, sampling=sampling)
  hidden, root = _inputs(config, rows, seed)
  prop = HeadsProposer(num_heads=num_heads)
  budget = jnp.full((rows,), nodes, jnp.int32)
  pos = jnp.full((rows,), cache - num_heads - 2, jnp.int32)
  tr, _ = jax.jit(lambda p, hd, h, r: prop.propose(target.replace(params=p), hd, (), ProposeInput(
      hidden=h, root=r, position=pos, history=jnp.zeros((rows, 1), jnp.int32), budget=budget,
      row=jnp.arange(rows), sample_ids=jnp.arange(rows), seed=jnp.zeros((rows,), jnp.uint32)),
      num_nodes=nodes))(
          params, heads, hidden, root)
  kv = dec.init_cache(config, rows, cache)
  kv = kv.replace(lengths=pos)
  sids = jnp.arange(rows, dtype=jnp.int32)
  return [(jax.jit(lambda p, t, c, s, m=m: verify.verify(
      config, p, t, c, jnp.uint32(seed), s, sampling, max_depth=num_heads, kernels=kernels,
      topm=m)), (params, tr, kv, sids)) for m in topms]


def _proposer_run(proposer, config, sampling, *, rows: int, nodes: int, accept: int, steps: int):
  """A jitted function running ``steps`` consecutive propose + update steps in a ``lax.scan``
  with a synthetic feedback that commits ``accept`` tokens per step (``tokens[j]`` the depth-1
  candidate shifted by j; the target's top-16 around it). Inputs change every step (the anchor
  rolls, the root is the last tree's first candidate), so no work is hoisted out of the loop.
  The target's parameters are an argument (as in the engine), never a compiled-in constant."""
  import jax
  import jax.numpy as jnp

  from specroll_jax.proposers.base import Feedback, ProposeInput, Target
  v = config.vocab_size
  d1 = proposer.max_depth + 1
  topm = max(proposer.feedback_topm, 1)
  rid = jnp.arange(rows, dtype=jnp.int32)
  j = jnp.arange(d1, dtype=jnp.int32)[None]
  budget = jnp.full((rows,), nodes, jnp.int32)

  def run(tparams, pparams, state, hidden, root, pos):
    target = Target(config=config, params=tparams, sampling=sampling)

    def body(carry, _):
      state, hidden, root, pos, acc = carry
      inp = ProposeInput(hidden=hidden, root=root, position=pos,
                         history=jnp.zeros((rows, 1), jnp.int32), budget=budget, row=rid,
                         sample_ids=rid, seed=jnp.zeros((rows,), jnp.uint32))
      tr, state = proposer.propose(target, pparams, state, inp, num_nodes=nodes)
      first = tr.tokens[:, min(1, tr.tokens.shape[1] - 1)]
      tokens = (first[:, None] + j) % v
      path_hidden = jnp.stack([jnp.roll(hidden, i + 1, axis=-1) for i in range(d1)], axis=1)
      ids = (tokens[..., None] + jnp.arange(topm, dtype=jnp.int32)) % v
      fb = Feedback(
          tree=tr, target_tokens=tr.tokens, accepted=tr.valid, path=jnp.broadcast_to(j, (rows, d1)),
          path_len=jnp.full((rows,), accept, jnp.int32), tokens=tokens,
          keep=jnp.broadcast_to(j < accept, (rows, d1)), position=pos, hidden=hidden,
          path_hidden=path_hidden, active=jnp.ones((rows,), bool), done=jnp.zeros((rows,), bool),
          row=rid, sample_ids=rid, topm_ids=ids,
          topm_logprobs=jnp.broadcast_to(-1.0 - jnp.arange(topm, dtype=jnp.float32), ids.shape),
          lse=jnp.zeros((rows, d1), jnp.float32), floor=jnp.full((rows, d1), -jnp.inf),
          history=jnp.zeros((rows, 1), jnp.int32))
      state, stats = proposer.update(target, pparams, state, fb)
      acc = acc + tr.tokens.sum() + sum(jnp.sum(x).astype(jnp.int32) for x in
                                        jax.tree.leaves(stats))
      return (state, path_hidden[:, accept - 1], tokens[:, accept - 1], pos + accept, acc), None

    (state, *rest), _ = jax.lax.scan(body, (state, hidden, root, pos, jnp.int32(0)), None,
                                     length=steps)
    return state, rest[-1]

  return jax.jit(run)


def open_gates(state, seed: int):
  """A Reflex state whose every (row, head) is eligible to correct (past the observation, severity
  and size thresholds with a positive LCB)."""
  import jax
  import jax.numpy as jnp

  from specroll_jax.adaptation import reflex
  rows, shared = state
  f = rows.fast
  n, k, d = f.m.shape
  full = lambda x: jnp.full((n, k), x, jnp.float32)
  fast = reflex.FastState(m=0.05 * jax.random.normal(jax.random.key(seed), (n, k, d)),
                          count=full(200.0), mean=full(0.3), m2=full(2.0), severity=full(50.0))
  return state.replace(rows=rows.replace(fast=fast))


def proposer_cases(config, params, heads, *, rows: int, nodes: int, cache: int, accept: int,
                   steps: int, seed: int, strides: tuple[int, ...],
                   quick: bool = False) -> tuple[list[tuple], list[tuple]]:
  """(variants [(name, config, bucket, gates open)], cases [(fn, args)]): ``steps`` steps of
  propose + update for the static heads and the Reflex variants."""
  import jax.numpy as jnp

  from specroll_jax.adaptation import reflex
  from specroll_jax.models import decoder as dec
  from specroll_jax.proposers import HeadsProposer, ReflexProposer
  from specroll_jax.proposers.base import RowsInit, Target
  from specroll_jax.sampling import SamplingConfig
  k = heads.num_heads
  params = dec.unstack_layers(params)
  target = Target(config=config, params=params, sampling=SamplingConfig(temperature=1.0))
  hidden, root = _inputs(config, rows, seed)
  pos = jnp.full((rows,), cache - 4 * steps, jnp.int32)
  init = RowsInit(prompt_tokens=jnp.zeros((rows, 4), jnp.int32),
                  prompt_lengths=jnp.full((rows,), 4, jnp.int32),
                  sample_ids=jnp.arange(rows, dtype=jnp.int32),
                  row=jnp.arange(rows, dtype=jnp.int32), first_token=root, hidden=hidden)
  base = reflex.ReflexConfig(num_heads=k)
  variants = [("static heads", None, "full", False)]
  if not quick:
    variants.append(("reflex, gates open", base, "full", True))
  variants.append(("reflex, gates open", base, "tail", True))
  if not quick:
    variants += [("reflex, fresh state", base, "full", False),
                 ("reflex, corrections off", dataclasses.replace(base, apply_corrections=False),
                  "full", False)]
  for s in strides:
    if s > 1:
      cfg = dataclasses.replace(base, stride=s)
      variants += [(f"reflex stride {s}, gates open", cfg, "tail", True)]
      if not quick:
        variants.append((f"reflex stride {s}, gates open", cfg, "full", True))
  cases = []
  for _, cfg, regime, opened in variants:
    if cfg is None:
      prop, pparams, state = HeadsProposer(num_heads=k), heads, ()
    else:
      prop = ReflexProposer(cfg)
      pparams = prop.params(heads, reflex.init_global(cfg))
      state = prop.init(target, pparams, init)
      if opened:
        state = open_gates(state, seed)
      if regime == "tail":  # a quarter of the batch left: the row-adaptive stride is 1
        state = state.replace(shared=state.shared.replace(batch_rows=jnp.int32(4 * rows)))
    fn = _proposer_run(prop, config, target.sampling, rows=rows, nodes=nodes, accept=accept,
                       steps=steps)
    cases.append((fn, (params, pparams, state, hidden, root, pos)))
  return variants, cases


# ---------------------------------------------------------------------------- slow path


def random_reservoir(config, *, num_heads: int, capacity: int, support: int, candidates: int,
                     seed: int, paths: bool = False):
  """A full reservoir of random, valid records (every field filled as Reflex or the trainer
  writes it: supports of distinct-enough ids, target probabilities on them, the committed token
  among them; with ``paths`` the committed paths root-conditioned heads read), for timing: the
  refresh's work does not depend on the values."""
  import jax
  import jax.numpy as jnp

  from specroll_jax.adaptation import records as R
  k, c, v, d = num_heads, capacity, config.vocab_size, config.hidden_size
  keys = jax.random.split(jax.random.key(seed), 4)
  sup = jax.random.randint(keys[0], (k, c, support), 0, v, jnp.int32)
  p = jax.nn.softmax(2.0 * jax.random.normal(keys[1], (k, c, support)), -1)
  return R.Records(hidden=jax.random.normal(keys[2], (k, c, d), jnp.float32),
                   correction=jnp.zeros((k, c, d), jnp.float32), support=sup, p=p,
                   p_tail=jnp.full((k, c), 0.1, jnp.float32), token=sup[..., 0],
                   candidates=sup[..., :candidates], hit=jnp.ones((k, c), bool),
                   tv=jnp.full((k, c), 0.3, jnp.float32),
                   position=jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (k, c)),
                   valid=jnp.ones((k, c), bool), count=jnp.full((k,), c, jnp.int32),
                   path=jax.random.randint(keys[3], (k, c, k), 0, v, jnp.int32) if paths
                   else None)


# refresh steps timed: 0 gives the passes alone (held-out evaluations, pre-refresh pass); 1 and 3
# give the cost of a step (their difference) and so the first step's extra (buffers it allocates)
SLOW_STEPS = (0, 1, 3)


def slow_path_cases(config, params, heads, *, records: int, anchors: int, seed: int,
                    preset: bool = False):
  """(names, cases [(fn, args)]): one refresh of head 0 at each of ``SLOW_STEPS`` steps (one
  compiled program: the step count is traced), then the same with the support-only objective
  (``refresh_vocab="support"``), then ``trainer_records.from_hidden`` of a 16-row batch of 64
  response tokens with ``anchors`` anchors; with ``preset``, then the refresh the main job runs
  on a small model as it runs it (``SlowPathConfig.for_small_models``: its reservoir of random
  valid records, its steps, the head mask an argument as in ``slow_path.after_batch``), of one
  head and of two, and of one head in ``for_tests``' chunks of 64 records (the same records per
  step)."""
  import jax
  import jax.numpy as jnp

  from specroll_jax.adaptation import slow_path as SP
  from specroll_jax.adaptation import trainer_records as TR
  from specroll_jax.adaptation.reflex import ReflexConfig
  from specroll_jax.adaptation.slow_path import retrain
  from specroll_jax.heads import kinds as head_kinds
  from specroll_jax.models import decoder as dec
  from specroll_jax.sampling import SamplingConfig
  k = heads.num_heads
  cond = head_kinds.is_conditioned(heads)
  rc = ReflexConfig(num_heads=k, conditioned=cond)
  cfg = SP.SlowPathConfig(reservoir_size=records * k, chunk_size=min(256, records),
                          learning_rate=1e-4).refresh_settings()
  state = SP.init(cfg, heads, support_size=rc.support_size, num_candidates=rc.max_candidates)
  res = random_reservoir(config, num_heads=k, capacity=records, support=rc.support_size,
                         candidates=rc.max_candidates, seed=seed, paths=cond)
  params = dec.unstack_layers(params)
  one = jnp.arange(k) == 0  # one head, as the degradation monitor usually names

  def refresh_fn(c):  # the mask an argument, as after_batch compiles it
    return jax.jit(lambda p, hd, opt, r, m, n: retrain.refresh(c, config, p, hd, opt, r, m, n))

  names, cases = [], []
  for vocab, label in (("full", "refresh"), ("support", "refresh on the support")):
    fn = refresh_fn(cfg.replace(refresh_vocab=vocab))  # SlowPathConfig.refresh_vocab
    for st in SLOW_STEPS:
      names.append(f"{label}, {st} step{'' if st == 1 else 's'}")
      cases.append((fn, (params, heads, state.opt_state, res, one, jnp.int32(st))))
  b, m = 16, 64
  kh, kt = jax.random.split(jax.random.key(seed + 1))
  hidden = jax.random.normal(kh, (b, m, config.hidden_size), jnp.float32).astype(config.jnp_dtype)
  tokens = jax.random.randint(kt, (b, m), 0, config.vocab_size, jnp.int32)
  lengths = jnp.full((b,), m, jnp.int32)
  sampling = SamplingConfig(temperature=1.0)
  build = lambda p, hd, h, t, key: TR.from_hidden(
      rc, config, p, hd, h, t, lengths, jnp.full((b,), 8, jnp.int32), sampling=sampling, key=key,
      num_anchors=anchors)
  names.append(f"trainer records, {anchors} anchors")
  cases.append((build, (params, heads, hidden, tokens, jax.random.key(seed))))
  if preset:
    small = SP.SlowPathConfig.for_small_models()
    per_head = small.per_head(k)
    big = random_reservoir(config, num_heads=k, capacity=per_head, support=rc.support_size,
                           candidates=rc.max_candidates, seed=seed + 2, paths=cond)
    steps = jnp.int32(small.refresh_steps)
    two = jnp.arange(k) < 2
    for label, c, mask in (("preset refresh, 1 head", small, one),
                           ("preset refresh, 2 heads", small, two),
                           ("preset refresh, 1 head, chunks of 64",  # the same records/step
                            small.replace(chunk_size=64,
                                          step_chunks=small.step_chunks * small.chunk_size // 64),
                            one)):
      c = c.refresh_settings()
      st = SP.init(c, heads, support_size=rc.support_size, num_candidates=rc.max_candidates)
      names.append(label)
      cases.append((refresh_fn(c), (params, heads, st.opt_state, big, mask, steps)))
  return names, cases


def _replay_setting():
  """(records per head, steps, share of the records one step reads) of the replay's refresh:
  ``SlowPathConfig.for_small_models`` for 3 heads (1536, 10, 0.5 with ``step_chunks`` 2 of 4)."""
  from specroll_jax.adaptation import slow_path as SP
  cfg = SP.SlowPathConfig.for_small_models()
  per_head = cfg.per_head(3)
  groups = SP.step_groups(cfg, per_head)
  share = 1.0 if groups is None else groups.shape[1] / np.unique(groups).size  # of every chunk
  return per_head, cfg.refresh_steps, share


def slow_path_rows(names, times, *, records: int, anchors: int, verify_ms: float) -> dict:
  """The slow path's figures of one model: measured ms, the split of a refresh (full-batch
  steps) into its passes (0 steps), the first step's extra and the cost of each further step,
  the replay setting's refresh (``_replay_setting``: its steps read a share
  of the records) scaled linearly in records, each also in verify forwards."""
  replay_records, replay_steps, share = _replay_setting()
  ms = {n: 1e3 * t["s"] for n, t in zip(names, times, strict=True)}

  def split(r0, r1, r3):
    per_step = (r3 - r1) / (SLOW_STEPS[2] - SLOW_STEPS[1])
    fixed = r1 - SLOW_STEPS[1] * per_step  # the passes and the first step's extra
    replay = (fixed + replay_steps * share * per_step) * replay_records / records
    return {"refresh_fixed_ms": fixed, "refresh_per_step_ms": per_step,
            "refresh_passes_ms": r0, "refresh_first_step_extra_ms": fixed - r0,
            "replay_refresh": {"records": replay_records, "steps": replay_steps,
                               "step_share": share, "ms": replay,
                               "verify_forwards": replay / verify_ms},
            "refresh_1_step_verify_forwards": r1 / verify_ms}

  n = len(SLOW_STEPS)  # names: the full refresh's steps, the support-only one's, the records,
  rec_ms = ms[names[2 * n]]  # then the preset's refreshes (``slow_path_cases``)
  preset = None
  if len(names) > 2 * n + 1:
    one, two, small = (ms[x] for x in names[2 * n + 1:])
    preset = {"records": replay_records, "steps": replay_steps, "step_share": share,
              "one_head_ms": one,
              "two_heads_ms": two, "one_head_chunks64_ms": small,
              "one_head_verify_forwards": one / verify_ms,
              "two_heads_verify_forwards": two / verify_ms}
  return {"records": records, "anchors": anchors, "verify_ms": verify_ms, "measured_ms": ms,
          "preset": preset,
          "compile_s": {n: t["compile_s"] for n, t in zip(names, times, strict=True)},
          **split(*(ms[x] for x in names[:n])),
          "support": split(*(ms[x] for x in names[n:2 * n])),
          "trainer_records_ms": rec_ms, "trainer_records_verify_forwards": rec_ms / verify_ms,
          "trainer_records_per_anchor_ms": rec_ms / anchors}


# --------------------------------------------------------------------------------------- main


def bench_model(label, config, params, heads, a, *, full_layers=None, slow_heads=None) -> dict:
  """Every row of the table for one model: the verify forwards and the proposer variants timed in
  one round robin. ``full_layers`` > the model's layers (the cut 1.5B shape): the verify is also
  timed at fewer layers and extrapolated linearly to ``full_layers``. ``slow_heads`` (default
  ``heads``): the heads the slow path's cases train and read; given, the preset's refreshes are
  timed too (``slow_path_cases``)."""
  kw = dict(rows=a.rows, nodes=a.nodes, cache=a.cache, seed=a.seed)
  cases = verify_cases(config, params, heads, num_heads=heads.num_heads, **kw)
  layers = config.num_layers
  lo = None
  if full_layers is not None and layers < full_layers and not a.quick:
    lo = 1 if layers <= 2 else 2
    cases += verify_cases(config.replace(num_layers=lo), {**params, "layers": params["layers"][
        :lo]}, heads, num_heads=heads.num_heads, **kw)
  variants, pcases = proposer_cases(config, params, heads, accept=a.accept, steps=a.steps,
                                    strides=tuple(a.strides), quick=a.quick, **kw)
  preset = slow_heads is not None
  slow_heads = heads if slow_heads is None else slow_heads
  snames, scases = slow_path_cases(config, params, slow_heads, records=a.refresh_records,
                                   anchors=a.trainer_anchors, seed=a.seed, preset=preset)
  print(f"{label}: {len(cases)} verify, {len(pcases)} proposer and {len(scases)} slow-path "
        f"cases, {a.repeats} rounds", flush=True)
  times = round_robin(cases + pcases + scases, a.repeats)
  vt, pt = times[:len(cases)], times[len(cases):len(cases) + len(pcases)]
  st = times[len(cases) + len(pcases):]
  ms = lambda t: 1e3 * t["s"]
  details = {f"{layers} layers, top-{m}": {"ms": ms(t), "min_ms": 1e3 * t["min_s"],
                                          "compile_s": t["compile_s"]}
             for m, t in zip(TOPMS, vt[:2], strict=True)}
  v0, v16 = ms(vt[0]), ms(vt[1])
  note = None
  if full_layers is not None and a.quick:
    note = f"--quick: verify of the {layers}-layer cut-down as measured (not extrapolated)"
  elif full_layers is not None and lo is None:
    note = f"verify timed with all {layers} layers"
  elif lo is not None:  # the layers linearly; the top-16 feedback's extra is layer-free
    lo0 = ms(vt[2])
    details.update({f"{lo} layers, top-{m}": {"ms": ms(t), "compile_s": t["compile_s"]}
                    for m, t in zip(TOPMS, vt[2:], strict=True)})
    slope = (v0 - lo0) / (layers - lo)
    outside = v0 - layers * slope
    grow = slope * (full_layers - layers)
    v0, v16 = v0 + grow, v16 + grow
    details.update(per_layer_ms=slope, outside_layers_ms=outside, extrapolated_to=full_layers)
    note = (f"verify timed at {lo} and {layers} layers ({lo0:.1f} and {ms(vt[0]):.1f} ms), "
            f"extrapolated linearly to {full_layers}: {slope:.2f} ms per layer + {outside:.1f} ms "
            "outside the layers (embedding, unembedding, sampling, accept)")
  print(f"  verify {v0:.2f} ms (with the top-16 feedback {v16:.2f} ms)", flush=True)
  static = ms(pt[0]) / a.steps
  rows = []
  for (name, _, regime, _), t in zip(variants, pt, strict=True):
    p_ms = ms(t) / a.steps
    extra = p_ms - static
    reflex = name != "static heads"
    topm_extra = (v16 - v0) if reflex else 0.0
    print(f"  {name} ({regime}): {p_ms:.2f} ms/step", flush=True)
    rows.append({"model": label, "rows": a.rows, "nodes": a.nodes, "variant": name,
                 "regime": regime, "verify_ms": v0, "verify_top16_ms": v16,
                 "static_ms": static, "proposer_ms": p_ms,
                 "proposer_min_ms": 1e3 * t["min_s"] / a.steps, "extra_ms": extra,
                 "share": extra / v0, "verify_top16_extra_ms": topm_extra,
                 "share_with_top16": (extra + topm_extra) / v0, "heads_share": static / v0,
                 "compile_s": t["compile_s"]})
  slow = slow_path_rows(snames, st, records=a.refresh_records, anchors=a.trainer_anchors,
                       verify_ms=v0)
  print(f"  slow path: refresh of one head {slow['refresh_passes_ms']:.1f} ms of passes + "
        f"{slow['refresh_first_step_extra_ms']:.1f} ms first-step extra + "
        f"{slow['refresh_per_step_ms']:.1f} ms per step ({a.refresh_records} records; on the "
        f"support {slow['support']['refresh_passes_ms']:.1f} + "
        f"{slow['support']['refresh_first_step_extra_ms']:.1f} + "
        f"{slow['support']['refresh_per_step_ms']:.1f}); trainer records "
        f"{slow['trainer_records_ms']:.1f} ms ({a.trainer_anchors} anchors)", flush=True)
  if slow["preset"] is not None:
    pr = slow["preset"]
    print(f"  the preset's refresh: one head {pr['one_head_ms']:.1f} ms, two heads "
          f"{pr['two_heads_ms']:.1f} ms, one head in chunks of 64 {pr['one_head_chunks64_ms']:.1f}"
          " ms", flush=True)
  return {"label": label, "slow_heads": type(slow_heads).__name__,
          "config": dataclasses.asdict(config),
          "verify": details,
          "verify_ms": v0, "verify_top16_ms": v16, "layers_note": note, "rows": rows,
          "slow_path": slow}


def main(argv=None):
  from app import cli
  ap = cli.ArgumentParser(description=__doc__)
  ap.add_argument("--models", nargs="+", default=list(MODELS), help=f"any of {MODELS}")
  ap.add_argument("--rows", type=int, default=16, help="rows B")
  ap.add_argument("--nodes", type=int, default=4, help="tree nodes N per row (root excluded)")
  ap.add_argument("--cache", type=int, default=256, help="KV cache positions")
  ap.add_argument("--accept", type=int, default=2,
                  help="tokens the synthetic feedback commits per step (1 .. heads + 1)")
  ap.add_argument("--steps", type=int, default=8, help="proposer steps per timed call")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--layers", type=int, default=28, help="layers of the 1.5B shape (<= 28)")
  ap.add_argument("--dtype", default="float32", help="1.5B shape: float32 or bfloat16")
  ap.add_argument("--strides", type=int, nargs="+", default=[4],
                  help="ReflexConfig.stride values > 1 to measure")
  ap.add_argument("--refresh-records", type=int, default=256,
                  help="slow path: records per head in the timed refresh's reservoir")
  ap.add_argument("--trainer-anchors", type=int, default=256,
                  help="slow path: anchors of the timed trainer records")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default="runs/bench_reflex_cost.json")
  ap.add_argument("--quick", action="store_true",
                  help="B=2, 1 repeat, 2 steps, fewer variants, the 1.5B shape cut to 2 layers")
  a = ap.parse_args(argv)
  cli.require(a, rows=1, nodes=1, cache=8, accept=1, steps=1, repeats=1, layers=1, strides=1,
              refresh_records=2, trainer_anchors=1)
  if a.quick:
    a.rows, a.repeats, a.steps, a.layers = 2, 1, 2, 2
    a.refresh_records, a.trainer_anchors = 16, 8
  bad = [m for m in a.models if m not in MODELS]
  if bad:
    cli.fail("--models", a.models, f"unknown {bad}; choose from {MODELS}")
  if a.layers > QWEN_1P5B["num_layers"]:
    cli.fail("--layers", a.layers, f"the 1.5B shape has {QWEN_1P5B['num_layers']} layers")
  if a.dtype not in ("float32", "bfloat16"):
    cli.fail("--dtype", a.dtype, "must be float32 or bfloat16")
  if a.accept > 4:  # 3 heads: at most 4 tokens per step
    cli.fail("--accept", a.accept, "must be <= heads + 1 = 4")
  if a.cache < 4 * a.steps + 8:
    cli.fail("--cache", a.cache, f"must be >= 4 * steps + 8 = {4 * a.steps + 8}")
  out_path = Path(a.out)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  results = []
  t_start = time.perf_counter()
  if "tiny" in a.models:
    label, config, params, heads, cond = tiny_model()
    results.append(bench_model(label, config, params, heads, a, slow_heads=cond))
  if "qwen1.5b" in a.models:
    results.append(bench_qwen(a))
  meta = {"command": "experiments/bench_reflex_cost.py " + " ".join(
      sys.argv[1:] if argv is None else argv), "cpu": _common.cpu_model(),
      "machine": platform.machine(), "rows": a.rows, "nodes": a.nodes, "cache": a.cache,
      "accept": a.accept, "steps": a.steps, "repeats": a.repeats, "layers": a.layers,
      "dtype": a.dtype, "quick": a.quick, "refresh_records": a.refresh_records,
      "trainer_anchors": a.trainer_anchors, "seconds": time.perf_counter() - t_start}
  import jax
  meta["jax"] = jax.__version__
  meta["device"] = str(jax.devices()[0])
  out_path.write_text(json.dumps({"meta": meta, "models": results}, indent=2))
  _report(results, meta)
  print(f"wrote {out_path}")
  return {"meta": meta, "models": results}


def bench_qwen(a) -> dict:
  import jax

  from specroll_jax.heads import medusa as H
  full = QWEN_1P5B["num_layers"]
  t0 = time.perf_counter()
  config, params = qwen_shaped(a.layers, a.dtype, a.seed)
  heads = H.init(jax.random.key(a.seed + 1), config, 3, scale=0.02)
  print(f"built the 1.5B shape ({a.layers} layers) in {time.perf_counter() - t0:.1f} s",
        flush=True)
  short = {"float32": "f32", "bfloat16": "bf16"}[a.dtype]
  label = f"Qwen2.5-1.5B shape ({short}, {a.layers}/{full} layers)"
  return bench_model(label, config, params, heads, a, full_layers=full)


def _report(results: list[dict], meta: dict) -> None:
  from rich.console import Console
  from rich.table import Table
  con = Console(width=200)
  t = Table(title=f"Reflex's in-loop work vs one verify forward (B={meta['rows']}, "
                  f"N={meta['nodes']}, cache {meta['cache']}, {meta['accept']} tokens/step; "
                  f"{meta['cpu']}; compile excluded, medians of {meta['repeats']})")
  for c in ("model", "B", "N", "variant", "bucket", "verify ms", "static heads ms",
            "proposer ms", "Reflex extra ms", "extra % verify", "+top-16 in verify ms",
            "total % verify"):
    t.add_column(c, justify="left" if c in ("model", "variant", "bucket") else "right")
  for res in results:
    for r in res["rows"]:
      static = r["variant"] == "static heads"
      t.add_row(r["model"], str(r["rows"]), str(r["nodes"]), r["variant"],
                r["regime"] if not static else "-", f"{r['verify_ms']:.2f}",
                f"{r['static_ms']:.2f}", f"{r['proposer_ms']:.2f}",
                "-" if static else f"{r['extra_ms']:+.2f}",
                f"{100 * r['heads_share']:.1f}% (heads)" if static
                else f"{100 * r['share']:+.1f}%",
                "-" if static else f"{r['verify_top16_extra_ms']:+.2f}",
                "-" if static else f"{100 * r['share_with_top16']:+.1f}%")
    t.add_section()
  con.print(t)
  s = Table(title="The slow path's host work vs one verify forward (same B, N; refresh of one head "
                  "on random valid records; compile excluded)")
  for c in ("model", "verify ms", "refresh: passes ms (0 steps)", "first step's extra ms",
            "per step ms", "records/head",
            "1-step refresh = verify fwds",
            "replay refresh ({} rec., {} steps x {:.0%} of them) ms".format(*_replay_setting()),
            "= verify fwds", "trainer records ms (anchors)", "= verify fwds"):
    s.add_column(c, justify="left" if c == "model" else "right")
  for res in results:
    sp = res["slow_path"]
    for vocab, x in (("full vocabulary", sp), ("support only", sp["support"])):
      rp = x["replay_refresh"]
      s.add_row(f"{res['label']}, {res['slow_heads']}, refresh over the {vocab}",
                f"{sp['verify_ms']:.2f}",
                f"{x['refresh_passes_ms']:.1f}", f"{x['refresh_first_step_extra_ms']:.1f}",
                f"{x['refresh_per_step_ms']:.1f}",
                str(sp["records"]), f"{x['refresh_1_step_verify_forwards']:.1f}",
                f"{rp['ms']:.0f}", f"{rp['verify_forwards']:.1f}",
                f"{sp['trainer_records_ms']:.1f} ({sp['anchors']})",
                f"{sp['trainer_records_verify_forwards']:.2f}")
  con.print(s)
  presets = [r for r in results if r["slow_path"].get("preset")]
  if presets:
    per_head, steps, share = _replay_setting()
    p = Table(title=f"The main job's refresh on a small model (SlowPathConfig.for_small_models: "
                    f"{per_head} random valid records per head, {steps} steps x {share:.0%} of "
                    "them, support only, the head mask traced; compile excluded)")
    for c in ("model", "heads", "verify ms", "one head ms", "= verify fwds", "two heads ms",
              "= verify fwds", "one head, chunks of 64 ms"):
      p.add_column(c, justify="left" if c in ("model", "heads") else "right")
    for res in presets:
      x = res["slow_path"]["preset"]
      p.add_row(res["label"], res["slow_heads"], f"{res['slow_path']['verify_ms']:.2f}",
                f"{x['one_head_ms']:.1f}", f"{x['one_head_verify_forwards']:.1f}",
                f"{x['two_heads_ms']:.1f}", f"{x['two_heads_verify_forwards']:.1f}",
                f"{x['one_head_chunks64_ms']:.1f}")
    con.print(p)
  for res in results:
    if res.get("layers_note"):
      con.print(f"{res['label']}: {res['layers_note']}")


if __name__ == "__main__":
  main()
