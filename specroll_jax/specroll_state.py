"""The types ``SpecRoll`` carries between its steps: the batch in GRPO shape, the state that
outlives a batch (a pytree), the plan of one batch, an engine whose parameters are mapped inside
its program, and where parameters are placed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PyTree

from specroll_jax import adaptation as _adapt
from specroll_jax import calibration as _cal
from specroll_jax import goodput as _goodput
from specroll_jax import store as _store
from specroll_jax.config import SpecConfig
from specroll_jax.proposers import Proposer
from specroll_jax.rollout import PreparedBatch


@dataclasses.dataclass(frozen=True)
class GroupBatch:
  """P prompts in GRPO shape: each prompt's G rows (prompt-major), sample id = prompt id * G +
  member (``sampling.group_sample_ids``). ``rows``: the validated, padded rows."""

  rows: PreparedBatch
  prompt_ids: np.ndarray  # [P] int
  group_size: int

  @property
  def tokens(self) -> np.ndarray:
    """[P * G, W] right-padded prompt tokens of every row."""
    return self.rows.tokens

  @property
  def lengths(self) -> np.ndarray:
    return self.rows.lengths

  @property
  def sample_ids(self) -> np.ndarray:
    return self.rows.sample_ids

  @property
  def row_prompt_ids(self) -> np.ndarray:
    return np.repeat(self.prompt_ids, self.group_size)

  def row_prompts(self, rows=slice(None)) -> list[np.ndarray]:
    """Each row's prompt tokens (unpadded), for the rows ``rows``."""
    idx = np.arange(len(self))[rows]
    return [self.tokens[i, : self.lengths[i]] for i in idx]

  def __len__(self) -> int:
    return int(self.rows.tokens.shape[0])


@flax.struct.dataclass
class SpecRollState:
  """What outlives a rollout batch (a pytree: orbax checkpoints it as is).

  adaptation: the heads, Reflex's global safety and sleep, the slow path's monitor, reservoir and
    optimiser (None without heads). proposer_params: a custom proposer's parameters (None for the
    default). calibration: the acceptance table of the ranked tree (None for an unranked custom
    proposer). expected [Nr]: expected accepted nodes per row-step with the best n nodes, as
    measured so far (what goodput weighs; zeros until a tree was verified). store: earlier
    responses per prompt (None: no store). batches: rollout batches so far. next_probe /
    probe_gap: where goodput verifies no tree, the first batch that probes and the batches
    between probes (``SpecRoll.probe_every``, doubling up to ``probe_max_every`` while probes
    find nothing that pays and no learning phase runs). cost: the machine's
    measured step cost (static; measured at the first goodput batch, cached on disk). owner: the
    fingerprint of the ``SpecRoll`` settings and model this state belongs to (static).
  """

  adaptation: _adapt.AdaptationState | None
  proposer_params: PyTree
  calibration: _cal.Calibration | None
  expected: Float[Array, " Nr"]
  store: _store.StoreState | None
  batches: Int[Array, ""]
  next_probe: Int[Array, ""]
  probe_gap: Int[Array, ""]
  cost: _goodput.CostModel | None = flax.struct.field(pytree_node=False, default=None)
  owner: str = flax.struct.field(pytree_node=False, default="")


@dataclasses.dataclass(frozen=True)
class Plan:
  """How ``generate`` rolls out one batch (host decisions, static).

  mode: "speculative" (every row through the speculative engine with ``spec``), "vanilla" (the
  compacting vanilla engine: goodput verifies no tree) or "probe" (the first ``probe_rows`` rows
  speculative with ``spec``, the rest vanilla). reflex: "awake", "asleep" or "off".
  """

  mode: str
  spec: SpecConfig | None
  proposer: Proposer | None
  probe_rows: int
  reflex: str
  choice: tuple[_goodput.BucketChoice, ...] = ()
  counts: tuple[tuple[int, ...], ...] | None = None  # goodput's program: the node counts each
  #   bucket fraction can switch between at run time (``SpecConfig.choices``)


@dataclasses.dataclass(frozen=True)
class Mapped:
  """An engine whose parameters come through ``params_from`` inside its compiled program."""

  engine: Callable
  params_from: Callable

  def __call__(self, params, *rest):
    return self.engine(self.params_from(params), *rest)


def with_table(params, table):
  """A custom ranked proposer's parameters with the calibrated table (where they hold one)."""
  if hasattr(params, "acceptance"):
    return params.replace(acceptance=jnp.asarray(table, jnp.float32).reshape(
        np.shape(params.acceptance)))
  return params


def head_rows(rows: PreparedBatch, k: int) -> PreparedBatch:
  """The first ``k`` rows of a prepared batch."""
  return PreparedBatch(rows.tokens[:k], rows.lengths[:k], rows.sample_ids[:k], rows.eos_ids,
                       rows.cache_length)


def place(params, mesh=None):
  """The parameters on this process's first device (one placement for every call: a parameter
  tree that left a train step replicated over a mesh compiles no second rollout); with ``mesh``
  (a ``ModelMesh``: SpecRoll's rollout mesh) replicated on its devices instead."""
  if mesh is not None:
    return mesh.replicate(params)
  dev = jax.local_devices()[0]

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if not x.sharding.is_fully_replicated:
        raise ValueError(f"a parameter of shape {x.shape} is split over several processes "
                         f"({x.sharding}); SpecRoll decodes each process's rows on its own device "
                         "and needs every parameter whole in every process (replicated)")
      x = x.addressable_data(0)
    return jax.device_put(x, dev)

  return jax.tree.map(one, params)



__all__ = ["GroupBatch", "Mapped", "Plan", "SpecRollState", "head_rows", "place", "with_table"]
