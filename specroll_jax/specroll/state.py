"""The types ``SpecRoll`` carries between its steps: the state that outlives a batch (a pytree),
the plan of one batch, an engine whose parameters are mapped inside its program, and where
parameters are placed."""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PyTree, UInt32

from specroll_jax.adaptation import calibration as _cal
from specroll_jax.adaptation import goodput as _goodput
from specroll_jax.adaptation import store as _store
from specroll_jax.adaptation.reflex import ReflexGlobal
from specroll_jax.adaptation.slow_path import SlowPathState
from specroll_jax.engines.config import SpecConfig
from specroll_jax.proposers import Proposer


@flax.struct.dataclass
class SpecRollState:
  """What outlives a rollout batch: one flat pytree of arrays (orbax checkpoints it as is; its
  tree structure never changes between batches).

  heads: the future-token heads (``cond_heads.CondHeads`` or ``heads.Heads``; None: none).
  reflex: Reflex's global safety per head and its sleep (None: no Reflex on these heads).
  slow: the slow path's monitor, records reservoir and optimiser (None: no heads, or the slow
    path off). proposer_params: a custom proposer's parameters (None for the default).
  calibration: the acceptance table of the ranked tree (None for an unranked custom proposer).
  expected [Nr]: accepted nodes per row-step with the best n nodes, an exponential average over
    the batches that verified trees (``SpecRoll.calibration_decay``; zeros until one did): what
    goodput weighs. store: earlier responses per prompt (None: no store). batches: rollout
    batches so far. next_probe / probe_gap: where goodput verifies no tree, the first batch that
    probes and the batches between probes. owner [2]: the fingerprint of the ``SpecRoll``
    settings, model and head family this state belongs to (``fingerprint``).
  """

  heads: Any
  reflex: ReflexGlobal | None
  slow: SlowPathState | None
  proposer_params: PyTree
  calibration: _cal.Calibration | None
  expected: Float[Array, " Nr"]
  store: _store.StoreState | None
  batches: Int[Array, ""]
  next_probe: Int[Array, ""]
  probe_gap: Int[Array, ""]
  owner: UInt32[Array, " 2"]


class Mode(enum.StrEnum):
  """How a batch rolls out: every row through the speculative engine, the compacting vanilla
  engine (goodput verifies no tree), or vanilla with the first groups also speculative (a probe
  that measures acceptance)."""

  SPECULATIVE = "speculative"
  VANILLA = "vanilla"
  PROBE = "probe"


class ReflexMode(enum.StrEnum):
  """Reflex in a batch: correcting the heads, asleep (the plain heads propose), idle (no tree
  this batch) or off (no Reflex on these heads)."""

  AWAKE = "awake"
  ASLEEP = "asleep"
  IDLE = "idle"
  OFF = "off"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """How ``SpecRoll.generate`` rolls out one batch (host decisions, static).

  mode: ``Mode``. spec: the speculative engine's buckets and nodes (None: vanilla). proposer:
  what proposes (None: vanilla). probe_rows: the rows through the speculative engine (all in
  speculative mode, the first groups in a probe, 0 in vanilla). reflex: ``ReflexMode``. choice:
  goodput's reasoning per bucket. counts: goodput's program: the node counts each bucket
  fraction can switch between at run time (``SpecConfig.choices``; None: ``spec``'s nodes).
  """

  mode: Mode
  spec: SpecConfig | None
  proposer: Proposer | None
  probe_rows: int
  reflex: ReflexMode
  choice: tuple[_goodput.BucketChoice, ...] = ()
  counts: tuple[tuple[int, ...], ...] | None = None

  def __post_init__(self):
    object.__setattr__(self, "mode", Mode(self.mode))
    object.__setattr__(self, "reflex", ReflexMode(self.reflex))
    if (self.mode == Mode.VANILLA) != (self.proposer is None):
      raise ValueError(f"Plan: mode {self.mode} with proposer {type(self.proposer).__name__}")


def fingerprint(*parts) -> np.ndarray:
  """[2] uint32: a digest of ``parts`` (settings, model config, head family) that every process
  computes alike (``structural``)."""
  digest = hashlib.blake2b(repr(structural(parts)).encode(), digest_size=8).digest()
  return np.frombuffer(digest, np.uint32).copy()


def structural(x):
  """``x`` as plain values for a fingerprint that every process computes alike: dataclasses by
  their fields, functions by their module and qualified name, ``functools.partial`` by its
  function and arguments (a function's ``repr`` holds its address, which differs per process)."""
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return (type(x).__qualname__,
            tuple((f.name, structural(getattr(x, f.name))) for f in dataclasses.fields(x)))
  if isinstance(x, functools.partial):
    return ("partial", structural(x.func), structural(x.args),
            tuple(sorted((k, structural(v)) for k, v in x.keywords.items())))
  if isinstance(x, tuple | list):
    return tuple(structural(v) for v in x)
  if isinstance(x, dict):
    return tuple(sorted((str(k), structural(v)) for k, v in x.items()))
  if callable(x) and hasattr(x, "__qualname__"):
    return f"{getattr(x, '__module__', '?')}.{x.__qualname__}"
  return repr(x)


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


__all__ = ["Mapped", "Mode", "Plan", "ReflexMode", "SpecRollState", "fingerprint",
           "place", "structural", "with_table"]
