"""``SpecRoll``, the one object: the vanilla tokens under every plan (Reflex awake and asleep in the
merged tree, a probe), the state it carries (calibration, expected acceptance, store, Reflex), its
plans from a cost model, its checks, and the array-backed store against a plain reference."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax import SpecRoll, SpecRollState, rollout
from specroll_jax.adaptation import store as S
from specroll_jax.adaptation.goodput import CostModel
from specroll_jax.adaptation.slow_path import SlowPathConfig
from specroll_jax.engines.config import SpecConfig
from specroll_jax.heads import conditioned as CH
from specroll_jax.specroll import SpecRollReport

G, M = 4, 16
ONE = SpecConfig(bucket_fractions=(1.0,), node_budget=32, max_nodes=4)  # one bucket: one compile


@pytest.fixture(scope="module")
def setup(trained_model, gsm8k_prompts):
  config, params, tok = trained_model
  heads = CH.init(jax.random.key(0), config, 3, width=32)
  heads = heads.replace(w_o=0.05 * jax.random.normal(jax.random.key(1), heads.w_o.shape))
  sr = SpecRoll(config, max_new_tokens=M, group_size=G, spec=ONE, budget="fixed",
                slow=SlowPathConfig(mode="off"), sampling=rollout.SamplingConfig(temperature=1.0))
  return config, params, tok, heads, sr, gsm8k_prompts[:2]


def _vanilla(config, params, batch, seed):
  return rollout.generate(config, params, batch.tokens, prompt_lengths=batch.lengths,
                          sample_ids=batch.sample_ids, max_new_tokens=M, seed=seed,
                          sampling=rollout.SamplingConfig(temperature=1.0),
                          options=rollout.DecodeOptions(cache_length=batch.cache_length,
                                                        bucket_fractions=(1.0,)))


def test_generate_equals_vanilla_and_carries_the_state(setup):
  """Two batches: Reflex awake in the merged tree (heads + lookup + corrections), then as the
  state says; the same tokens as vanilla both times, and the state moves (calibration counts,
  expected acceptance, the store, the batch counters)."""
  config, params, tok, heads, sr, prompts = setup
  state = sr.init(heads)
  assert isinstance(state, SpecRollState) and int(state.batches) == 0
  batch = sr.batch(prompts, np.array([0, 1]))
  width = batch.tokens.shape[1]  # a power of two: batches of similar prompts share programs
  assert len(batch) == 2 * G and width & (width - 1) == 0 and width // 2 < max(map(len, prompts))
  assert batch.sample_ids.tolist() == list(range(2 * G))
  out, r, st1 = sr.generate(params, batch, state, seed=3)
  van = _vanilla(config, params, batch, 3)
  assert (np.asarray(out.tokens) == np.asarray(van.tokens)).all()
  assert (np.asarray(out.lengths) == np.asarray(van.lengths)).all()
  np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(van.logprobs), atol=1e-4)
  assert isinstance(r, SpecRollReport) and r.mode == "speculative" and r.reflex == "awake"
  assert r.probe_tau == r.tau >= 1.0 and len(r.depth_acceptance) == 6 and r.nodes == (4,)
  assert int(st1.batches) == 1
  assert jax.tree.structure(st1) == jax.tree.structure(state)  # one structure for every batch
  tested = np.asarray(st1.calibration.tested)
  assert tested.sum() > 0 and (np.asarray(st1.calibration.hit) <= tested).all()
  assert np.asarray(st1.expected)[1:].any()
  ids = np.asarray(st1.store.prompt_ids)
  assert sorted(ids[ids >= 0].tolist()) == [0, 1]
  assert (np.asarray(st1.store.count)[ids >= 0] == G).all()
  # the next batch (other prompts, the earlier responses of prompt 1 in the store)
  batch2 = sr.batch([prompts[1], prompts[0]], np.array([1, 5]))
  out2, r2, st2 = sr.generate(params, batch2, st1, seed=4)
  van2 = _vanilla(config, params, batch2, 4)
  assert (np.asarray(out2.tokens) == np.asarray(van2.tokens)).all()
  assert r2.reflex in ("awake", "asleep") and int(st2.batches) == 2
  assert out.decode(tok)[0] == tok.decode(np.asarray(out.tokens)[0, : int(out.lengths[0])]
                                          .tolist()).replace(tok.decode(list(tok.eos_ids)), "")


def test_plans_from_cost_and_acceptance(setup):
  """Goodput's plan: vanilla where no tree pays (a probe every ``probe_every`` batches, on the
  first group, in one bucket), speculative where trees pay; the same choice from any process."""
  config, params, tok, heads, sr, prompts = setup
  sr = dataclasses.replace(sr, budget="goodput", probe_every=2, spec=SpecConfig())
  state = sr.init(heads)
  batch = sr.batch(prompts, np.array([0, 1]))
  linear = CostModel(rows=(8, 1), node_counts=(0, 4), seconds=((1.0, 3.0), (0.2, 0.6)))
  flat = CostModel(rows=(8, 1), node_counts=(0, 4), seconds=((1.0, 1.05), (0.2, 0.21)))
  expected = jnp.asarray(np.linspace(0.0, 1.6, len(np.asarray(state.expected))), jnp.float32)
  st = state.replace(expected=expected)
  sr.use_cost(linear)
  p = sr.plan(st, batch)  # batch 0: a probe
  assert p.mode == "probe" and p.probe_rows == G and p.spec.nodes == (4,)
  assert p.spec.bucket_fractions == (1.0,) and p.reflex == "awake"
  p = sr.plan(st.replace(batches=jnp.int32(1), next_probe=jnp.int32(2)), batch)
  assert p.mode == "vanilla" and p.proposer is None and p.reflex == "idle"
  assert all(c.nodes == 0 for c in p.choice)
  sr.use_cost(flat)
  p = sr.plan(state.replace(expected=expected, batches=jnp.int32(1), next_probe=jnp.int32(2)),
              batch)
  assert p.mode == "speculative" and any(p.spec.nodes) and p.probe_rows == len(batch)
  sr.use_cost(linear)
  p = sr.plan(state, batch)  # nothing measured yet: probe to learn it
  assert p.mode == "probe"


def test_probes_back_off_where_trees_do_not_pay(setup):
  """A probe whose measurement leaves every tree unpaid (a cost model where a tree costs three
  plain steps) puts the next probe twice as far off, up to ``probe_max_every``; the probe's rows
  (and only they) hand the slow path their records; the tokens are vanilla's."""
  config, params, tok, heads, sr, prompts = setup
  sr = dataclasses.replace(sr, budget="goodput", probe_every=2, probe_max_every=3, reflex=None,
                           spec=SpecConfig(bucket_fractions=(1.0,)))
  linear = CostModel(rows=(8, 4), node_counts=(0, 4), seconds=((1.0, 3.0), (0.5, 1.5)))
  state = sr.init(heads)
  sr.use_cost(linear)
  batch = sr.batch(prompts, np.array([0, 1]))
  out, rep, st = sr.generate(params, batch, state, seed=5)
  assert rep.mode == "probe" and rep.probe_tau is not None
  assert (np.asarray(out.tokens) == np.asarray(_vanilla(config, params, batch, 5).tokens)).all()
  assert int(st.probe_gap) == 3 and int(st.next_probe) == 3  # min(2 * 2, 3) batches on
  assert sr.plan(st.replace(batches=jnp.int32(2)), batch).mode == "vanilla"
  assert sr.plan(st.replace(batches=jnp.int32(3)), batch).mode == "probe"


