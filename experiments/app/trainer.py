"""The host-scored GRPO step as a function of its state (nanodo-style): ``state, result =
trainer.step(state, batch)`` rolls the batch out, decodes and scores it on the host, runs the
data-parallel train step and returns the new ``LoopState`` with a typed ``StepMetrics`` and the
step's rows (``StepRows``). It writes nothing: checkpoints, traces, the metrics file and logging
belong to the app around it (``app.loop.Run``). Goodput, Reflex and the slow path live inside the
``SpecRoll`` object whose state ``LoopState.specroll`` carries.

Several processes (``distributed.initialize``): every process holds the same global batch on the
host, decodes and scores only the rows its devices hold under P("data") (the sample ids make them
the rows one process would sample), and feeds them to the data-parallel step with
``make_array_from_process_local_data``; the metrics and ``StepRows`` are gathered over processes,
so every process returns the same ones.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from specroll_jax import rewards as _rewards
from specroll_jax import rollout as _rollout
from specroll_jax.adaptation.slow_path import BatchReport, SlowPathConfig
from specroll_jax.engines.results import Rollout
from specroll_jax.grpo.loss import group_advantages
from specroll_jax.grpo.step import AXIS, Batch, TrainState, make_train_step, place_state
from specroll_jax.mesh import ModelMesh, make_mesh
from specroll_jax.specroll import SpecRoll, SpecRollReport, SpecRollState


@dataclasses.dataclass(frozen=True)
class StepBatch:
  """One step's rows on the host, G rows per prompt (prompt-major): tokens [B, P] right-padded
  prompt ids, lengths [B], golds (the reference answer of each row), sample_ids [B] (global prompt
  index * G + member: the noise coordinate of each response)."""

  tokens: np.ndarray
  lengths: np.ndarray
  golds: tuple[str, ...]
  sample_ids: np.ndarray

  def rows(self, sl: slice) -> StepBatch:
    """The rows ``sl`` (one process's share)."""
    return StepBatch(self.tokens[sl], self.lengths[sl], self.golds[sl], self.sample_ids[sl])


@dataclasses.dataclass(frozen=True)
class LoopState:
  """Everything a run carries from step to step: the train state (policy, optimizer, updates
  done), the ``SpecRoll`` state (None for the vanilla rollouts) and the index of
  the next step (the data position is ``step * prompts_per_step``)."""

  train: TrainState
  specroll: SpecRollState | None
  step: int


@dataclasses.dataclass(frozen=True)
class StepMetrics:
  """One step's figures (a line of metrics.jsonl). Rewards: reward_mean (the shaped reward),
  accuracy (strict correctness), pass_at_group (groups with a correct member), groups_mixed
  (groups whose rewards differ: the ones that teach). Rollout: tau (committed tokens per
  row-forward), forwards, response_tokens, mean_length, eos_rate, head_acceptance (accepted /
  proposed per depth), nodes (nodes per row in each speculative bucket). Update: loss,
  ratio_mean, clip_fraction, logp_gap_mean / max (rollout vs trainer logprobs: 0 when they
  agree), rollout_kl, entropy, grad_norm. Seconds: rollout (the adaptation's host work apart),
  adaptation, reward, train, step (all of it). SpecRoll's own (None otherwise): probe_tau, mode,
  safety, reflex, probe_seconds, compile_seconds, slow, events. eval_accuracy: the held-out greedy
  accuracy when the step evaluated."""

  step: int
  rollout: str
  reward_mean: float
  accuracy: float
  pass_at_group: float
  groups_mixed: int
  tau: float
  forwards: int
  response_tokens: int
  mean_length: float
  eos_rate: float
  loss: float
  ratio_mean: float
  clip_fraction: float
  logp_gap_mean: float
  logp_gap_max: float
  rollout_kl: float
  entropy: float
  grad_norm: float
  rollout_seconds: float
  adaptation_seconds: float
  reward_seconds: float
  train_seconds: float
  step_seconds: float
  head_acceptance: tuple[float, ...]
  nodes: tuple[int, ...] = ()
  probe_tau: float | None = None
  mode: str | None = None
  safety: tuple[float, ...] = ()
  reflex: str | None = None
  probe_seconds: float | None = None
  compile_seconds: float | None = None
  slow: BatchReport | None = None
  events: tuple[str, ...] = ()
  eval_accuracy: float | None = None

  def to_dict(self) -> dict:
    """Plain values for a JSON line."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict) -> StepMetrics:
    """The record of a JSON line (``to_dict``'s inverse)."""
    d = dict(d)
    for k in ("head_acceptance", "nodes", "safety", "events"):
      d[k] = tuple(d.get(k) or ())
    if d.get("slow") is not None:
      s = {k: tuple(v) if isinstance(v, list) else v for k, v in d["slow"].items()}
      d["slow"] = BatchReport(**s)
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass(frozen=True)
class StepRows:
  """The whole batch's rows of one step (every process's), for traces: prompt ids and response
  tokens (-1 past each row's length), response lengths, rewards, the rollout's logprobs and the
  group advantages."""

  prompt_ids: np.ndarray
  tokens: np.ndarray
  lengths: np.ndarray
  rewards: np.ndarray
  logprobs: np.ndarray
  advantages: np.ndarray


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What ``GRPOTrainer.step`` returns beside the new state."""

  metrics: StepMetrics
  rows: StepRows


@dataclasses.dataclass(frozen=True)
class Warmup:
  """Seconds of the warm-up calls (compiles included): the rollout and the train step."""

  rollout_seconds: float
  train_seconds: float


class GRPOTrainer:
  """The step of a run (``app.loop.RunConfig``) with its fixed context: the model config, the
  tokenizer, the compiled train step over the default mesh, the rollout (the ``SpecRoll`` object,
  the static heads or the vanilla engine) and this process's rows. Holds no state between calls
  but one timing: the last step's seconds, which the ``SpecRoll`` object's learning may spend a
  share of (``SpecRoll.generate``'s ``step_seconds``).

  ``init(train_state)`` -> the first ``LoopState``; ``step(state, batch)`` -> (state,
  ``StepResult``); ``warmup(state, batch)`` compiles both programs without changing ``state``.
  The same state and batch give the same result (timings aside). ``state.train`` is donated to
  the train step, as ``make_train_step``'s state is: carry the returned state on.
  """

  def __init__(self, run, config, tok, heads, prompt_width: int):
    self.run, self.config, self.tok = run, config, tok
    self.cache_length = prompt_width + run.max_new_tokens
    if self.cache_length > config.max_position_embeddings:
      raise ValueError(f"prompt width {prompt_width} + max_new_tokens {run.max_new_tokens} "
                       f"exceeds max_position_embeddings {config.max_position_embeddings}")
    self.rollout_mesh = None
    mesh = None
    if run.model_axis > 1:  # (data, model): the train step's global mesh, each process's own
      m, local = run.model_axis, jax.local_device_count()
      if local % m:
        raise ValueError(f"RunConfig.model_axis={m} does not divide this process's {local} "
                         "devices (each process decodes its rows on its own devices)")
      mesh = make_mesh(jax.device_count() // m, m)
      self.rollout_mesh = ModelMesh(make_mesh(local // m, m, devices=jax.local_devices()))
      self.rollout_mesh.check_config(config)
    self.train_step = make_train_step(config, run.grpo, mesh=mesh)
    self.num_processes = jax.process_count()
    self.rows_sharding = NamedSharding(self.train_step.mesh, PartitionSpec(AXIS))
    self.rows_local = self._local_rows()
    # the replicated sharding of the train mesh (what the SpecRoll state is saved under)
    self.replicated = NamedSharding(self.train_step.mesh, PartitionSpec())
    # "static-heads": SpecRoll with Reflex, the lookup and the slow path off (the heads alone)
    self.sr = (None if run.rollout == "vanilla"
               else specroll_for(run, config, prompt_width, self.rollout_mesh))
    self._heads = heads
    self._step_seconds = None  # the last step's (timing only: the heads' learning budget)

  def init(self, train: TrainState) -> LoopState:
    """The state of step 0: ``train`` replicated over the mesh, a fresh ``SpecRoll`` state."""
    sr = None if self.sr is None else self.sr.init(self._heads)
    return LoopState(train=place_state(self.train_step.mesh, train), specroll=sr, step=0)

  def _local_rows(self) -> slice:
    """The rows of a step's batch this process decodes: those its devices hold under P("data")."""
    rows = self.run.rows
    if self.num_processes == 1:
      return slice(0, rows)
    g = self.run.grpo.group_size
    idx = sorted(s[0].indices(rows)[:2]
                 for s in self.rows_sharding.addressable_devices_indices_map((rows,)).values())
    lo, hi = idx[0][0], idx[-1][1]
    if hi - lo != rows // self.num_processes or lo % g:
      raise ValueError(f"RunConfig.prompts_per_step={self.run.prompts_per_step} x G={g} rows do "
                       f"not split into whole groups over {self.num_processes} processes "
                       f"(this process's rows {lo}:{hi})")
    return slice(lo, hi)

  def local(self, tree):
    """``tree`` with every leaf this process's copy (a replicated global array's local shard; a
    leaf split over the model axis: its shards on this process's devices, as one array on the
    rollout mesh, nothing copied)."""
    mm = self.rollout_mesh

    def one(x):
      if not isinstance(x, jax.Array):
        return x
      if mm is None:
        return x if x.is_fully_addressable else x.addressable_data(0)
      if set(x.sharding.device_set) == set(mm.mesh.devices.flat):
        return x  # already on the rollout mesh (one process)
      if x.sharding.is_fully_replicated:
        return mm.replicate(x.addressable_data(0))
      shards = {s.device: s.data for s in x.addressable_shards}
      sharding = NamedSharding(mm.mesh, x.sharding.spec)
      return jax.make_array_from_single_device_arrays(
          x.shape, sharding, [shards[d] for d in sharding.addressable_devices])

    return jax.tree.map(one, tree)

  def _global_batch(self, b: Batch) -> Batch:
    """This process's rows as the data-parallel step's global batch (one process: as is)."""
    if self.num_processes == 1:
      return b
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(self.rows_sharding, np.asarray(x)), b)

  def _gather(self, x) -> np.ndarray:
    """Every process's rows of ``x`` in batch order (one process: ``x``)."""
    x = np.asarray(x)
    if self.num_processes == 1:
      return x
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  def rollout(self, params, batch: StepBatch, sr_state: SpecRollState | None = None
              ) -> tuple[Rollout, SpecRollReport | None, SpecRollState | None]:
    """The rollout of ``batch``'s rows through the ``SpecRoll`` object (with its state; returns
    its report and the next state), or the vanilla engine (no report, no state)."""
    run = self.run
    toks, lens, sids = batch.tokens, batch.lengths, batch.sample_ids
    if self.sr is not None:
      g = run.grpo.group_size
      prompts = [toks[i, : lens[i]] for i in range(0, len(toks), g)]
      return self.sr.generate(params, self.sr.batch(prompts, sids[::g] // g), sr_state,
                              seed=run.seed, step_seconds=self._step_seconds)
    opts = _rollout.DecodeOptions(cache_length=self.cache_length, kernels=run.kernels,
                                  bucket_fractions=run.vanilla_buckets)
    out = _rollout.generate(self.config, params, toks, options=opts,
                            sampling=run.grpo.sampling, max_new_tokens=run.max_new_tokens,
                            seed=run.seed, sample_ids=sids, eos_ids=self.tok.eos_ids,
                            prompt_lengths=lens)
    return out, None, None

  def warmup(self, state: LoopState, batch: StepBatch) -> Warmup:
    """Compile the rollout and the train step on ``batch`` without changing ``state`` (copies are
    used and discarded)."""
    b = batch.rows(self.rows_local)
    t0 = time.perf_counter()
    out, _, _ = self.rollout(self.local(state.train.params), b, state.specroll)
    jax.block_until_ready(out.tokens)
    t_roll = time.perf_counter() - t0
    copy = jax.tree.map(jnp.array, state.train)
    t0 = time.perf_counter()
    tb = Batch.from_rollout(b.tokens, b.lengths, out, np.zeros((len(b.tokens),), np.float32))
    jax.block_until_ready(self.train_step(copy, self._global_batch(tb))[1].loss)
    return Warmup(rollout_seconds=t_roll, train_seconds=time.perf_counter() - t0)

  def step(self, state: LoopState, batch: StepBatch) -> tuple[LoopState, StepResult]:
    """One GRPO step on ``batch`` (the whole step's rows; this process takes its share)."""
    run = self.run
    g = run.grpo.group_size
    b = batch.rows(self.rows_local)
    t_start = time.perf_counter()
    out, report, sr_state = self.rollout(self.local(state.train.params), b, state.specroll)
    jax.block_until_ready(out.tokens)
    t_roll = time.perf_counter() - t_start
    adapt_s = 0.0 if report is None else report.host_seconds
    t0 = time.perf_counter()
    out_toks, out_lens = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = out.decode(self.tok, keep_eos=True)
    rewards = _rewards.batch_rewards(texts, list(b.golds), format_weight=run.format_weight)
    correct = _rewards.batch_rewards(texts, list(b.golds))
    t_reward = time.perf_counter() - t0
    t0 = time.perf_counter()
    train, m = self.train_step(state.train, self._global_batch(
        Batch.from_rollout(b.tokens, b.lengths, out, rewards)))[:2]
    m = jax.device_get(m)
    t_train = time.perf_counter() - t0
    toks, lens, out_toks, out_lens, rewards, correct, logprobs = (
        self._gather(x) for x in (b.tokens, b.lengths, out_toks, out_lens, rewards, correct,
                                  out.logprobs))
    adv = np.asarray(group_advantages(jnp.asarray(rewards), g, run.grpo.adv_eps))
    st = out.stats
    sr_kw = {}
    if report is not None:  # what SpecRoll did (``SpecRollReport``)
      sr_kw = dict(tau=report.tau, probe_tau=report.probe_tau, mode=report.mode,
                   nodes=tuple(report.nodes), head_acceptance=tuple(report.depth_acceptance),
                   safety=tuple(report.safety), reflex=report.reflex,
                   probe_seconds=report.probe_seconds, compile_seconds=report.compile_seconds,
                   slow=report.slow, events=tuple(report.events))
    metrics = StepMetrics(**{
        "step": state.step, "rollout": run.rollout, "reward_mean": float(rewards.mean()),
        "accuracy": float(correct.mean()),
        "pass_at_group": float((correct.reshape(-1, g) > 0).any(1).mean()),
        "groups_mixed": int((rewards.reshape(-1, g).std(1) > 0).sum()),
        "tau": float(st.tokens_per_forward), "forwards": int(st.forwards),
        "response_tokens": int(out_lens.sum()), "mean_length": float(out_lens.mean()),
        "eos_rate": float((out_lens < run.max_new_tokens).mean()),
        "loss": float(m.loss), "ratio_mean": float(m.ratio_mean),
        "clip_fraction": float(m.clip_fraction), "logp_gap_mean": float(m.logp_gap_mean),
        "logp_gap_max": float(m.logp_gap_max), "rollout_kl": float(m.rollout_kl),
        "entropy": float(m.entropy), "grad_norm": float(m.grad_norm),
        "rollout_seconds": t_roll - adapt_s, "adaptation_seconds": adapt_s,
        "reward_seconds": t_reward, "train_seconds": t_train,
        "step_seconds": time.perf_counter() - t_start,
        "head_acceptance": tuple(float(x) for x in np.asarray(st.head_acceptance)),
        **sr_kw})
    rows = StepRows(
        prompt_ids=np.where(np.arange(toks.shape[1])[None] < lens[:, None], toks, -1),
        tokens=np.where(np.arange(out_toks.shape[1])[None] < out_lens[:, None], out_toks, -1),
        lengths=out_lens, rewards=rewards, logprobs=logprobs, advantages=adv)
    self._step_seconds = metrics.step_seconds
    new = LoopState(train=train, specroll=state.specroll if sr_state is None else sr_state,
                    step=state.step + 1)
    return new, StepResult(metrics=metrics, rows=rows)


def specroll_for(run, config, prompt_width: int, mesh: ModelMesh | None = None) -> SpecRoll:
  """The ``SpecRoll`` object of a run (``app.loop.RunConfig``): its sampling, group size and
  lengths, the run's tree settings (``spec``; goodput or its fixed budget), Reflex and the slow
  path, prompts padded to the run's fixed width (one shape: one compile). ``rollout=
  "static-heads"``: the heads alone (no Reflex, lookup, slow path or store; ``spec``'s fixed
  budget)."""
  static = run.rollout == "static-heads"
  adapt = (dict(reflex=None, slow=SlowPathConfig(mode="off"), lookup=None, store_prompts=0)
           if static else dict(reflex=run.reflex, slow=run.slow))
  return SpecRoll(config, max_new_tokens=run.max_new_tokens, sampling=run.grpo.sampling,
                  group_size=run.grpo.group_size, records_per_batch=run.records_per_batch,
                  spec=run.spec, budget="goodput" if run.goodput and not static else "fixed",
                  kernels=run.kernels, cost_nodes=run.cost_nodes, prompt_width=prompt_width,
                  mesh=mesh, **adapt)


__all__ = ["GRPOTrainer", "LoopState", "StepBatch", "StepMetrics", "StepResult", "StepRows",
           "Warmup", "specroll_for"]
