"""The proposer interface: what turns the engine's view of a row into that row's candidate tree.

A proposer has three parts with three lifetimes (docs/design.md, "Proposers: one engine, many ways
to guess"):

* settings: the proposer object itself, a frozen hashable dataclass (a static jit argument);
* parameters: a pytree passed as a traced argument (what the slow path trains between rollout
  batches; changing it never recompiles);
* per-row state: a pytree whose every leaf has a leading rows axis [R, ...]; the engine compacts it
  with its row, so a row's state follows the row across buckets.

Pure functions in the optax form: ``init`` (per-row state for a batch), ``propose`` (each row's
``Tree`` within its node budget, and the state after proposing) and ``update`` (the step's
``Feedback``; returns the new state and a pytree of statistics the engine sums over all steps).
Whatever a proposer proposes, the committed tokens are the target's own samples: a proposer
changes speed, never the output, as long as its trees keep the rules of ``Tree`` (the engine checks
their shapes and dtypes at trace time, ``proposers.contract``).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
from jaxtyping import Array, Bool, Float, Int, PyTree, UInt32

from specroll_jax.models.config import ModelConfig
from specroll_jax.proposers.tree import Tree
from specroll_jax.sampling import SamplingConfig


@flax.struct.dataclass
class Target:
  """The model being sampled (frozen during a rollout): what proposers may read (e.g. the final
  norm and the shared unembedding) and how it samples."""

  config: ModelConfig = flax.struct.field(pytree_node=False)
  params: PyTree
  sampling: SamplingConfig = flax.struct.field(pytree_node=False, default=SamplingConfig())


@flax.struct.dataclass
class RowsInit:
  """What ``init`` sees for each row of a new batch (every leaf [R, ...])."""

  prompt_tokens: Int[Array, "R P"]  # right-padded prompts
  prompt_lengths: Int[Array, " R"]
  sample_ids: Int[Array, " R"]  # global response ids (noise coordinates)
  row: Int[Array, " R"]  # row index in the batch the engine was called with
  first_token: Int[Array, " R"]  # the first response token (the first root)
  hidden: Float[Array, "R D"]  # pre-norm hidden at the last prompt token (the first root's anchor)


@flax.struct.dataclass
class ProposeInput:
  """The engine's view of each row when a tree is wanted (every leaf [R, ...])."""

  hidden: Float[Array, "R D"]  # target's last pre-norm hidden state (anchor of the root, at L - 1)
  root: Int[Array, " R"]  # the root token at position L: sampled already, not yet in the KV cache
  position: Int[Array, " R"]  # L, the root's absolute position
  history: Int[Array, "R C"]  # token at each position 0..C-1 (prompt + response); [r, L] = root;
  #                              -1 where not known yet
  budget: Int[Array, " R"]  # nodes (root excluded) this row may use; 0 for finished rows
  row: Int[Array, " R"]  # the slot's row in the batch the engine was called with (under
  #                        shard_map: this shard's batch); never the slot, which compaction moves
  sample_ids: Int[Array, " R"]
  # The whole batch so far, by row (not compacted: finished rows included), for proposers that
  # read other rows' text (e.g. a row's GRPO siblings): responses[b, j] is row b's response token
  # j, valid for j < response_lengths[b].
  responses: Int[Array, "B M"] | None = None
  response_lengths: Int[Array, " B"] | None = None
  # The rollout's noise seed, per row (the same value in every row): with ``position`` and
  # ``sample_ids`` it gives the Gumbel noise the target adds at any future position
  # (``sampling.gumbel_noise``), for drafts coupled to it (``sampling.draft_keys``).
  seed: UInt32[Array, " R"] | None = None


def coupled_with(target: Target, inp: ProposeInput, coupled: bool, owner: str) -> bool:
  """Whether ``owner``'s drafts for this step rank coupled to the target's noise: ``coupled`` and
  T > 0 (greedy sampling adds no noise). ValueError when they would but ``inp.seed`` is None (a
  ``ProposeInput`` built by hand; the engine always passes the seed)."""
  on = bool(coupled) and not target.sampling.greedy
  if on and inp.seed is None:
    raise ValueError(f"{owner}(coupled=True) needs ProposeInput.seed, the rollout's noise seed "
                     "per row (the engine passes it; set it when building a ProposeInput by "
                     f"hand, or use {owner}(coupled=False))")
  return on


