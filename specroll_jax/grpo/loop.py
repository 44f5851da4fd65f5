"""The host-scored GRPO training loop on a GSM8K-format task (``data.tasks``: GSM8K, the synthetic
problems, or both): rollout (jitted) -> decode text -> reward on the host -> data-parallel train
step, with the adaptation state carried across steps, orbax checkpoints
(SIGKILL-safe resume), tensorstore rollout traces and a metrics.jsonl line per step.

Determinism: a step's rollouts depend only on (params, the adaptation state, the data position,
the seed): prompts come in a fixed shuffled order, sample id = global prompt index * G + member.
So a run resumed from its last complete checkpoint reproduces the steps an uninterrupted run would
have made (timings aside). Order of writes per step: trace, metrics line, checkpoint; on resume the
trace and the metrics file are cut back to the checkpoint's step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from specroll_jax import adaptation as _adapt
from specroll_jax import buckets as _buckets
from specroll_jax import rewards as _rewards
from specroll_jax import rollout as _rollout
from specroll_jax import trainer_records as _trainer_records
from specroll_jax.adaptation import AdaptationConfig
from specroll_jax.checkpoint import Checkpointer
from specroll_jax.config import SpecConfig
from specroll_jax.data import gsm8k
from specroll_jax.data.tasks import Task
from specroll_jax.grpo.config import GRPOConfig
from specroll_jax.grpo.loss import group_advantages
from specroll_jax.grpo.step import AXIS, Batch, init_train_state, make_train_step
from specroll_jax.sampling import group_sample_ids
from specroll_jax.traces import TraceWriter

ROLLOUTS = ("vanilla", "specroll", "static-heads")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One GRPO run on a task's train prompts. Every default of the main job lives here.

  task: the problems (``data.tasks.Task``; GSM8K by default), scored by the GSM8K reward.
  prompts_per_step: P prompts per step, each sampled G = grpo.group_size times.
  rollout: "specroll" (heads + Reflex + slow path, ``adaptation``), "static-heads" (heads fitted
    once) or "vanilla" (no speculation). All three give the same tokens.
  prompt_width: prompts are padded to this many tokens (fixed shapes: one compile); None: the
    longest train prompt of the task under the tokenizer, rounded up to 16. Longer prompts are
    refused.
  eval_every / eval_prompts: greedy accuracy on the first test prompts of the task every n steps
    (0: off).
  format_weight: reward bonus for a well-formed "#### N" line (the reward is 1 for a correct
    answer plus this).
  keep_checkpoints: complete checkpoints kept on disk.
  goodput: "specroll" rollouts take their node counts per bucket from ``goodput.choose``: a cost
    model of this machine measured once (``goodput.measure_cost`` over ``goodput_nodes``, cached)
    and the acceptance the adaptation state has measured so far; ``spec`` serves until the first
    measurement (a step that proposed). Where no tree pays, a bucket runs the plain step.
  vanilla_buckets: the vanilla engine's row buckets (``rollout.generate``'s ``bucket_fractions``;
    None: the engine's default). Each bucket is one more decode loop to compile; ``(1.0,)`` is one
    loop, for short runs where compile time dominates. The tokens are the same for any buckets.
  """

  grpo: GRPOConfig = GRPOConfig()
  task: Task = Task()
  prompts_per_step: int = 8
  max_new_tokens: int = 256
  steps: int = 10
  seed: int = 0
  data_seed: int = 0
  rollout: str = "specroll"
  spec: SpecConfig = SpecConfig()
  adaptation: AdaptationConfig = AdaptationConfig()
  kernels: str = "auto"
  prompt_width: int | None = None
  format_weight: float = 0.1
  eval_every: int = 0
  eval_prompts: int = 64
  keep_checkpoints: int = 2
  goodput: bool = False
  goodput_nodes: tuple[int, ...] = (0, 1, 2, 4)
  vanilla_buckets: tuple[float, ...] | None = None

  def __post_init__(self):
    if self.vanilla_buckets is not None:
      object.__setattr__(self, "vanilla_buckets", _buckets.check_fractions(
          self.vanilla_buckets, "RunConfig.vanilla_buckets"))
    for name, lo in (("prompts_per_step", 1), ("max_new_tokens", 1), ("steps", 1),
                     ("eval_every", 0), ("eval_prompts", 1), ("keep_checkpoints", 1),
                     ("seed", 0), ("data_seed", 0)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"RunConfig.{name} must be an int >= {lo}, got {v!r}")
    if not isinstance(self.task, Task):
      raise ValueError(f"RunConfig.task must be a data.tasks.Task, got {type(self.task).__name__}")
    if self.rollout not in ROLLOUTS:
      raise ValueError(f"RunConfig.rollout must be one of {ROLLOUTS}, got {self.rollout!r}")
    if not self.format_weight >= 0:
      raise ValueError(f"RunConfig.format_weight must be >= 0, got {self.format_weight!r}")
    if self.prompt_width is not None and (not isinstance(self.prompt_width, int)
                                          or self.prompt_width < 1):
      raise ValueError(f"RunConfig.prompt_width must be None or an int >= 1, got "
                       f"{self.prompt_width!r}")

  @property
  def rows(self) -> int:
    return self.prompts_per_step * self.grpo.group_size


