"""The host-scored GRPO training run on a GSM8K-format task (``app.tasks``: GSM8K, the synthetic
problems, or both): ``RunConfig`` (every default of the main job), the data order (``Prompts``)
and the app ``Run`` around the pure step (``app.trainer``: rollout (jitted) -> decode text ->
reward on the host -> data-parallel train step), with orbax checkpoints (SIGKILL-safe resume),
tensorstore rollout traces and a metrics.jsonl line per step.

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
from pathlib import Path

import jax
import numpy as np

from app.checkpoint import Checkpointer
from app.tasks import Task
from app.traces import TraceWriter
from app.trainer import (
  GRPOTrainer,
  LoopState,
  StepBatch,
  StepMetrics,
  Warmup,
  specroll_for,
)
from specroll_jax import rollout as _rollout
from specroll_jax._fields import check_float, check_int, check_type
from specroll_jax.adaptation.reflex import ReflexConfig
from specroll_jax.adaptation.slow_path import SlowPathConfig
from specroll_jax.data import gsm8k
from specroll_jax.engines import buckets as _buckets
from specroll_jax.engines.config import SpecConfig
from specroll_jax.grpo.config import GRPOConfig
from specroll_jax.grpo.step import init_train_state, place_state
from specroll_jax.sampling import group_sample_ids
from specroll_jax.specroll import DEFAULT_COST_NODES, DEFAULT_REFLEX, SpecRoll, SpecRollState

ROLLOUTS = ("vanilla", "specroll", "static-heads")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One GRPO run on a task's train prompts. Every default of the main job lives here.

  task: the problems (``app.tasks.Task``; GSM8K by default), scored by the GSM8K reward.
  prompts_per_step: P prompts per step, each sampled G = grpo.group_size times.
  rollout: "specroll" (the ``SpecRoll`` object: heads + group lookup + Reflex + slow path + goodput
    budgets), "static-heads" (the heads alone, fitted once) or "vanilla" (no speculation). All
    three give the same tokens.
  spec: the speculative buckets and fixed node budget (None: ``SpecConfig.auto()``).
  reflex, slow, records_per_batch: ``SpecRoll``'s Reflex (None: no corrections) and slow path
    (None: ``SlowPathConfig.for_model``), and the records it draws per batch.
  prompt_width: prompts are padded to this many tokens (fixed shapes: one compile); None: the
    longest train prompt of the task under the tokenizer padded as every entry pads
    (``rollout.prompt_width``, within the model's positions). Longer prompts are refused.
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
  model_axis: the weights, the reference, Adam's moments and the rollouts' KV cache split over
    this many devices (``specroll_jax.mesh``): the train step on the global (data, model) mesh,
    each process's rollouts on its own devices as (local / model_axis, model_axis). 1: every
    device holds the whole model.
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
  cost_nodes: tuple[int, ...] = DEFAULT_COST_NODES
  vanilla_buckets: tuple[float, ...] | None = None
  model_axis: int = 1

  def __post_init__(self):
    if self.vanilla_buckets is not None:
      object.__setattr__(self, "vanilla_buckets", _buckets.check_fractions(
          self.vanilla_buckets, "RunConfig.vanilla_buckets"))
    if self.spec is None:
      object.__setattr__(self, "spec", SpecConfig.auto())
    for name in ("prompts_per_step", "max_new_tokens", "steps", "eval_prompts",
                 "keep_checkpoints", "records_per_batch", "model_axis"):
      check_int(self, name, 1)
    for name in ("eval_every", "seed", "data_seed"):
      check_int(self, name, 0)
    check_type(self, "task", Task, what="app.tasks.Task")
    if self.rollout not in ROLLOUTS:
      raise ValueError(f"RunConfig.rollout must be one of {ROLLOUTS}, got {self.rollout!r}")
    check_float(self, "format_weight", 0)
    check_int(self, "prompt_width", 1, optional=True)

  @property
  def rows(self) -> int:
    return self.prompts_per_step * self.grpo.group_size


class Prompts:
  """A task's train prompts in a fixed shuffled order (``data_seed``), encoded once, padded to a
  fixed width. ``batch(position, n)`` returns the n prompts from ``position`` on (wrapping around
  epochs; the global index ``position + i`` keeps growing, so sample ids never repeat)."""

  def __init__(self, tok, *, data_seed: int, width: int | None, task: Task | None = None,
               limit: int | None = None):
    exs = (task or Task()).examples("train")
    self.order = np.random.default_rng(data_seed).permutation(len(exs))
    self.ids = tok.encode_batch([gsm8k.format_prompt(e.question) for e in exs])
    self.golds = [e.gold for e in exs]
    longest = max(map(len, self.ids))
    self.width = _rollout.prompt_width(longest, limit) if width is None else int(width)
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
  """The app around the GRPO step (``trainer.GRPOTrainer``): data, orbax checkpoints (SIGKILL-safe
  resume), tensorstore traces and metrics.jsonl (process 0), evaluation. ``step()`` runs one step
  and writes it (trace, metrics line, checkpoint, in that order); ``Run(..., resume=True)``
  continues from the last complete checkpoint. ``state`` is the ``trainer.LoopState``."""

  def __init__(self, run: RunConfig, config, params, tok, heads, out_dir, *, resume: bool = False,
               log=print):
    self.run, self.config, self.tok, self.log = run, config, tok, log
    self.out = Path(out_dir)
    self.out.mkdir(parents=True, exist_ok=True)
    self.data = Prompts(tok, data_seed=run.data_seed, width=run.prompt_width, task=run.task,
                        limit=config.max_position_embeddings - run.max_new_tokens)
    self.trainer = GRPOTrainer(run, config, tok, heads, self.data.width)
    self.state = self.trainer.init(init_train_state(params, run.grpo))
    self.ckpt = Checkpointer(self.out / "checkpoints", max_to_keep=run.keep_checkpoints,
                             async_save=False)
    self.writer = jax.process_index() == 0  # metrics.jsonl and traces: process 0
    self.traces = TraceWriter(self.out / "traces", batch=run.rows, prompt_len=self.data.width,
                              max_new=run.max_new_tokens,
                              scalars=(("step", "int64"), ("tau", "float32"),
                                       ("reward_mean", "float32"))) if self.writer else None
    self.metrics_path = self.out / "metrics.jsonl"
    if not resume and self.ckpt.latest_step() is not None:
      raise ValueError(f"{self.out} already holds a run (checkpoint step "
                       f"{self.ckpt.latest_step()}); resume it or use another output folder")
    latest = self.ckpt.latest_step() if resume else None
    if resume and latest is None:
      log(f"--resume: no complete checkpoint in {self.out / 'checkpoints'}; starting at step 0")
    if latest is not None:
      saved, meta = self.ckpt.restore(like=self._saved())
      self.state = LoopState(train=place_state(self.trainer.train_step.mesh, saved["train"]),
                             specroll=self.trainer.local(saved["specroll"]),
                             step=int(meta["step"]) + 1)
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

  @property
  def next_step(self) -> int:
    return self.state.step

  @property
  def sr(self) -> SpecRoll | None:
    """The run's ``SpecRoll`` object (None unless ``rollout == "specroll"``)."""
    return self.trainer.sr

  @property
  def sr_state(self) -> SpecRollState | None:
    return self.state.specroll

  def local_params(self, params=None):
    """This process's copy of the (replicated) policy parameters, for host-side decoding."""
    return self.trainer.local(self.state.train.params if params is None else params)

  def _saved(self) -> dict:
    """The checkpointed state. With several processes the SpecRoll state (host-local arrays, the
    same in every process) is saved as arrays replicated over the run's mesh, which every process
    writes collectively (orbax refuses host-local arrays in a multi-host save)."""
    sr = self.state.specroll
    if sr is not None and self.trainer.num_processes > 1:
      def replicate(x):
        v = np.asarray(x)
        return jax.make_array_from_callback(v.shape, self.trainer.replicated, lambda idx: v[idx])
      sr = jax.tree.map(replicate, sr)
    return {"train": self.state.train, "specroll": sr}

  def batch(self, step: int) -> StepBatch:
    """Step ``step``'s rows: its prompts in the data order, each G times (prompt-major)."""
    run = self.run
    g = run.grpo.group_size
    toks, lens, golds, idx = self.data.batch(step * run.prompts_per_step, run.prompts_per_step)
    rep = lambda a: np.repeat(a, g, axis=0)
    sids = group_sample_ids(np.asarray(idx, np.int64), g)
    return StepBatch(rep(toks), rep(lens), tuple(x for x in golds for _ in range(g)), sids)

  def warmup(self) -> Warmup:
    """Compile the rollout and the train step on the next step's batch; no state changes."""
    return self.trainer.warmup(self.state, self.batch(self.next_step))

  def step(self) -> StepMetrics:
    """One GRPO step, written (trace, metrics line, checkpoint); returns its metrics."""
    run, k = self.run, self.next_step
    self.state, res = self.trainer.step(self.state, self.batch(k))
    rec, rows = res.metrics, res.rows
    if run.eval_every and (k + 1) % run.eval_every == 0:
      rec = dataclasses.replace(rec, eval_accuracy=self.evaluate())
    if self.writer:
      self.traces.append({
          "prompt_ids": rows.prompt_ids, "tokens": rows.tokens, "lengths": rows.lengths,
          "rewards": rows.rewards, "logprobs": rows.logprobs, "advantages": rows.advantages,
          "step": k, "tau": rec.tau, "reward_mean": rec.reward_mean})
      with open(self.metrics_path, "a") as f:
        f.write(json.dumps(rec.to_dict()) + "\n")
        f.flush()
        os.fsync(f.fileno())
    trace_steps = self.traces.num_steps if self.writer else k + 1  # (equal on process 0)
    self.ckpt.save(k, self._saved(), {"step": k, "data_position": (k + 1) * run.prompts_per_step,
                                      "seed": run.seed, "trace_steps": trace_steps})
    return rec

  def evaluate(self, params=None) -> float:
    """Greedy strict accuracy on the first ``eval_prompts`` test prompts of the task (of the
    current policy, or of ``params``)."""
    from app import evaluation
    exs = self.run.task.examples("test")[: self.run.eval_prompts]
    res = evaluation.accuracy(self.config, self.local_params(params), self.tok, exs,
                              max_new_tokens=self.run.max_new_tokens,
                              mesh=self.trainer.rollout_mesh)
    return res.accuracy_strict

  def close(self) -> None:
    self.ckpt.close()
    if self.traces is not None:
      self.traces.close()


def read_metrics(path) -> list[StepMetrics]:
  """The records of a metrics.jsonl file."""
  return [StepMetrics.from_dict(json.loads(x)) for x in Path(path).read_text().splitlines()
          if x.strip()]


__all__ = ["ROLLOUTS", "Prompts", "Run", "RunConfig", "read_metrics", "specroll_for"]