def test_no_compile_after_the_first_batch_whatever_goodput_chooses(setup):
  """Goodput's speculative program switches between ``cost_nodes`` counts per bucket at run
  time: the first batch compiles it (warm-up), and later batches whose choice differs (a tree in
  the small bucket only, then in both) compile nothing; the tokens are vanilla's."""
  config, params, tok, heads, sr, prompts = setup
  sr = dataclasses.replace(sr, budget="goodput", reflex=None,
                           spec=SpecConfig(bucket_fractions=(1.0, 0.5)))
  cost = CostModel(rows=(8, 4), node_counts=(0, 4), seconds=((1.0, 2.0), (0.5, 0.55)))
  state = sr.init(heads)
  sr.use_cost(cost)
  batch = sr.batch(prompts, np.array([0, 1]))
  van = _vanilla(config, params, batch, 7)
  e = lambda x: jnp.asarray(np.r_[0.0, np.full(len(np.asarray(state.expected)) - 1, x)],
                            jnp.float32)
  plan = sr.plan(state.replace(expected=e(0.6)), batch)
  assert plan.counts == ((0, 4), (0, 4))  # both buckets could pay with every node accepted
  steep = cost.__class__(rows=(8, 4), node_counts=(0, 4), seconds=((1.0, 6.0), (0.5, 0.55)))
  sr.use_cost(steep)
  assert sr.plan(state.replace(expected=e(0.6)), batch).counts == ((0,), (0, 4))
  sr.use_cost(cost)
  out, rep, st = sr.generate(params, batch, state.replace(expected=e(0.6)), seed=7)
  assert rep.mode == "speculative" and rep.nodes == (0, 4)
  assert rep.compile_seconds > 0  # the first batch: the warm-up
  sp = out.stats.spec  # the trees' tau: the tokens and row-forwards of the bucket with trees
  fwd = np.asarray(sp.bucket_row_forwards)
  if fwd[1] > 0:
    assert rep.probe_tau == pytest.approx(int(sp.bucket_tokens[1]) / fwd[1])
  assert int(np.asarray(sp.bucket_tokens).sum()) + len(batch) == int(out.stats.tokens)
  for x, nodes in ((3.0, (4, 4)), (0.6, (0, 4))):
    out, rep, _ = sr.generate(params, batch, st.replace(expected=e(x)), seed=7)
    assert rep.nodes == nodes and rep.compile_seconds == 0.0
    assert (np.asarray(out.tokens) == np.asarray(van.tokens)).all()