class Prompts:
  """A task's train prompts in a fixed shuffled order (``data_seed``), encoded once, padded to a
  fixed width. ``batch(position, n)`` returns the n prompts from ``position`` on (wrapping around
  epochs; the global index ``position + i`` keeps growing, so sample ids never repeat)."""

  def __init__(self, tok, *, data_seed: int, width: int | None, task: Task | None = None):
    exs = (task or Task()).examples("train")
    self.order = np.random.default_rng(data_seed).permutation(len(exs))
    self.ids = tok.encode_batch([gsm8k.format_prompt(e.question) for e in exs])
    self.golds = [e.gold for e in exs]
    longest = max(map(len, self.ids))
    self.width = (-(-longest // _rollout.PROMPT_BUCKET) * _rollout.PROMPT_BUCKET
                  if width is None else int(width))
    if longest > self.width:
      raise ValueError(f"prompt_width={self.width} is shorter than the longest train prompt "
                       f"({longest} tokens); use None or >= {longest}")

  def batch(self, position: int, n: int):
    """(tokens [n, W] int32, lengths [n], golds, global indices [n])."""
    idx = np.arange(position, position + n)
    ex = self.order[idx % len(self.order)]
    toks, lens = _rollout.pad_prompts([self.ids[e] for e in ex], self.width)
    return toks, lens, [self.golds[e] for e in ex], idx


def _write_lines(path: Path, lines: list[str]) -> None:
  tmp = path.with_suffix(path.suffix + ".tmp")
  tmp.write_text("".join(lines))
  os.replace(tmp, path)


class Run:
  """One run's state on the host: model, train state, adaptation state, data, checkpoints, traces.
  ``step()`` does one GRPO step; ``Run(..., resume=True)`` continues from the last checkpoint."""

  def __init__(self, run: RunConfig, config, params, tok, heads, out_dir, *, resume: bool = False,
               log=print):
    self.run, self.config, self.tok, self.log = run, config, tok, log
    self.out = Path(out_dir)
    self.out.mkdir(parents=True, exist_ok=True)
    self.sampling = run.grpo.sampling
    self.data = Prompts(tok, data_seed=run.data_seed, width=run.prompt_width, task=run.task)
    self.cache_length = self.data.width + run.max_new_tokens
    if self.cache_length > config.max_position_embeddings:
      raise ValueError(f"prompt width {self.data.width} + max_new_tokens {run.max_new_tokens} "
                       f"exceeds max_position_embeddings {config.max_position_embeddings}")
    # SpecRoll with the slow path's records from the trainer's own forward (records="trainer"):
    # the step hands out its forward's anchor hidden states
    self.trainer_records = run.rollout == "specroll" and run.adaptation.records == "trainer"
    self.train_step = make_train_step(config, run.grpo, return_hidden=self.trainer_records)
    # several processes (``distributed.initialize``): every process holds the same global batch
    # on the host, decodes and scores only the rows its devices hold under P("data") (the sample
    # ids make them the rows one process would sample), and feeds them to the data-parallel step
    # with ``make_array_from_process_local_data``; host metrics are gathered, and process 0
    # alone writes metrics.jsonl and the traces (checkpoints are saved by every process).
    self.num_processes = jax.process_count()
    self.rows_sharding = NamedSharding(self.train_step.mesh, PartitionSpec(AXIS))
    self.rows_local = self._local_rows()
    if self.num_processes > 1 and run.rollout == "specroll":
      raise ValueError(f"RunConfig.rollout={run.rollout!r} with {self.num_processes} processes: "
                       "SpecRoll's adaptation state is per process and is not checkpointed "
                       "across processes yet; use 'vanilla' or 'static-heads' (the same tokens)")
    # replicated over the mesh from the start, as every step returns it: the rollout's jit then
    # sees the same parameter sharding at every step (one compile)
    self.replicated = NamedSharding(self.train_step.mesh, PartitionSpec())
    self.state = jax.device_put(init_train_state(params, run.grpo), self.replicated)
    self.heads = heads
    # "static-heads": the plain heads, proposing as SpecRoll's do with Reflex off or asleep
    # (RankedHeads for root-conditioned heads); host-local like the rows each process decodes
    self.static = None
    if run.rollout == "static-heads":
      self.static = _adapt.heads_proposer(run.adaptation, heads)
    self.adapt = None
    if run.rollout == "specroll":  # placed like the parameters, for the same reason
      self.adapt = jax.device_put(_adapt.init(run.adaptation.for_sampling(self.sampling), heads),
                                  self.replicated)
    # speculative programs compiled so far: (settings, Reflex asleep); the warm-up compiles the
    # first one (a sleeping Reflex proposes with the plain heads: another program)
    self._compiled = {(run.spec, self._asleep())}
    self.cost = None
    if run.goodput and run.rollout == "specroll":
      self.cost = self._measure_cost(params)
    self.ckpt = Checkpointer(self.out / "checkpoints", max_to_keep=run.keep_checkpoints,
                             async_save=False)
    self.writer = jax.process_index() == 0  # metrics.jsonl and traces: process 0
    self.traces = TraceWriter(self.out / "traces", batch=run.rows, prompt_len=self.data.width,
                              max_new=run.max_new_tokens,
                              scalars=(("step", "int64"), ("tau", "float32"),
                                       ("reward_mean", "float32"))) if self.writer else None
    self.metrics_path = self.out / "metrics.jsonl"
    self.next_step = 0
    if not resume and self.ckpt.latest_step() is not None:
      raise ValueError(f"{self.out} already holds a run (checkpoint step "
                       f"{self.ckpt.latest_step()}); resume it or use another output folder")
    latest = self.ckpt.latest_step() if resume else None
    if resume and latest is None:
      log(f"--resume: no complete checkpoint in {self.out / 'checkpoints'}; starting at step 0")
    if latest is not None:
      saved, meta = self.ckpt.restore(like=self._saved())
      self.state = jax.device_put(saved["train"], self.replicated)
      self.adapt = jax.device_put(saved["adaptation"], self.replicated)
      self.next_step = int(meta["step"]) + 1
      if self.writer:
        self.traces.truncate(int(meta["trace_steps"]))
      log(f"resumed from step {meta['step']} ({self.out / 'checkpoints'})")
    if self.writer:
      lines = []
      if self.metrics_path.exists():
        lines = [x + "\n" for x in self.metrics_path.read_text().splitlines()
                 if x.strip() and json.loads(x)["step"] < self.next_step]
      _write_lines(self.metrics_path, lines)
      if self.next_step == 0:
        self.traces.truncate(0)

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

  def local_params(self, params=None):
    """This process's copy of the (replicated) policy parameters, for host-side decoding."""
    params = self.state.params if params is None else params
    return jax.tree.map(lambda x: x if getattr(x, "is_fully_addressable", True)
                        else x.addressable_data(0), params)

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

  def _saved(self):
    return {"train": self.state, "adaptation": self.adapt}

  def _settings(self):
    from specroll_jax.config import DecodeSettings
    from specroll_jax.kernels import Kernels
    return DecodeSettings(sampling=self.sampling, max_new_tokens=self.run.max_new_tokens,
                          cache_length=self.cache_length, kernels=Kernels.resolve(self.run.kernels))

  def _measure_cost(self, params):
    from specroll_jax import goodput
    toks, lens, _, _ = self.batch(0)
    prop, pp = _adapt.proposer(self.adapt)
    rows = tuple(r for r, _ in self.run.spec.bucket_shapes(self.run.rows, prop.capacity))
    t0 = time.perf_counter()
    cost = goodput.measure_cost(self.config, params, prop, pp, toks, lens,
                                settings=self._settings(), rows=rows,
                                node_counts=self.run.goodput_nodes, progress=False)
    self.log(f"goodput cost model ({cost.machine}; {time.perf_counter() - t0:.1f} s, cached): "
             + "; ".join(f"{r} rows: " + " / ".join(f"{1e3 * s:.1f}" for s in row) + " ms"
                         for r, row in zip(cost.rows, cost.seconds, strict=True))
             + f" for {list(cost.node_counts)} nodes")
    return cost

  def spec(self) -> SpecConfig:
    """The speculative settings of the next rollout (goodput's choice once acceptance has been
    measured, else ``RunConfig.spec``)."""
    if self.cost is None or self.adapt is None:
      return self.run.spec
    expected = np.asarray(self.adapt.expected, np.float64)
    if expected.size == 0 or not expected[1:].any():
      return self.run.spec
    from specroll_jax import goodput
    prop, _ = _adapt.proposer(self.adapt)
    spec, _ = goodput.choose(self.cost, expected, self.run.rows, self.run.spec,
                             capacity=prop.capacity)
    return spec

  def rollout(self, params, toks, lens, sids, adapt=None, spec=None):
    kw = dict(sampling=self.sampling, max_new_tokens=self.run.max_new_tokens, seed=self.run.seed,
              sample_ids=sids, eos_ids=self.tok.eos_ids, prompt_lengths=lens,
              cache_length=self.cache_length, kernels=self.run.kernels)
    if self.run.rollout == "specroll":
      return _rollout.generate(self.config, params, toks, spec=spec or self.spec(),
                               adaptation=adapt, **kw)
    if self.run.rollout == "static-heads":
      prop, pp = self.static
      return _rollout.generate(self.config, params, toks, spec=self.run.spec, proposer=prop,
                               proposer_params=pp, **kw)
    if self.run.vanilla_buckets is not None:
      kw["bucket_fractions"] = self.run.vanilla_buckets
    return _rollout.generate(self.config, params, toks, **kw)

  def batch(self, step: int):
    run = self.run
    g = run.grpo.group_size
    toks, lens, golds, idx = self.data.batch(step * run.prompts_per_step, run.prompts_per_step)
    rep = lambda a: np.repeat(a, g, axis=0)
    sids = group_sample_ids(np.asarray(idx, np.int64), g)
    return rep(toks), rep(lens), [x for x in golds for _ in range(g)], sids

  def _asleep(self) -> bool:
    return self.adapt is not None and _adapt.asleep(self.adapt)

  def warmup(self) -> dict:
    """Compile the rollout and the train step on step ``next_step``'s batch without changing any
    state (copies are used and discarded). Returns the seconds of each warm-up call."""
    toks, lens, golds, sids = self.batch(self.next_step)
    sl = self.rows_local
    toks, lens, sids = toks[sl], lens[sl], sids[sl]
    t0 = time.perf_counter()
    out = self.rollout(self.local_params(), toks, lens, sids, self.adapt)
    jax.block_until_ready(out.tokens)
    t_roll = time.perf_counter() - t0
    rewards = np.zeros((len(toks),), np.float32)
    copy = jax.tree.map(jnp.array, self.state)
    t0 = time.perf_counter()
    b = Batch.from_rollout(toks, lens, out, rewards)
    res = self.train_step(copy, self._global_batch(b))
    jax.block_until_ready(res[1].loss)
    t_train = time.perf_counter() - t0
    if self.trainer_records:  # compile the records, the monitor and (if it fires) the refresh
      # on copies, as the rollout's own after_rollout above does (results dropped)
      recs = self._records(self.local_params(), b, res[2], out.adaptation, self.next_step)
      _adapt.after_trainer(out.adaptation, self.config, self.local_params(), recs,
                           out.adaptation_report)
    return {"rollout_warmup_seconds": t_roll, "train_warmup_seconds": t_train}

  def _records(self, params, b: Batch, hidden, adapt, step: int):
    """The slow path's records of batch ``b`` from the train step's anchor hidden states."""
    cfg = adapt.config
    return _trainer_records.from_hidden(
        cfg.reflex, self.config, params, adapt.heads, hidden, b.tokens, b.lengths,
        b.prompt_lengths, sampling=self.sampling,
        key=jax.random.fold_in(jax.random.key(self.run.seed), step),
        num_anchors=cfg.trainer_anchors)

  def step(self) -> dict:
    """One GRPO step; returns its metrics (also appended to metrics.jsonl)."""
    run, k = self.run, self.next_step
    g = run.grpo.group_size
    toks, lens, golds, sids = self.batch(k)
    sl = self.rows_local  # every row with one process
    toks, lens, golds, sids = toks[sl], lens[sl], golds[sl], sids[sl]
    params = self.local_params()
    spec = self.spec()
    program = (spec, self._asleep())
    if run.rollout == "specroll" and program not in self._compiled:  # a new node choice or a
      jax.block_until_ready(self.rollout(params, toks, lens, sids, self.adapt,  # sleeping Reflex
                                         spec).tokens)  # compiles once, untimed (output dropped)
      self._compiled.add(program)
    t_start = time.perf_counter()
    out = self.rollout(params, toks, lens, sids, self.adapt, spec)
    jax.block_until_ready(out.tokens)
    t_roll = time.perf_counter() - t_start
    report = out.adaptation_report or {}
    adapt_s = float(report.get("adaptation_seconds", 0.0))
    trainer_s = 0.0  # records from the train step's forward + the slow path (records="trainer")
    records_s = 0.0  # of which the records
    if out.adaptation is not None:
      self.adapt = jax.device_put(out.adaptation, self.replicated)
    t0 = time.perf_counter()
    out_toks, out_lens = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = self.tok.decode_batch([out_toks[i, : out_lens[i]] for i in range(len(toks))])
    rewards = _rewards.batch_rewards(texts, golds, format_weight=run.format_weight)
    correct = _rewards.batch_rewards(texts, golds)
    t_reward = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = self._global_batch(Batch.from_rollout(toks, lens, out, rewards))
    # the step donates the state: the records read the policy before the update, so keep a copy
    before = jax.tree.map(jnp.copy, params) if self.trainer_records else None
    res = self.train_step(self.state, b)
    self.state, m = res[0], jax.device_get(res[1])
    t_train = time.perf_counter() - t0
    if self.trainer_records:  # the slow path on the train step's own forward (params: before it)
      t0 = time.perf_counter()
      recs = jax.block_until_ready(self._records(before, b, res[2], self.adapt, k))
      records_s = time.perf_counter() - t0
      adapt, trainer_report = _adapt.after_trainer(self.adapt, self.config, before, recs, report)
      self.adapt = jax.device_put(adapt, self.replicated)
      report = {**report, "slow": trainer_report}
      trainer_s = time.perf_counter() - t0 - float(trainer_report.get("compile_seconds") or 0.0)
    # the whole batch's rows (every process's), for metrics and traces
    toks, lens, out_toks, out_lens, rewards, correct, logprobs = (
        self._gather(x) for x in (toks, lens, out_toks, out_lens, rewards, correct, out.logprobs))
    adv = np.asarray(group_advantages(jnp.asarray(rewards), g, run.grpo.adv_eps))
    grouped = correct.reshape(-1, g)
    st = out.stats
    rec = {
        "step": k, "rollout": run.rollout, "reward_mean": float(rewards.mean()),
        "accuracy": float(correct.mean()), "pass_at_group": float((grouped > 0).any(1).mean()),
        "groups_mixed": int((rewards.reshape(-1, g).std(1) > 0).sum()),
        "tau": st.tokens_per_forward, "forwards": st.forwards,
        "response_tokens": int(out_lens.sum()), "mean_length": float(out_lens.mean()),
        "eos_rate": float((out_lens < run.max_new_tokens).mean()),
        "loss": float(m.loss), "ratio_mean": float(m.ratio_mean),
        "clip_fraction": float(m.clip_fraction), "logp_gap_mean": float(m.logp_gap_mean),
        "logp_gap_max": float(m.logp_gap_max), "rollout_kl": float(m.rollout_kl),
        "entropy": float(m.entropy), "grad_norm": float(m.grad_norm),
        "rollout_seconds": t_roll - adapt_s, "adaptation_seconds": adapt_s + trainer_s,
        "reward_seconds": t_reward, "train_seconds": t_train,
        "step_seconds": time.perf_counter() - t_start,
        "head_acceptance": [float(x) for x in np.asarray(st.head_acceptance)],
        "nodes": [n for _, n in spec.bucket_shapes(run.rows)] if run.rollout == "specroll"
                 else [],
    }
    if report:
      rec["safety"] = report.get("safety")
      rec["reflex"] = report.get("reflex")
      slow = report.get("slow") or {}
      rec["slow"] = {key: slow.get(key) for key in ("decision", "heads", "kept", "rolled_back",
                                                     "refresh_seconds", "compile_seconds")}
      refresh_s = float(slow.get("refresh_seconds") or 0.0)
      # where the adaptation's host seconds went: the rollout side (Reflex's end of batch, and
      # the slow path there with records="rollout"), the trainer's records, the slow path's
      # monitor (and merge) and its refreshes
      tr = self.trainer_records
      rec["adaptation_split_seconds"] = {
          "after_rollout": adapt_s if tr else max(adapt_s - refresh_s, 0.0), "records": records_s,
          "monitor": max(trainer_s - records_s - refresh_s, 0.0) if tr else 0.0,
          "refresh": refresh_s}
    if run.eval_every and (k + 1) % run.eval_every == 0:
      rec["eval_accuracy"] = self.evaluate()
    if self.writer:
      self.traces.append({
          "prompt_ids": np.where(np.arange(toks.shape[1])[None] < lens[:, None], toks, -1),
          "tokens": np.where(np.arange(out_toks.shape[1])[None] < out_lens[:, None], out_toks,
                             -1),
          "lengths": out_lens, "rewards": rewards, "logprobs": logprobs, "advantages": adv,
          "step": k, "tau": rec["tau"], "reward_mean": rec["reward_mean"]})
      with open(self.metrics_path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())
    trace_steps = self.traces.num_steps if self.writer else k + 1  # (equal on process 0)
    self.ckpt.save(k, self._saved(), {"step": k, "data_position": (k + 1) * run.prompts_per_step,
                                      "seed": run.seed, "trace_steps": trace_steps})
    self.next_step = k + 1
    return rec

  def evaluate(self, params=None) -> float:
    """Greedy strict accuracy on the first ``eval_prompts`` test prompts of the task (of the
    current policy, or of ``params``)."""
    from specroll_jax import evaluation
    exs = self.run.task.examples("test")[: self.run.eval_prompts]
    res = evaluation.accuracy(self.config, self.local_params(params), self.tok, exs,
                              max_new_tokens=self.run.max_new_tokens)
    return float(res["accuracy_strict"])

  def close(self) -> None:
    self.ckpt.close()
    if self.traces is not None:
      self.traces.close()


def read_metrics(path) -> list[dict]:
  """The records of a metrics.jsonl file."""
  return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