@flax.struct.dataclass
class Feedback:
  """What one verify forward decided, for ``update`` (every leaf [R, ...]). D1 = max depth + 1.

  tokens[:, j] is the target's sample at path node j, at absolute position position + 1 + j; the
  first path_len - 1 of them equal the accepted nodes' tokens, the last is the next root. ``keep``
  marks those emitted: a prefix of j < path_len, cut after an EOS, at the length limit and at
  non-finite logits; all False for inactive rows.
  """

  tree: Tree  # the verified tree [R, N1]
  target_tokens: Int[Array, "R N1"]  # the target's sample at every node
  accepted: Bool[Array, "R N1"]
  path: Int[Array, "R D1"]  # node index of the accepted path at each depth
  path_len: Int[Array, " R"]  # D + 1 (0 for rows that were not active)
  tokens: Int[Array, "R D1"]  # committed tokens (valid where keep)
  keep: Bool[Array, "R D1"]
  position: Int[Array, " R"]  # L, the root's position (tokens[:, j] sits at L + 1 + j)
  hidden: Float[Array, "R D"]  # the hidden state the tree was proposed from (anchor of the root)
  path_hidden: Float[Array, "R D1 D"]  # pre-norm hidden at each path node (anchor of tokens[j])
  active: Bool[Array, " R"]  # the row took part in this step
  done: Bool[Array, " R"]  # the row is finished after this step
  row: Int[Array, " R"]
  sample_ids: Int[Array, " R"]
  # Only when the proposer sets feedback_topm = m > 0: the target's sampling distribution at each
  # path node (the distribution tokens[:, j] was drawn from): its top-m ids and log-probabilities,
  # the logsumexp of its tempered (top-k/top-p restricted) logits and the restriction's floor, so
  # a proposer can get the exact probability of any other id from path_hidden: exp(logit - lse)
  # where the tempered logit is at least ``floor``, else 0. Never [R, N, V].
  topm_ids: Int[Array, "R D1 M"] | None = None
  topm_logprobs: Float[Array, "R D1 M"] | None = None
  lse: Float[Array, "R D1"] | None = None
  floor: Float[Array, "R D1"] | None = None
  history: Int[Array, "R C"] | None = None  # the row's tokens by position after this commit


@flax.struct.dataclass
class RowsShared:
  """A proposer state in two parts: ``rows`` (every leaf [R, ...], compacted with the batch's
  rows) and ``shared`` (state across rows, e.g. per GRPO group or a record buffer). Unpacks as
  ``rows, shared = state``."""

  rows: PyTree
  shared: PyTree

  def __iter__(self):
    return iter((self.rows, self.shared))