def test_a_collapse_is_named_and_refits(setup):
  """Head 1 accepting (almost) nothing of its records is a collapse: the report names it in its
  events and the slow path refits every head and starts learning (here: weak random heads and a
  threshold they cannot reach)."""
  config, params, tok, heads, sr, prompts = setup
  sr = dataclasses.replace(sr, reflex=None, slow=SlowPathConfig.for_tests(
      collapse_acceptance=0.9, collapse_records=4, refresh_vocab="support"), records_per_batch=64)
  batch = sr.batch(prompts, np.array([0, 1]))
  out, rep, st = sr.generate(params, batch, sr.init(heads), seed=2)
  assert rep.slow.decision == "collapse" and rep.slow.heads == (0, 1, 2), rep.slow
  assert rep.slow.acceptance[0] < 0.9
  assert rep.slow.learning == bool(int(st.slow.monitor.learning))
  assert rep.events and rep.events[0].startswith("collapse: head 1 accepted")
  assert int(st.slow.monitor.phases) == 1


def test_heads_learned_from_nothing(setup):
  """``init("learn")``: fresh root-conditioned heads (identity at init) that the slow path's
  learning phase fits; refused without one, and a key only goes with it."""
  config, params, tok, heads, sr, prompts = setup
  learn = dataclasses.replace(sr, slow=SlowPathConfig.for_tests(bootstrap_batches=2))
  st = learn.init("learn", key=jax.random.key(3))
  hd = st.heads
  assert isinstance(hd, CH.CondHeads) and hd.num_heads == 3 and not np.asarray(hd.w_o).any()
  assert int(st.slow.monitor.learning) == 1
  with pytest.raises(ValueError, match="learning phase"):
    sr.init("learn")  # the slow path is off
  with pytest.raises(ValueError, match="heads must be heads, None or 'learn'"):
    learn.init("fit")
  with pytest.raises(ValueError, match="key is for init"):
    learn.init(heads, key=jax.random.key(0))


def test_bad_input(setup):
  config, params, tok, heads, sr, prompts = setup
  state = sr.init(heads)
  batch = sr.batch(prompts, np.array([0, 1]))
  other = dataclasses.replace(sr, sampling=rollout.SamplingConfig(temperature=0.7))
  with pytest.raises(ValueError, match="another SpecRoll"):
    other.generate(params, batch, state)
  with pytest.raises(ValueError, match="another SpecRoll"):
    sr.generate(params, batch, dataclasses.replace(sr, group_size=2).init(heads))
  with pytest.raises(ValueError, match="state must be a SpecRollState"):
    sr.generate(params, batch, {"heads": heads})
  with pytest.raises(ValueError, match="group_size 2"):
    sr.generate(params, dataclasses.replace(sr, group_size=2).batch(prompts, [0, 1]), state)
  with pytest.raises(ValueError, match="duplicates"):
    sr.batch(prompts, np.array([3, 3]))
  with pytest.raises(ValueError, match="prompts has 2 entries but prompt_ids 3"):
    sr.batch(prompts, np.array([0, 1, 2]))
  with pytest.raises(ValueError, match="prompt_width=32"):
    dataclasses.replace(sr, prompt_width=32).batch([list(range(1, 40))], [0])
  with pytest.raises(ValueError, match="vocab_size"):
    sr.batch([[1, config.vocab_size]], [0])
  with pytest.raises(ValueError, match="seed"):
    sr.generate(params, batch, state, seed=-1)
  with pytest.raises(ValueError, match="SpecRoll.budget"):
    dataclasses.replace(sr, budget="fast")
  with pytest.raises(ValueError, match="SpecRoll.group_size"):
    dataclasses.replace(sr, group_size=0)
  with pytest.raises(ValueError, match="cost_nodes"):
    dataclasses.replace(sr, cost_nodes=(1, 4))
  with pytest.raises(ValueError, match="proposer_params"):
    sr.init(heads, proposer_params=())
  big = S.store_init(vocab_size=config.vocab_size + 1, prompts=4, per_prompt=2, max_tokens=M)
  with pytest.raises(ValueError, match="vocabulary"):
    sr.generate(params, batch, state.replace(store=big))


