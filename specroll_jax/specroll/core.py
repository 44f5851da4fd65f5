"""SpecRoll as one object: the best configuration by default, its state carried as one pytree.

``SpecRoll`` holds every static setting of a speculative GRPO rollout (frozen, hashable);
``init`` gives the state that outlives a batch, ``generate`` rolls a batch out and returns the
state for the next one (optax- / gemma-sampler-style)::

    sr = SpecRoll(config, sampling=cfg.sampling, group_size=cfg.group_size, max_new_tokens=256)
    state = sr.init(heads)                               # root-conditioned heads (or None)
    batch = sr.batch(prompts, prompt_ids)                # P prompts -> P x G rows
    out, report, state = sr.generate(params, batch, state, seed=step)  # report: what ran

What runs by default (docs/design.md, "SpecRoll as one object"): root-conditioned heads and the
group-aware lookup (the row's own text, its G - 1 siblings, earlier responses to the same prompt
kept in the state's store) in one tree ranked by calibrated acceptance (``proposers.Merged``),
with Reflex corrections on the heads while Reflex is awake (``proposers.MergedReflex``; it sleeps
through batches where its corrections did not pay), the slow path refreshing the heads from
records drawn from the rollout's own anchor hidden states (a bootstrap fit first, then on
sustained degradation), and node budgets per bucket chosen by measured goodput on this machine
(``goodput``). Where goodput verifies no tree (a CPU at T > 0), every ``probe_every``-th batch
still verifies trees on its first ``probe_groups`` groups, so acceptance keeps being measured
(the calibration, goodput's expectation and the report's ``probe_tau``) at a small cost.
Whatever runs, the committed tokens are the target's own samples: the vanilla engine's, token for
token.

Inside a caller's ``jax.jit`` / ``jax.shard_map``: ``plan`` gives the engine and the proposer's
parameters for a batch (host), the engine call is traceable, and ``update`` folds the rollout
into the state (host).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specroll_jax import distributed
from specroll_jax._fields import check_float, check_int, check_type, float_arg, int_tuple
from specroll_jax.adaptation import calibration as _cal
from specroll_jax.adaptation import reflex as _reflex
from specroll_jax.adaptation import slow_path as _slow
from specroll_jax.adaptation import store as _store
from specroll_jax.adaptation.goodput import CostModel
from specroll_jax.adaptation.reflex import ReflexConfig
from specroll_jax.adaptation.slow_path import SlowPathConfig
from specroll_jax.engines import check_seed
from specroll_jax.engines import executables as _exe
from specroll_jax.engines.config import SpecConfig
from specroll_jax.engines.results import Rollout
from specroll_jax.heads import kinds as head_kinds
from specroll_jax.kernels import Kernels
from specroll_jax.models import decoder as _dec
from specroll_jax.models.config import ModelConfig
from specroll_jax.proposers import (
  GroupLookup,
  Merged,
  MergedReflex,
  Proposer,
  RankedHeads,
)
from specroll_jax.proposers.ranked import RankedProposer
from specroll_jax.rollout import MIN_PROMPT_WIDTH, PreparedBatch, pad_prompts, prepare_batch
from specroll_jax.sampling import SamplingConfig, group_sample_ids
from specroll_jax.specroll.fold import Folding
from specroll_jax.specroll.programs import Programs
from specroll_jax.specroll.report import SpecRollReport
from specroll_jax.specroll.state import (
  Mode,
  SpecRollState,
  fingerprint,
  place,
)

# Reflex as the default object runs it: on the root-conditioned heads, no records in the decode
# loop (the slow path draws them from the rollout's hidden states), asleep for 3 batches after a
# batch whose corrections did not pay, doubling up to 24 (docs/benchmarks.md, "SpecRoll on real
# GRPO drift")
DEFAULT_REFLEX = ReflexConfig(conditioned=True, record_capacity=0, sleep_batches=3,
                              sleep_max_batches=24)
BUDGETS = ("goodput", "fixed")
# node counts goodput prices and chooses from: the plain step, small trees (what pays where a
# tree's tokens are not free, a CPU at a batch's tail: docs/benchmarks.md, "The tail at a real
# shape on the CPU") and a 4-node tree (where they are, below a GPU's ridge point)
DEFAULT_COST_NODES = (0, 1, 2, 4)


@dataclasses.dataclass(frozen=True)
class SpecRoll(Programs, Folding):
  """Every static setting of SpecRoll rollouts (module docstring). Defaults are the best
  configuration measured (docs/benchmarks.md, "SpecRoll's defaults").

  config: the target model. max_new_tokens: response length limit. sampling: the GRPO rule (take
  ``GRPOConfig.sampling``). group_size: G responses per prompt (``GRPOConfig.group_size``). eos_ids:
  ids that end a response (None: the model's). proposer: None for the default tree (heads + lookup +
  Reflex), or any ``proposers.Proposer`` (its parameters: ``init``'s ``proposer_params``; ranked
  proposers are calibrated too). heads_tree: the heads' expansion (candidates per depth, beams).
  lookup: the group-aware lookup's settings (its group_size is set to ``group_size``), None: no
  lookup. max_nodes: nodes a row's tree holds at most. reflex: Reflex's constants (None: no
  corrections). slow: the slow path (None: ``SlowPathConfig.for_model``; ``mode="off"``: none).
  records_per_batch: anchors drawn per batch from the rollout's hidden states for the slow path.
  spec: buckets and the fixed node budget (None: ``SpecConfig.auto()`` for this backend). budget:
  "goodput" (nodes per bucket from the measured cost and acceptance) or "fixed" (``spec``'s).
  probe_every, probe_max_every, probe_groups, probe_nodes: where goodput verifies nothing, a probe
  batch verifies ``probe_nodes`` nodes per row on its first ``probe_groups`` groups, every
  ``probe_every`` batches (0: never) while the heads learn (a learning phase of the slow path) and,
  once a probe's measurement leaves every tree unpaid, twice as far apart after each such probe, up
  to ``probe_max_every`` batches (what measuring costs where it cannot pay). store_prompts,
  store_per_prompt: earlier responses kept (prompts, responses per prompt; None: G); 0 prompts: no
  store. calibration_strength / calibration_decay: ``calibration.init``'s. cost_nodes: node counts
  goodput measures and chooses from. kernels: ``Kernels.resolve``'s choice. on_nonfinite: a row
  whose logits turn NaN/inf stops (never sampled); "raise": ``generate`` raises FloatingPointError
  naming the rows, "flag": it warns, the rollout's ``stats.nonfinite`` marks them and the state
  learns nothing from them (no store entry, no records). mesh: None (one device), or the rollout's
  ``Mesh`` (axes "data" / "model") or ``specroll_jax.mesh.ModelMesh``: the weights and the KV cache
  split over the model axis, the rows over the data axis (``params`` placed by
  ``ModelMesh.shard_params``; the state replicated on the mesh). In a run of several processes each
  decodes its own rows: the mesh is this process's devices. prompt_width: pad prompts to this width
  (fixed shapes; None: the longest prompt of the batch rounded up to a power of two, at least 32:
  ``rollout.prompt_width``, so batches of similar prompts share their programs). params_from: None,
  or a function (hashable, e.g. one ``functools.partial`` per integration) that maps the ``params``
  a caller passes to the decoder's parameter tree; the compiled rollouts apply it inside (another
  framework's weights are read in place: ``integrations.tunix``), the host work after them eagerly.
  """

  config: ModelConfig
  _: dataclasses.KW_ONLY
  max_new_tokens: int
  sampling: SamplingConfig = SamplingConfig()
  group_size: int = 8
  eos_ids: tuple[int, ...] | None = None
  proposer: Proposer | None = None
  heads_tree: RankedHeads = RankedHeads()
  lookup: GroupLookup | None = GroupLookup()
  max_nodes: int = 16
  reflex: ReflexConfig | None = DEFAULT_REFLEX
  slow: SlowPathConfig | None = None
  records_per_batch: int = 512
  spec: SpecConfig | None = None
  budget: str = "goodput"
  probe_every: int = 4
  probe_max_every: int = 32
  probe_groups: int = 1
  probe_nodes: int = 4
  store_prompts: int = 1024
  store_per_prompt: int | None = None
  calibration_strength: float = 8.0
  calibration_decay: float = 0.7
  cost_nodes: tuple[int, ...] = DEFAULT_COST_NODES
  kernels: str = "auto"
  on_nonfinite: str = "raise"
  mesh: Any = None
  prompt_width: int | None = None
  params_from: Callable | None = None

  def __post_init__(self):
    check_type(self, "config", ModelConfig)
    check_type(self, "sampling", SamplingConfig)
    check_type(self, "heads_tree", RankedHeads)
    for name, lo in (("max_new_tokens", 1), ("group_size", 1), ("max_nodes", 1),
                     ("records_per_batch", 1), ("probe_every", 0), ("probe_max_every", 0),
                     ("probe_groups", 1),
                     ("probe_nodes", 1), ("store_prompts", 0)):
      check_int(self, name, lo)
    if self.proposer is not None:
      check_type(self, "proposer", Proposer, what="specroll_jax.proposers.Proposer")
    if self.lookup is not None:
      check_type(self, "lookup", GroupLookup)
      object.__setattr__(self, "lookup", dataclasses.replace(self.lookup,
                                                             group_size=self.group_size))
    if self.sampling.greedy and self.heads_tree.coupled:  # no noise to couple to at T = 0
      object.__setattr__(self, "heads_tree", dataclasses.replace(self.heads_tree, coupled=False))
    if self.reflex is not None:
      check_type(self, "reflex", ReflexConfig)
      h = self.heads_tree
      object.__setattr__(self, "reflex", dataclasses.replace(
          self.reflex, num_heads=h.num_heads, topk=h.topk, beams=h.beams,
          max_nodes=h.max_nodes, conditioned=True, coupled=h.coupled))
    if self.slow is None:
      object.__setattr__(self, "slow", SlowPathConfig.for_model(self.config))
    check_type(self, "slow", SlowPathConfig)
    object.__setattr__(self, "slow", self.slow.replace(
        temperature=1.0 if self.sampling.greedy else float(self.sampling.temperature)))
    if self.spec is None:
      object.__setattr__(self, "spec", SpecConfig.auto())
    check_type(self, "spec", SpecConfig)
    if self.on_nonfinite not in ("raise", "flag"):
      raise ValueError(f"SpecRoll.on_nonfinite must be 'raise' or 'flag', got "
                       f"{self.on_nonfinite!r}")
    if self.budget not in BUDGETS:
      raise ValueError(f"SpecRoll.budget must be one of {BUDGETS}, got {self.budget!r}")
    if self.store_per_prompt is None:
      object.__setattr__(self, "store_per_prompt", self.group_size)
    check_int(self, "store_per_prompt", 1)
    if self.eos_ids is None:
      object.__setattr__(self, "eos_ids", tuple(self.config.eos_token_ids))
    object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
    nodes = int_tuple(self.cost_nodes, "SpecRoll.cost_nodes", 0)
    if not nodes or nodes[0] != 0 or list(nodes) != sorted(set(nodes)):
      raise ValueError(f"SpecRoll.cost_nodes must be ints ascending from 0, got {self.cost_nodes}")
    object.__setattr__(self, "cost_nodes", nodes)
    kern = Kernels.resolve(self.kernels, mesh=self.mesh)
    object.__setattr__(self, "mesh", kern.mesh)
    if kern.mesh is not None:
      kern.mesh.check_config(self.config)
      local = set(jax.local_devices())
      if not set(kern.mesh.mesh.devices.flat) <= local:
        raise ValueError("SpecRoll.mesh: every process decodes its own rows, so the rollout mesh "
                         f"must hold this process's devices only ({len(local)} local devices)")
    check_int(self, "prompt_width", 1, optional=True)
    check_float(self, "calibration_strength", 0, lo_open=True, allow_inf=True)
    check_float(self, "calibration_decay", 0, 1)
    # this machine's measured step cost (host data, not state: another machine measures its own;
    # cached on disk too, ``goodput.measure_cost``)
    object.__setattr__(self, "_costs", {})

  @property
  def kernels_resolved(self) -> Kernels:
    """The kernels every program of this object runs (on its mesh)."""
    return Kernels.resolve(self.kernels, mesh=self.mesh)

  def place_params(self, params):
    """``params`` as the programs take them: on one device, or (on a mesh) checked to be placed
    as ``ModelMesh.shard_params`` places them (ValueError naming the leaf otherwise); another
    framework's tree (``params_from``) as it comes (GSPMD reads it where it lies)."""
    if self.params_from is None:
      _dec.check_params(self.config, params)
    if self.mesh is None:
      return place(params)
    if self.params_from is None:
      self.mesh.check_params(self.config, params)
    return params

  def _device(self, rows: PreparedBatch, seed: int):
    dev = rows.device(seed)
    return dev if self.mesh is None else self.mesh.place_batch(dev)

  def _on_mesh(self, tree):
    """``tree`` (a proposer's parameters) replicated on the mesh; as is on one device."""
    return tree if self.mesh is None else place(tree, self.mesh)

  # -- the proposers this object runs

  @property
  def merged(self) -> Merged:
    """The heads + lookup tree (Reflex asleep or off)."""
    return Merged(heads=self.heads_tree, lookup=self.lookup, max_nodes=self.max_nodes)

  def _ranked(self, heads, awake: bool) -> Proposer:
    if self.proposer is not None:
      return self.proposer
    if heads is None:
      return self.lookup
    if self.lookup is None:
      return self.heads_tree
    if awake:
      return MergedReflex(merged=self.merged, reflex=self.reflex)
    return self.merged

  def has_reflex(self, state: SpecRollState) -> bool:
    """Reflex corrects this state's heads (root-conditioned heads in the default tree)."""
    return state.reflex is not None

  def _reflex_on(self, heads) -> bool:
    return (heads is not None and self.proposer is None and self.reflex is not None
            and self.lookup is not None and head_kinds.is_conditioned(heads))

  def records_reflex(self, heads) -> ReflexConfig:
    """The Reflex settings the slow path's records are drawn under for ``heads`` (the object's
    Reflex on root-conditioned heads; its shapes without corrections otherwise)."""
    if self.reflex is not None and head_kinds.is_conditioned(heads):
      return self.reflex
    return dataclasses.replace(DEFAULT_REFLEX, apply_corrections=False,
                               conditioned=head_kinds.is_conditioned(heads),
                               num_heads=self.heads_tree.num_heads)

  def _calibrated(self, heads) -> RankedProposer | None:
    """The ranked proposer whose table the state calibrates (None: nothing to calibrate)."""
    p = self._ranked(heads, False)
    return p if isinstance(p, RankedProposer) else None

  # -- state

  def init(self, heads=None, *, proposer_params=None, key=None) -> SpecRollState:
    """A fresh state: ``heads`` (root-conditioned ``cond_heads.CondHeads`` for the default tree;
    Medusa ``heads.Heads`` run it without Reflex; ``"learn"``: fresh root-conditioned heads
    (``cond_heads.init`` with ``key``, default ``jax.random.key(0)``) that the slow path learns
    from the policy's own rollouts, for a model that comes without heads; None: the lookup
    alone), or a custom proposer's ``proposer_params``."""
    if isinstance(heads, str):
      if heads != "learn":
        raise ValueError(f"heads must be heads, None or 'learn', got {heads!r}")
      if self.proposer is not None or self.slow.mode == "off" or self.slow.bootstrap_batches < 1:
        raise ValueError("init(heads='learn') needs the default proposer and the slow path's "
                         f"learning phase (SlowPathConfig mode != 'off', bootstrap_batches >= 1;"
                         f" got mode {self.slow.mode!r}, bootstrap_batches "
                         f"{self.slow.bootstrap_batches})")
      from specroll_jax.heads import conditioned as _cond
      heads = _cond.init(jax.random.key(0) if key is None else key, self.config,
                         self.heads_tree.num_heads)
    elif key is not None:
      raise ValueError("key is for init(heads='learn') (fresh heads), not given heads")
    if self.proposer is not None:
      if heads is not None or proposer_params is None:
        raise ValueError("SpecRoll(proposer=...) takes its parameters as init(proposer_params="
                         "...), not heads")
      self.proposer.validate(self.config, proposer_params)
    elif proposer_params is not None:
      raise ValueError("proposer_params is for SpecRoll(proposer=...); the default proposer "
                       "takes init(heads)")
    if heads is None and self.proposer is None and self.lookup is None:
      raise ValueError("SpecRoll(lookup=None) without heads proposes nothing: pass heads to init "
                       "or keep the lookup")
    reflex = slow = None
    if heads is not None:
      head_kinds.validate(self.config, heads, self.heads_tree.num_heads)
      if self._reflex_on(heads):
        reflex = _reflex.init_global(self.reflex)
      if self.slow.mode != "off":
        r = self.records_reflex(heads)
        slow = _slow.init(self.slow, heads, support_size=r.support_size,
                          num_candidates=r.max_candidates)
    prop = self._calibrated(heads)
    cal = None
    ranks = 1
    if prop is not None:
      cal = _cal.init(np.asarray(prop.default_acceptance(), np.float32).reshape(-1),
                      strength=self.calibration_strength, decay=self.calibration_decay)
      ranks = prop.capacity + 1
    store = None
    if self.store_prompts > 0 and self.lookup is not None and self.proposer is None:
      store = _store.store_init(vocab_size=self.config.vocab_size, prompts=self.store_prompts,
                                per_prompt=self.store_per_prompt, max_tokens=self.max_new_tokens)
    state = SpecRollState(heads=heads, reflex=reflex, slow=slow, proposer_params=proposer_params,
                          calibration=cal, expected=jnp.zeros((ranks,), jnp.float32),
                          store=store, batches=jnp.int32(0), next_probe=jnp.int32(0),
                          probe_gap=jnp.int32(self.probe_every),
                          owner=jnp.asarray(self.owner(heads)))
    return self._placed(state)

  def owner(self, heads=None) -> np.ndarray:
    """The fingerprint [2] (uint32) a state of this object carries (settings, model, head
    family; ``state.fingerprint``)."""
    return fingerprint(self, None if heads is None else type(heads).__name__)

  @property
  def cost(self) -> CostModel | None:
    """This machine's measured step cost, once a goodput batch measured it (or ``use_cost``)."""
    return self._costs.get("cost")

  def use_cost(self, cost: CostModel) -> None:
    """Price goodput's choices with ``cost`` (e.g. measured by an earlier run on this machine)
    instead of measuring it at the first batch."""
    if not isinstance(cost, CostModel):
      raise ValueError(f"cost must be a goodput.CostModel, got {type(cost).__name__}")
    self._costs["cost"] = cost

  def _placed(self, state: SpecRollState) -> SpecRollState:
    """The state's heads and adaptation on one placement for every call (the mesh's, or this
    process's first device; a restored checkpoint's too)."""
    return state.replace(heads=place(state.heads, self.mesh), reflex=place(state.reflex, self.mesh),
                         slow=place(state.slow, self.mesh))

  def check_state(self, state) -> None:
    """ValueError unless ``state`` is this object's (``init`` of the same settings and model)."""
    if not isinstance(state, SpecRollState):
      raise ValueError(f"state must be a SpecRollState (SpecRoll.init), got "
                       f"{type(state).__name__}")
    owner = np.asarray(state.owner)
    if owner.shape != (2,) or not (owner == self.owner(state.heads)).all():
      raise ValueError("state was made by another SpecRoll (other settings, model, sampling or "
                       "group size): build it with this object's init")

  def describe(self, state: SpecRollState) -> str:
    """One line: what proposes, how budgets are chosen, what adapts."""
    if self.proposer is not None:
      what = f"{type(self.proposer).__name__} (custom)"
    else:
      parts = [] if state.heads is None else [f"{type(state.heads).__name__} heads"]
      if self.lookup is not None:
        parts.append(f"group lookup (G = {self.group_size}, own text, siblings"
                     + (", earlier responses)" if state.store is not None else ")"))
      what = " + ".join(parts) + " in one tree ranked by calibrated acceptance"
    budget = (f"goodput budgets from this machine's measured cost (probe every "
              f"{self.probe_every}..{max(self.probe_every, self.probe_max_every)} batches where "
              "none pays)" if self.budget == "goodput"
              else f"fixed budget ({self.spec.node_budget} nodes per forward)")
    adapt = []
    if self.has_reflex(state):
      adapt.append(f"Reflex (sleeps {self.reflex.sleep_batches}..{self.reflex.sleep_max_batches}"
                   " batches when unpaid)")
    if state.slow is not None:
      s = self.slow
      learn = (f"learning while a refit lowers held-out TV by {s.learn_gain:.1%}"
               if s.learn_gain > 0 else f"bootstrap {s.bootstrap_batches} refreshes")
      adapt.append(f"slow path {s.mode} ({learn}, {self.records_per_batch} records per batch "
                   "from the rows that verify trees)")
    return (f"SpecRoll: {what}; {budget}; buckets {self.spec.bucket_fractions}; adaptation: "
            + (", ".join(adapt) or "none"))

  # -- batches

  def batch(self, prompts, prompt_ids) -> PreparedBatch:
    """P prompts (token-id lists, or a padded [P, W] array) with their global prompt ids [P]
    (distinct ints >= 0, e.g. the data position): each repeated G times (host checks: ValueError
    naming the argument)."""
    ids = np.asarray(prompt_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or (ids.size and ids.min() < 0):
      raise ValueError(f"prompt_ids must be a 1-D array of ints >= 0, got {ids.dtype} "
                       f"{ids.shape}")
    if len(prompts) != len(ids):
      raise ValueError(f"prompts has {len(prompts)} entries but prompt_ids {len(ids)}")
    if len(np.unique(ids)) != len(ids):
      raise ValueError("prompt_ids holds duplicates: one id per prompt (its G rows share it)")
    g = self.group_size
    rows = [list(map(int, p)) for p in prompts for _ in range(g)]
    longest = max((len(r) for r in rows), default=0)
    if self.prompt_width is not None and longest > self.prompt_width:
      raise ValueError(f"a prompt has {longest} tokens, more than prompt_width="
                       f"{self.prompt_width}")
    room = self.config.max_position_embeddings - self.max_new_tokens
    padded = (pad_prompts(rows, self.prompt_width, limit=room)[0] if rows
              else np.zeros((0, MIN_PROMPT_WIDTH), np.int32))
    prepared = prepare_batch(self.config, padded,
                             max_new_tokens=self.max_new_tokens,
                             prompt_lengths=np.asarray([len(r) for r in rows]),
                             sample_ids=group_sample_ids(ids, g), eos_ids=self.eos_ids)
    return dataclasses.replace(prepared, prompt_ids=ids.astype(np.int64), group_size=g)

  def generate(self, params, batch: PreparedBatch, state: SpecRollState, *, seed: int = 0,
               step_seconds: float | None = None
               ) -> tuple[Rollout, SpecRollReport, SpecRollState]:
    """Roll ``batch`` out under ``params`` and fold what it measured into the state. Returns
    (the rollout: device arrays; its ``SpecRollReport``: host numbers; the state for the next
    batch). The tokens are the vanilla engine's whatever the plan. ``step_seconds``: the seconds
    of the training step around the rollouts as the caller measures it (rollout, rewards,
    update; e.g. the previous step's), what a learning refresh of the heads may spend a share of
    (``SlowPathConfig.learn_budget``), times the batches since the last that verified trees;
    None: the rollout's own seconds."""
    self.check_state(state)
    if step_seconds is not None:
      step_seconds = float_arg(step_seconds, "step_seconds", 0)
    if not isinstance(batch, PreparedBatch) or batch.prompt_ids is None:
      raise ValueError("batch must be SpecRoll.batch's (a PreparedBatch in GRPO shape), got "
                       f"{type(batch).__name__}")
    if batch.group_size != self.group_size:
      raise ValueError(f"batch has group_size {batch.group_size}, this SpecRoll "
                       f"{self.group_size}")
    check_seed(seed)
    params = self.place_params(params)
    state = self._placed(state)
    c0 = _exe.compile_seconds()
    if self.budget == "goodput" and self.cost is None:
      self.use_cost(self.measure_cost(params, state, batch))
    if int(state.batches) == 0:
      self.warmup(params, batch, state)
    plan = self.plan(state, batch)
    calls = self._calls(params, batch, state, plan, seed)
    for engine, args in calls:  # anything not warm compiles here, outside the timed part
      _exe.compiled(engine, *args)
    compile_s = _exe.compile_seconds() - c0
    t0 = time.perf_counter()
    out = _exe.run(calls[0][0], *calls[0][1])
    jax.block_until_ready(out.tokens)
    t1 = time.perf_counter()
    probe_tau, probe = None, None
    if plan.mode == Mode.PROBE:
      probe = _exe.run(calls[1][0], *calls[1][1])
      jax.block_until_ready(probe.tokens)
      probe_tau = probe.stats.tokens_per_forward
    elif plan.mode == Mode.SPECULATIVE:
      probe, probe_tau = out, out.stats.tokens_per_forward
    seconds = distributed.all_max(time.perf_counter() - t0)
    probe_s = time.perf_counter() - t1 if plan.mode == Mode.PROBE else 0.0
    report, state = self.update(params, state, batch, plan, out, probe, seconds, seed=seed,
                                probe_tau=probe_tau, probe_seconds=probe_s,
                                compile_seconds=compile_s, step_seconds=step_seconds)
    return out, report, state


__all__ = ["BUDGETS", "DEFAULT_COST_NODES", "DEFAULT_REFLEX", "SpecRoll"]
