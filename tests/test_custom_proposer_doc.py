"""docs/custom_proposer.md runs as written (its python blocks, in order: a proposer written against
``proposers.Proposer`` gives vanilla's tokens), and the engine's trace-time contract checks
(``proposers.contract``) refuse a broken proposer with a ValueError naming the proposer, the
method and the field. The broken proposers fail while tracing, before anything compiles."""

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from specroll_jax import rollout
from specroll_jax import tree as T
from specroll_jax.proposers import Proposer
from specroll_jax.rollout import SpecConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "custom_proposer.md"


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(first line number, source) of every ```python block of a markdown text."""
  return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
          for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.M | re.S)]


def test_doc_code_runs():
  blocks = python_blocks(DOC.read_text())
  assert len(blocks) >= 2
  ns = {"__name__": "custom_proposer_doc"}
  for line, src in blocks:  # padded so that a traceback names the markdown line
    exec(compile("\n" * (line - 1) + src, str(DOC), "exec"), ns)
  assert ns["spec"].stats.tokens_per_forward > 1.5


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
                     proposer=proposer, proposer_params=(),
                     spec=SpecConfig(bucket_fractions=(1.0,)))


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
  import numpy as np
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
    got = rollout.generate(config, params, prompts, proposer=Oracle(),
                           proposer_params=(jnp.asarray(seq), jnp.int32(i)),
                           spec=SpecConfig(node_budget=12, bucket_fractions=(1.0,)), **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens), err_msg=mode)
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths), err_msg=mode)
    taus[mode] = got.stats.tokens_per_forward
  assert taus["ok"] > 2.5, taus  # the oracle is accepted: the rules were enforced, not skipped
  assert taus["eye"] == taus["depth"] == taus["root"] == taus["ok"], taus  # rebuilt: same tree
  assert taus["orphan"] < taus["ok"], taus  # the orphaned nodes were dropped: slower