class _RefStore:
  """What the store keeps, written plainly: per prompt its last ``per_prompt`` responses cut to
  ``max_tokens``, the least recently added prompts dropped past ``prompts`` after each batch."""

  def __init__(self, per_prompt, max_tokens, prompts):
    import collections
    self.k, self.w, self.n, self.held = per_prompt, max_tokens, prompts, collections.OrderedDict()

  def add(self, pids, prompts, toks, lens):
    import collections
    for i, pid in enumerate(int(p) for p in pids):
      q = self.held.pop(pid, None) or collections.deque(maxlen=self.k)
      q.append(np.asarray(toks[i, : min(int(lens[i]), self.w)]))
      self.held[pid] = q
    while len(self.held) > self.n:
      self.held.popitem(last=False)

  def responses(self, pid):
    return list(self.held.get(int(pid), ()))

  def context(self, pids):
    out = np.full((len(pids), self.k, self.w), -1, np.int32)
    for i, pid in enumerate(pids):
      for j, r in enumerate(reversed(self.responses(pid))):
        out[i, j, : len(r)] = r
    return out


def test_store_state_matches_a_plain_reference():
  """The array-backed store gives the contexts a plain reference gives (newest first, cut to its
  width, least recently written prompt dropped past capacity), and refuses bad input."""
  rng = np.random.default_rng(0)
  ref = _RefStore(per_prompt=3, max_tokens=5, prompts=4)
  st = S.store_init(vocab_size=50, prompts=4, per_prompt=3, max_tokens=5)
  prompts = {p: rng.integers(1, 50, size=rng.integers(1, 6)).tolist() for p in range(7)}
  for _ in range(12):
    pids = rng.choice(7, size=3, replace=False)
    toks = rng.integers(0, 50, size=(3, 8))
    lens = rng.integers(0, 9, size=3)
    ps = [prompts[int(p)] for p in pids]
    ref.add(pids, ps, toks, lens)
    st = S.store_add(st, pids, ps, toks, lens)
    held = [p for p in range(7) if len(ref.responses(p))]
    got = S.store_context(st, held, [prompts[p] for p in held], vocab_size=50)
    np.testing.assert_array_equal(got, ref.context(held))
    assert len(st) == len(held) <= 4
    for p in range(7):
      assert [r.tolist() for r in st.responses(p)] == [r.tolist() for r in ref.responses(p)]
  big = S.store_add(st, np.arange(10, 16), [[1]] * 6, np.ones((6, 2), int), np.full(6, 2))
  assert sorted(np.asarray(big.prompt_ids).tolist()) == [12, 13, 14, 15]  # a batch past capacity
  with pytest.raises(ValueError, match="other prompt tokens"):
    S.store_add(st, [held[0]], [[1, 2, 3, 4, 5, 6, 7]], np.zeros((1, 2), int), np.array([1]))
  with pytest.raises(ValueError, match="vocabulary"):
    S.store_context(st, [0], [prompts[0]], vocab_size=51)
  with pytest.raises(ValueError, match="outside"):
    S.store_add(st, [0], [prompts[0]], np.full((1, 2), 50), np.array([2]))


_OWNER_SCRIPT = """
import functools, hashlib, sys
import jax, numpy as np
import orbax.checkpoint as ocp
from specroll_jax import SpecRoll, models

def mapping(config, params):  # a caller's tree mapping (the tunix backend's is one such partial)
  return params

config = models.ModelConfig.tiny(vocab_size=64)
params = models.init_params(jax.random.key(0), config)
sr = SpecRoll(config, max_new_tokens=4, group_size=2, budget="fixed", eos_ids=(),
              params_from=functools.partial(mapping, config))
print("OWNER", sr.owner(), sr.owner("x"), flush=True)
digest = lambda st: hashlib.sha1(b"".join(np.asarray(x).tobytes()
                                          for x in jax.tree.leaves(st))).hexdigest()
path, batch = sys.argv[1], sr.batch([[1, 2, 3], [4, 5]], np.array([0, 1]))
if sys.argv[2] == "save":  # one batch, then the state to disk
  _, _, state = sr.generate(params, batch, sr.init(None), seed=0)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(path, state)
  ckpt.wait_until_finished()
  print("STATE", digest(state), flush=True)
else:  # restored onto a fresh init's structure, checked by generate, carried on
  target = jax.tree.map(np.asarray, sr.init(None))  # (the store's leaves are host scalars)
  state = ocp.StandardCheckpointer().restore(path, target)
  print("STATE", digest(state), flush=True)
  _, _, state = sr.generate(params, batch, state, seed=1)
  print("NEXT", int(state.batches), flush=True)
"""


