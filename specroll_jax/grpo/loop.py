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
from specroll_jax.checkpoint import Checkpointer
from specroll_jax.config import SpecConfig
from specroll_jax.data import gsm8k
from specroll_jax.data.tasks import Task
from specroll_jax.grpo.config import GRPOConfig
from specroll_jax.grpo.loss import group_advantages
from specroll_jax.grpo.step import AXIS, Batch, init_train_state, make_train_step
from specroll_jax.reflex import ReflexConfig
from specroll_jax.sampling import group_sample_ids
from specroll_jax.slow_path import SlowPathConfig
from specroll_jax.specroll import DEFAULT_REFLEX, SpecRoll
from specroll_jax.traces import TraceWriter

ROLLOUTS = ("vanilla", "specroll", "static-heads")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One GRPO run on a task's train prompts. Every default of the main job lives here.

  task: the problems (``data.tasks.Task``; GSM8K by default), scored by the GSM8K reward.
  prompts_per_step: P prompts per step, each sampled G = grpo.group_size times.
  rollout: "specroll" (the ``SpecRoll`` object: heads + group lookup + Reflex + slow path + goodput
    budgets), "static-heads" (the heads alone, fitted once) or "vanilla" (no speculation). All
    three give the same tokens.
  spec: the speculative buckets and fixed node budget (None: ``SpecConfig.auto()``).
  reflex, slow, records_per_batch: ``SpecRoll``'s Reflex (None: no corrections) and slow path
    (None: ``SlowPathConfig.for_model``), and the records it draws per batch.
  prompt_width: prompts are padded to this many tokens (fixed shapes: one compile); None: the
    longest train prompt of the task under the tokenizer, rounded up to 16. Longer prompts are
    refused.
  eval_every / eval_prompts: greedy accuracy on the first test prompts of the task every n steps
    (0: off).
  format_weight: reward bonus for a well-formed "#### N" line (the reward is 1 for a correct
    answer plus this).
  keep_checkpoints: complete checkpoints kept on disk.
  goodput: "specroll" rollouts take their node counts per bucket from ``goodput.choose``: a cost
    model of this machine measured once (``goodput.measure_cost`` over ``cost_nodes``, cached)
    and the acceptance measured so far; where no tree pays a batch runs the vanilla engine and
    every ``SpecRoll.probe_every``-th batch probes (``SpecRoll``). False: ``spec``'s budget.
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
  spec: SpecConfig | None = None
  reflex: ReflexConfig | None = DEFAULT_REFLEX
  slow: SlowPathConfig | None = None
  records_per_batch: int = 512
  kernels: str = "auto"
  prompt_width: int | None = None
  format_weight: float = 0.1
  eval_every: int = 0
  eval_prompts: int = 64
  keep_checkpoints: int = 2
  goodput: bool = True
  cost_nodes: tuple[int, ...] = (0, 4)
  vanilla_buckets: tuple[float, ...] | None = None

  def __post_init__(self):
    if self.vanilla_buckets is not None:
      object.__setattr__(self, "vanilla_buckets", _buckets.check_fractions(
          self.vanilla_buckets, "RunConfig.vanilla_buckets"))
    if self.spec is None:
      object.__setattr__(self, "spec", SpecConfig.auto())
    for name, lo in (("prompts_per_step", 1), ("max_new_tokens", 1), ("steps", 1),
                     ("eval_every", 0), ("eval_prompts", 1), ("keep_checkpoints", 1),
                     ("seed", 0), ("data_seed", 0), ("records_per_batch", 1)):
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
    self.train_step = make_train_step(config, run.grpo)
    # several processes (``distributed.initialize``): every process holds the same global batch
    # on the host, decodes and scores only the rows its devices hold under P("data") (the sample
    # ids make them the rows one process would sample), and feeds them to the data-parallel step
    # with ``make_array_from_process_local_data``; host metrics are gathered, and process 0
    # alone writes metrics.jsonl and the traces (checkpoints are saved by every process).
    self.num_processes = jax.process_count()
    self.rows_sharding = NamedSharding(self.train_step.mesh, PartitionSpec(AXIS))
    self.rows_local = self._local_rows()
    # replicated over the mesh from the start, as every step returns it: the rollout's jit then
    # sees the same parameter sharding at every step (one compile)
    self.replicated = NamedSharding(self.train_step.mesh, PartitionSpec())
    self.state = jax.device_put(init_train_state(params, run.grpo), self.replicated)
    self.heads = heads
    # "static-heads": the plain heads, proposing as SpecRoll's do with Reflex off or asleep
    # (RankedHeads for root-conditioned heads); host-local like the rows each process decodes
    self.static = None
    if run.rollout == "static-heads":
      self.static = _adapt.heads_proposer(_adapt.AdaptationConfig(), heads)
    # "specroll": the one object (``specroll.SpecRoll``) with the run's settings; its state is the
    # same in every process (its statistics are all-reduced) and is checkpointed with the run
    self.sr = self.sr_state = None
    if run.rollout == "specroll":
      self.sr = specroll_for(run, config, self.data.width)
      self.sr_state = self.sr.init(heads)
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
      self.sr_state = self._local(saved["specroll"])
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
    return self._local(self.state.params if params is None else params)

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
    """The checkpointed state. With several processes the SpecRoll state (host-local arrays, the
    same in every process) is saved as arrays replicated over the run's mesh, which every process
    writes collectively (orbax refuses host-local arrays in a multi-host save)."""
    sr = self.sr_state
    if sr is not None and self.num_processes > 1:
      def replicate(x):
        v = np.asarray(x)
        return jax.make_array_from_callback(v.shape, self.replicated, lambda idx: v[idx])
      sr = jax.tree.map(replicate, sr)
    return {"train": self.state, "specroll": sr}

  def _local(self, tree):
    """``tree`` with every leaf this process's copy (a replicated global array's local shard)."""
    return jax.tree.map(lambda x: x if getattr(x, "is_fully_addressable", True)
                        else x.addressable_data(0), tree)

  def rollout(self, params, toks, lens, sids, state=None):
    """This step's rollout of the rows ``toks`` (G rows per prompt, prompt-major): through the
    ``SpecRoll`` object (with its ``state``; returns (rollout, state)), or the static heads or
    the vanilla engine (returns (rollout, None))."""
    if self.run.rollout == "specroll":
      g = self.run.grpo.group_size
      prompts = [toks[i, : lens[i]] for i in range(0, len(toks), g)]
      batch = self.sr.batch(prompts, sids[::g] // g)
      return self.sr.generate(params, batch, state, seed=self.run.seed)
    kw = dict(sampling=self.sampling, max_new_tokens=self.run.max_new_tokens, seed=self.run.seed,
              sample_ids=sids, eos_ids=self.tok.eos_ids, prompt_lengths=lens)
    opts = _rollout.DecodeOptions(cache_length=self.cache_length, kernels=self.run.kernels)
    if self.run.rollout == "static-heads":
      prop, pp = self.static
      return _rollout.generate(self.config, params, toks, options=opts, **kw,
                               speculation=_rollout.Speculation(prop, pp, self.run.spec)), None
    opts = dataclasses.replace(opts, bucket_fractions=self.run.vanilla_buckets)
    return _rollout.generate(self.config, params, toks, options=opts, **kw), None

  def batch(self, step: int):
    run = self.run
    g = run.grpo.group_size
    toks, lens, golds, idx = self.data.batch(step * run.prompts_per_step, run.prompts_per_step)
    rep = lambda a: np.repeat(a, g, axis=0)
    sids = group_sample_ids(np.asarray(idx, np.int64), g)
    return rep(toks), rep(lens), [x for x in golds for _ in range(g)], sids

  def warmup(self) -> dict:
    """Compile the rollout and the train step on step ``next_step``'s batch without changing any
    state (copies are used and discarded). Returns the seconds of each warm-up call."""
    toks, lens, golds, sids = self.batch(self.next_step)
    sl = self.rows_local
    toks, lens, sids = toks[sl], lens[sl], sids[sl]
    t0 = time.perf_counter()
    out, _ = self.rollout(self.local_params(), toks, lens, sids, self.sr_state)
    jax.block_until_ready(out.tokens)
    t_roll = time.perf_counter() - t0
    rewards = np.zeros((len(toks),), np.float32)
    copy = jax.tree.map(jnp.array, self.state)
    t0 = time.perf_counter()
    b = Batch.from_rollout(toks, lens, out, rewards)
    res = self.train_step(copy, self._global_batch(b))
    jax.block_until_ready(res[1].loss)
    t_train = time.perf_counter() - t0
    return {"rollout_warmup_seconds": t_roll, "train_warmup_seconds": t_train}

  def step(self) -> dict:
    """One GRPO step; returns its metrics (also appended to metrics.jsonl)."""
    run, k = self.run, self.next_step
    g = run.grpo.group_size
    toks, lens, golds, sids = self.batch(k)
    sl = self.rows_local  # every row with one process
    toks, lens, golds, sids = toks[sl], lens[sl], golds[sl], sids[sl]
    params = self.local_params()
    t_start = time.perf_counter()
    out, sr_state = self.rollout(params, toks, lens, sids, self.sr_state)
    jax.block_until_ready(out.tokens)
    t_roll = time.perf_counter() - t_start
    report = out.report
    adapt_s = 0.0 if report is None else report.host_seconds
    if sr_state is not None:
      self.sr_state = sr_state
    t0 = time.perf_counter()
    out_toks, out_lens = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = out.decode(self.tok, keep_eos=True)
    rewards = _rewards.batch_rewards(texts, golds, format_weight=run.format_weight)
    correct = _rewards.batch_rewards(texts, golds)
    t_reward = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = self._global_batch(Batch.from_rollout(toks, lens, out, rewards))
    res = self.train_step(self.state, b)
    self.state, m = res[0], jax.device_get(res[1])
    t_train = time.perf_counter() - t0
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
        "rollout_seconds": t_roll - adapt_s, "adaptation_seconds": adapt_s,
        "reward_seconds": t_reward, "train_seconds": t_train,
        "step_seconds": time.perf_counter() - t_start,
        "head_acceptance": [float(x) for x in np.asarray(st.head_acceptance)],
        "nodes": [],
    }
    if report is not None:  # what SpecRoll did (``reports.SpecRollReport``)
      rec.update(tau=report.tau, probe_tau=report.probe_tau, mode=report.mode,
                 nodes=list(report.nodes), head_acceptance=list(report.depth_acceptance),
                 safety=list(report.safety), reflex=report.reflex,
                 probe_seconds=report.probe_seconds, compile_seconds=report.compile_seconds,
                 slow=None if report.slow is None else dataclasses.asdict(report.slow))
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


def specroll_for(run: RunConfig, config, prompt_width: int) -> SpecRoll:
  """The ``SpecRoll`` object of a run: its sampling, group size and lengths, the run's tree
  settings (``spec``; goodput or its fixed budget), Reflex and the slow path, prompts padded to
  the run's fixed width (one shape: one compile)."""
  return SpecRoll(config, max_new_tokens=run.max_new_tokens, sampling=run.grpo.sampling,
                  group_size=run.grpo.group_size, reflex=run.reflex, slow=run.slow,
                  records_per_batch=run.records_per_batch, spec=run.spec,
                  budget="goodput" if run.goodput else "fixed", kernels=run.kernels,
                  cost_nodes=run.cost_nodes, prompt_width=prompt_width)


def read_metrics(path) -> list[dict]:
  """The records of a metrics.jsonl file."""
  return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
