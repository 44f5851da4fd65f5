"""docs/custom_proposer.md runs as written (its python blocks, in order: a proposer written against
``proposers.Proposer`` gives plain decoding's tokens through ``SpecRoll``, through the engine
inside a caller's ``jax.jit`` and through ``rollout.generate(speculation=...)``), and what it says
holds (at T = 1; a ranked proposer is calibrated by ``SpecRoll``). The engine's trace-time
contract checks (``proposers.contract``) refuse a broken proposer with a ValueError naming the
proposer, the method and the field; the broken proposers fail while tracing, before anything
compiles."""

import dataclasses
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specroll_jax import SpecRoll, rollout
from specroll_jax.proposers import GroupLookup, Proposer
from specroll_jax.proposers import tree as T
from specroll_jax.rollout import SpecConfig, Speculation

DOC = Path(__file__).resolve().parents[1] / "docs" / "custom_proposer.md"
ONE_BUCKET = SpecConfig(bucket_fractions=(1.0,))


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(first line number, source) of every ```python block of a markdown text."""
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
          for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.M | re.S)]


@pytest.fixture(scope="module")
def doc():
  """The namespace after the doc's python blocks ran, in order, with every DeprecationWarning an
  error (the doc teaches no keyword on its way out)."""
  blocks = python_blocks(DOC.read_text())
  assert len(blocks) >= 3
  ns = {"__name__": "custom_proposer_doc"}
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    for line, src in blocks:  # padded so that a traceback names the markdown line
      exec(compile("\n" * (line - 1) + src, str(DOC), "exec"), ns)
  return ns


def test_doc_code_runs(doc):
  out, report, plain, fast, ref = (doc[k] for k in ("out", "report", "plain", "fast", "ref"))
  assert report.mode == "speculative" and report.tau > 1.5  # SpecRoll verified trees
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
  assert int(out.stats.spec.proposer.accepted) > 0  # the proposer's statistics came back
  assert fast.stats.tokens_per_forward > 1.5  # the engine in the caller's jit: trees accepted
  np.testing.assert_array_equal(np.asarray(fast.tokens), np.asarray(ref.tokens))
  np.testing.assert_array_equal(np.asarray(doc["once"].tokens), np.asarray(fast.tokens))


def test_doc_proposer_at_temperature_one(doc):
  """The doc's proposer through SpecRoll at T = 1 (GRPO's sampling, G = 4): plain decoding's
  tokens, whatever it guesses."""
  config, params, prompts = doc["config"], doc["params"], doc["prompts"]
  sampling = rollout.SamplingConfig(temperature=1.0)
  sr = SpecRoll(config, proposer=doc["LastBigram"](), sampling=sampling, group_size=4,
                max_new_tokens=16, budget="fixed", spec=ONE_BUCKET)
  batch = sr.batch(prompts, np.array([7, 3, 11]))
  out, report, _ = sr.generate(params, batch, sr.init(proposer_params=()), seed=5)
  plain = rollout.generate(config, params, [p for p in prompts for _ in range(4)],
                           sampling=sampling, max_new_tokens=16, sample_ids=batch.sample_ids,
                           seed=5, options=rollout.DecodeOptions(bucket_fractions=(1.0,)))
  assert report.mode == "speculative"
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
  np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(plain.lengths))


def test_ranked_proposer_is_calibrated(doc):
  """What the doc says of a ranked proposer given to SpecRoll: its table starts at
  ``default_acceptance()``, a batch's ``TreeStats`` update it, the next batch's parameters carry
  it in their ``acceptance`` field, and the expected acceptance goodput weighs is measured."""
  config, params, prompts = doc["config"], doc["params"], doc["prompts"]
  gl = GroupLookup(group_size=2)
  sr = SpecRoll(config, proposer=gl, sampling=doc["sampling"], group_size=2, max_new_tokens=24,
                budget="fixed", spec=ONE_BUCKET)
  state = sr.init(proposer_params=gl.context())
  np.testing.assert_allclose(np.asarray(state.calibration.table()),
                             gl.default_acceptance().reshape(-1), rtol=1e-6)
  batch = sr.batch(prompts, np.arange(3))
  _, report, state = sr.generate(params, batch, state, seed=0)
  assert report.mode == "speculative"
  assert float(np.asarray(state.calibration.tested).sum()) > 0  # the batch's counts went in
  assert np.asarray(state.expected)[1:].any()  # what goodput weighs
  table = np.asarray(state.calibration.table())
  assert not np.allclose(table, gl.default_acceptance().reshape(-1))
  plan = sr.plan(state, batch)
  pp = sr.proposer_params(state, batch, plan)
  np.testing.assert_array_equal(np.asarray(pp.acceptance), table.reshape(gl.acceptance_shape))


# ---------------------------------------------------------------------------------------------
# One broken proposer per contract violation


@dataclasses.dataclass(frozen=True)
class RootChain(Proposer):
  """A correct proposer (the root repeated, with a per-row counter) that the broken ones below
  change in one place each."""

  @property
  def max_depth(self):
    return 2

  @property
  def capacity(self):
    return 2

  def init(self, target, params, rows):
    return {"count": jnp.zeros((rows.row.shape[0],), jnp.int32)}

  def propose(self, target, params, state, inp, *, num_nodes):
    toks = jnp.stack([inp.root, inp.root], axis=1)
    return T.chain(inp.root, toks, jnp.minimum(inp.budget, 2), num_nodes=num_nodes), state

  def update(self, target, params, state, fb):
    return {"count": state["count"] + fb.active}, {"steps": fb.active.sum().astype(jnp.int32)}

  def init_stats(self):
    return {"steps": jnp.int32(0)}


@dataclasses.dataclass(frozen=True)
class WideTokens(RootChain):
  def propose(self, target, params, state, inp, *, num_nodes):
    tr, state = super().propose(target, params, state, inp, num_nodes=num_nodes)
    return tr.replace(tokens=jnp.pad(tr.tokens, ((0, 0), (0, 3)))), state  # mask stays [R, 3, 3]


@dataclasses.dataclass(frozen=True)
class TooManyNodes(RootChain):
  def propose(self, target, params, state, inp, *, num_nodes):
    tr, state = super().propose(target, params, state, inp, num_nodes=num_nodes)
    return T.pad(tr, num_nodes + 2), state  # consistent, but larger than num_nodes


@dataclasses.dataclass(frozen=True)
class IntValid(RootChain):
  def propose(self, target, params, state, inp, *, num_nodes):
    tr, state = super().propose(target, params, state, inp, num_nodes=num_nodes)
    return tr.replace(valid=tr.valid.astype(jnp.int32)), state


@dataclasses.dataclass(frozen=True)
class NotATree(RootChain):
  def propose(self, target, params, state, inp, *, num_nodes):
    tr, state = super().propose(target, params, state, inp, num_nodes=num_nodes)
    return tr.tokens, state


@dataclasses.dataclass(frozen=True)
class NoRowsAxis(RootChain):
  def init(self, target, params, rows):
    return {"count": jnp.zeros((rows.row.shape[0],), jnp.int32), "total": jnp.int32(0)}


@dataclasses.dataclass(frozen=True)
class ReshapingUpdate(RootChain):
  def update(self, target, params, state, fb):
    state, stats = super().update(target, params, state, fb)
    return {"count": state["count"][:, None]}, stats


@dataclasses.dataclass(frozen=True)
class RetypingPropose(RootChain):
  def propose(self, target, params, state, inp, *, num_nodes):
    tr, state = super().propose(target, params, state, inp, num_nodes=num_nodes)
    return tr, {"count": state["count"].astype(jnp.float32)}


@dataclasses.dataclass(frozen=True)
class FloatStats(RootChain):
  def update(self, target, params, state, fb):
    state, stats = super().update(target, params, state, fb)
    return state, {"steps": stats["steps"].astype(jnp.float32)}


BROKEN = [
    (WideTokens(), r"WideTokens\.propose returned Tree\.tokens of \(2, 6\) int32; expected "
                   r"\(2, 3\) int32.*num_nodes=2"),
    (TooManyNodes(), r"TooManyNodes\.propose returned Tree\.tokens of \(2, 5\) int32; expected "
                     r"\(2, 3\).*never more nodes than num_nodes"),
    (IntValid(), r"IntValid\.propose returned Tree\.valid of \(2, 3\) int32; expected \(2, 3\) "
                 r"bool"),
    (NotATree(), r"NotATree\.propose must return \(specroll_jax\.proposers\.Tree, state\), got a "
                 r"\w+"),
    (NoRowsAxis(), r"NoRowsAxis\.init returned per-row state leaf state\['total'\] of shape \(\) "
                   r"int32.*leading rows axis of 2"),
    (ReshapingUpdate(), r"ReshapingUpdate\.update returned state leaf state\['count'\] of \(2, 1\) "
                        r"int32; expected \(2,\) int32"),
    (RetypingPropose(), r"RetypingPropose\.propose returned state leaf state\['count'\] of \(2,\) "
                        r"float32; expected \(2,\) int32"),
    (FloatStats(), r"FloatStats\.update returned statistic stats\['steps'\] of \(\) float32; "
                   r"init_stats\(\) has \(\) int32"),
]


@pytest.mark.parametrize("proposer,message", BROKEN,
                         ids=[type(p).__name__ for p, _ in BROKEN])
def test_contract_violation_names_proposer_and_field(random_model, proposer, message):
  config, params = random_model
  with pytest.raises(ValueError, match=message):
    rollout.generate(config, params, [[1, 2, 3, 4, 5], [7, 8, 9]], max_new_tokens=8,
                     speculation=Speculation(proposer, (), ONE_BUCKET))


# ---------------------------------------------------------------------------------------------
# Rules on values the engine enforces (tree.sanitize): a bad tree is slow, never wrong


MODES = ("ok", "eye", "depth", "root", "orphan")


@dataclasses.dataclass(frozen=True)
class Oracle(Proposer):
  """Proposes the vanilla continuation (params: each row's prompt + vanilla response, and which
  rule of ``Tree`` to break, an index into MODES: traced, so every mode runs in one compiled
  program). The proposals would be accepted, so a tree verified in the wrong context would commit
  other tokens."""

  @property
  def max_depth(self):
    return 3

  @property
  def capacity(self):
    return 3

  def propose(self, target, params, state, inp, *, num_nodes):
    seq, mode = params
    at = jnp.clip(inp.position[:, None] + 1 + jnp.arange(3)[None], 0, seq.shape[1] - 1)
    toks = jnp.take_along_axis(seq[inp.row], at, axis=1)
    tr = T.chain(inp.root, toks, jnp.minimum(inp.budget, 3), num_nodes=num_nodes)
    eye = jnp.broadcast_to(jnp.eye(num_nodes + 1, dtype=bool), tr.mask.shape)
    broken = (
        tr,
        tr.replace(mask=eye),  # rule 2: no ancestors in the mask
        tr.replace(depth=jnp.minimum(tr.depth, 1)),  # rule 3: every node at depth 1
        tr.replace(tokens=tr.tokens.at[:, 0].set((inp.root + 1) % 256)),  # rule 1: another root
        tr.replace(valid=tr.valid.at[:, 1].set(False)),  # rule 4: a valid node, invalid parent
    )
    return jax.tree.map(lambda *xs: jnp.stack(xs)[mode], *broken), state


def test_trees_breaking_the_rules_still_give_the_vanilla_tokens(random_model):
  config, params = random_model
  prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14], [20, 21]]
  kw = dict(max_new_tokens=12, seed=3, sampling=rollout.SamplingConfig(temperature=1.0))
  ref = rollout.generate(config, params, prompts, **kw)
  seq = np.zeros((4, 64), np.int32)
  for i, p in enumerate(prompts):
    full = p + np.asarray(ref.tokens)[i, : int(ref.lengths[i])].tolist()
    seq[i, : len(full)] = full
  taus = {}
  for i, mode in enumerate(MODES):
    oracle = Speculation(Oracle(), (jnp.asarray(seq), jnp.int32(i)),
                         SpecConfig(node_budget=12, bucket_fractions=(1.0,)))
    got = rollout.generate(config, params, prompts, speculation=oracle, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens), err_msg=mode)
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths), err_msg=mode)
    taus[mode] = got.stats.tokens_per_forward
  assert taus["ok"] > 2.5, taus  # the oracle is accepted: the rules were enforced, not skipped
  assert taus["eye"] == taus["depth"] == taus["root"] == taus["ok"], taus  # rebuilt: same tree
  assert taus["orphan"] < taus["ok"], taus  # the orphaned nodes were dropped: slower