def _map_a(config, params):
  return params


def _map_b(config, params):
  return params


def test_owner_is_structural_across_processes(tmp_path):
  """The state's fingerprint is the object's structure (settings, model, head family), never a
  function's address: two processes with ``params_from`` set (as the tunix backend sets it) give
  the same one, and a state one saves (orbax) the other restores and carries on from; another
  mapping, another model in it or other settings give another fingerprint."""
  import functools
  import os
  import subprocess
  import sys
  from pathlib import Path

  from specroll_jax import models
  script = tmp_path / "owner.py"
  script.write_text(_OWNER_SCRIPT)
  env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
         "JAX_PLATFORMS": "cpu"}
  outs = [subprocess.run([sys.executable, str(script), str(tmp_path / "state"), mode],
                         capture_output=True, text=True, timeout=300, env=env)
          for mode in ("save", "restore")]
  assert all(o.returncode == 0 for o in outs), (outs[0].stderr[-2000:], outs[1].stderr[-2000:])
  lines = [[x for x in o.stdout.splitlines() if x.startswith("OWNER")][0] for o in outs]
  assert lines[0] == lines[1], lines
  states = [[x for x in o.stdout.splitlines() if x.startswith("STATE")][0] for o in outs]
  assert states[0] == states[1]  # every leaf restored as saved
  assert "NEXT 2" in outs[1].stdout, outs[1].stdout
  config = models.ModelConfig.tiny(vocab_size=64)
  a = SpecRoll(config, max_new_tokens=4, params_from=functools.partial(_map_a, config))
  same = lambda b: np.array_equal(a.owner(), b.owner())
  assert same(SpecRoll(config, max_new_tokens=4, params_from=functools.partial(_map_a, config)))
  assert not same(SpecRoll(config, max_new_tokens=4,
                           params_from=functools.partial(_map_b, config)))
  assert not same(SpecRoll(config, max_new_tokens=4, params_from=functools.partial(
      _map_a, config.replace(rope_theta=1e6))))
  assert not same(dataclasses.replace(a, max_new_tokens=5))


def test_nonfinite_rows_raise_or_flag():
  """A row whose logits turn NaN stops; ``on_nonfinite="raise"`` (default) raises naming it,
  "flag" warns, marks it in ``stats.nonfinite`` and keeps it out of the state (the store holds
  no response of it), and the next batch runs on."""
  from specroll_jax import models
  config = models.ModelConfig.tiny(vocab_size=64, tie_word_embeddings=False)
  bad = models.init_params(jax.random.key(1), config)
  bad["embed"]["embedding"] = bad["embed"]["embedding"].at[13].set(jnp.nan)
  kw = dict(max_new_tokens=6, group_size=2, budget="fixed", eos_ids=(),
            spec=SpecConfig(bucket_fractions=(1.0,)))
  prompts, ids = [[1, 2, 3], [4, 13, 5]], np.array([0, 1])
  sr = SpecRoll(config, **kw)
  with pytest.raises(FloatingPointError, match=r"non-finite logits in rows \[2, 3\]"):
    sr.generate(bad, sr.batch(prompts, ids), sr.init(None))
  flag = SpecRoll(config, on_nonfinite="flag", **kw)
  with pytest.warns(RuntimeWarning, match=r"rows \[2, 3\]"):
    out, _, state = flag.generate(bad, flag.batch(prompts, ids), flag.init(None))
  nf = np.asarray(out.stats.nonfinite)
  assert nf.tolist()[2:] == [True, True] and np.isfinite(np.asarray(out.logprobs)).all()
  held = state.store
  assert all(len(r) == 0 for r in held.responses(1))  # the flagged prompt's: none kept
  assert [len(r) for r in held.responses(0)] == [6, 6]
  with warnings.catch_warnings():  # (a row may sample token 13 and stop there: flagged too)
    warnings.simplefilter("ignore", RuntimeWarning)
    _, _, state2 = flag.generate(bad, flag.batch([[1, 2], [3, 4]], np.array([2, 3])), state)
  assert int(state2.batches) == 2
  with pytest.raises(ValueError, match="on_nonfinite must be 'raise' or 'flag'"):
    SpecRoll(config, on_nonfinite="ignore", **kw)