@dataclasses.dataclass(frozen=True)
class Proposer:
  """Base class of proposers (frozen dataclass = the settings). Subclasses override the methods;
  docs/custom_proposer.md has a worked example.

  max_depth: deepest node a tree can have (static). capacity: most nodes (root excluded) a tree can
  usefully hold; the engine never gives a row more. feedback_topm: m > 0 asks the engine for the
  target's top-m logits at the committed path positions in ``Feedback`` (never [R, N, V]).

  **Positions.** The prefill samples each row's first response token (``RowsInit.first_token``)
  from the hidden state at the last prompt token. It sits at absolute position ``prompt_length``
  and is the first tree's root; nobody proposes it. Response token j sits at position
  ``prompt_length + j``. At every step the root (position L) is a target sample that is emitted
  but not yet in the KV cache, and a tree node at depth d guesses the token at position L + d.

  **ProposeInput** (R = the bucket's slots, not the batch; compaction moves rows between slots, so
  read ``row`` and never the slot index):

  * ``hidden``: the target's pre-norm hidden state at L - 1, the state the root was sampled from
    (``models.logits_from_hidden(target.config, target.params, hidden)`` gives those logits).
  * ``root``: the root token at L; ``position``: L.
  * ``history[r, p]``: the row's token at position p (prompt, then response) for p <= L, with
    ``history[r, L] == root``; -1 beyond L.
  * ``budget``: the most valid non-root nodes this row may use: ``num_nodes`` for an active row, 0
    for a finished one (its tree is verified by the forward that runs anyway and emits nothing).
  * ``row``: the row in the batch the engine was called with; ``sample_ids``: its response id.
  * ``responses[b, j]``, ``response_lengths[b]``: the whole batch's responses so far, by row
    (finished rows included), for proposers that read other rows' text.
  * ``seed``: the rollout's noise seed (per row). The target's token at position L + d is
    ``argmax_v(tempered logits_v + Gumbel(seed, sample id, L + d, v))``, so a drafter that ranks
    its candidates for depth d by its own tempered logits plus that same noise
    (``sampling.draft_keys(..., positions=position + d, coupled=True)``) guesses the target's
    sample far more often at T > 0 than one ranking by its probabilities alone.

  **propose** returns each row's ``Tree`` of exactly ``num_nodes`` nodes besides the root (static;
  the engine never calls it with 0, since an N = 0 bucket runs the plain decode step), and the
  state after proposing. The rules a tree must satisfy are listed once, in the ``Tree`` docstring
  (``specroll_jax.proposers.tree.Tree``). Shapes and dtypes are checked at trace time. Breaking a
  rule on values costs speed, stops the row (a token outside the vocabulary) or, for the root, mask
  and depth rules, breaks exactness.

  **Feedback** (to ``update``): ``tokens[:, j]`` is the target's sample at path node j and sits at
  position ``position + 1 + j``. The first ``path_len - 1`` of them are the accepted nodes'
  tokens and the last, ``tokens[:, path_len - 1]``, is the next root. ``keep[:, j]`` marks the
  tokens actually emitted: a prefix of j < path_len, cut after an EOS, at ``max_new_tokens`` and
  at the first non-finite logits, and all False for a row that was not active. Only kept tokens
  enter the response and ``Feedback.history``. ``path_len`` is 0 for inactive rows.

  **State.** ``init``'s per-row part (``split_state(state)[0]``) has a leading rows axis of the
  batch's row count in every leaf; the engine compacts it with its row. ``propose`` and ``update``
  return states with the structure, shapes and dtypes of the state they were given (the rollout
  loop carries it), and ``update``'s statistics add onto ``init_stats()`` without changing its
  shapes or dtypes. The engine checks all of this at trace time (``proposers.contract``) and
  raises ValueError naming the proposer, the method and the field.
  """

  @property
  def max_depth(self) -> int:
    raise NotImplementedError

  @property
  def capacity(self) -> int:
    raise NotImplementedError

  @property
  def feedback_topm(self) -> int:
    return 0

  def validate(self, config: ModelConfig, params: PyTree) -> None:
    """Raise ValueError when ``params`` do not fit the model (before tracing)."""

  def validate_batch(self, config: ModelConfig, params: PyTree, prompt_tokens, prompt_lengths,
                     sample_ids) -> None:
    """Raise ValueError when ``params`` do not fit this batch (host numpy arrays, before
    tracing; e.g. per-row parameters of the wrong length)."""

  def init(self, target: Target, params: PyTree, rows: RowsInit) -> PyTree:
    """State for a new batch; () when the proposer has none. By default every leaf is per row
    ([R, ...] with R = the batch's rows, checked at trace time); see ``split_state`` for state
    shared across rows."""
    return ()

  def split_state(self, state: PyTree) -> tuple[PyTree, PyTree]:
    """(per-row part, shared part) of a state. The engine compacts only the per-row part (every
    leaf [R, ...]); the shared part (e.g. state per GRPO group, or a record buffer) stays as is.
    Default: all of it is per row."""
    return state, ()

  def join_state(self, rows: PyTree, shared: PyTree) -> PyTree:
    """Inverse of ``split_state``."""
    return rows

  def propose(self, target: Target, params: PyTree, state: PyTree, inp: ProposeInput, *,
              num_nodes: int) -> tuple[Tree, PyTree]:
    """Each row's tree of ``num_nodes`` nodes (static) besides the root, at most ``inp.budget``
    of them valid, depth <= ``max_depth`` (every rule: ``Tree``); and the state after proposing
    (same structure, shapes and dtypes)."""
    raise NotImplementedError

  def update(self, target: Target, params: PyTree, state: PyTree,
             fb: Feedback) -> tuple[PyTree, PyTree]:
    """(new per-row state, statistics of this step) from the step's feedback. Statistics are a
    pytree of arrays without a rows axis; the engine adds them up over the rollout. Called after
    every step of a bucket with N > 0: after the verify forward, or, when a gated step ran the
    plain decode step instead, with a root-only tree (nothing was tested; the committed token and
    its distribution are still reported). A bucket with N = 0 proposes nothing and calls no
    ``update``; what a proposer still has pending then never matures."""
    return state, self.init_stats()

  def expected_gain(self, state: PyTree, num_nodes: int):
    """[R] expected accepted nodes of each row's last proposed tree of ``num_nodes`` nodes, or None
    when the proposer has no estimate (then a gated bucket always verifies)."""
    return None

  def init_stats(self) -> PyTree:
    """Zeros of the statistics ``update`` returns ({} when there are none): a struct of arrays
    without a rows axis (``ReflexStats``, ``TreeStats``, ``LookupStats``: ``results.Summed``)
    that adds up leaf by leaf."""
    return {}


def stats_dict(stats: PyTree) -> dict:
  """A proposer's statistics as {field path: numpy array} for reports and logs."""
  import numpy as np
  return {jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(v)
          for path, v in jax.tree_util.tree_flatten_with_path(stats)[0]}

