"""SpecRoll's adaptation on real GRPO drift: the same GRPO policy sequence replayed by static heads,
Reflex, the slow path, both, per-batch refits, a refit ceiling and group-aware lookup, side by side.

  .venv/bin/python experiments/bench_adaptation.py                      # GRPO policies, then replay
  .venv/bin/python experiments/bench_adaptation.py --temperature 0.7 --out runs/bench_adapt_t07.json
  .venv/bin/python experiments/bench_adaptation.py --grpo-lr 1e-3 \\
      --policies runs/bench_adaptation/policies_lr1e-3 --out runs/bench_adapt_lr1e-3.json
  .venv/bin/python experiments/bench_adaptation.py --quick              # smoke run

Phase 1, policies (--policies DIR). A GRPO run (``grpo.loop.Run``, vanilla rollouts at T = 1, the
synthetic task at --level, --grpo-prompts x --grpo-group per step, --grpo-lr with --grpo-warmup
steps of linear warm-up; by default the main job's 80 steps) from the embedded model (or --model)
saves the policy's parameters with orbax (``checkpoint.Checkpointer``) at step 0
and after every --save-every steps (and the last) into DIR; each checkpoint's meta names the model
(folder, hash of config.json, fingerprint of the weights), the GRPO settings, the step and that
step's GRPO metrics. The run's own state (train checkpoints, traces, metrics.jsonl) is in DIR/grpo.
DIR holding the complete sequence for the same model and settings is reused; an interrupted one is
resumed; checkpoints of other parameters (tree or shapes), of another model or of other settings
are refused (one line naming --policies, exit 2).

Phase 2, replay. Batch b: --prompts fresh synthetic *test* prompts x --group (sample id = prompt
index * G + member, ``pipeline.grpo_batch``), one fixed width, seed --seed, rolled out by policy b
at --temperature. Every arm replays the same batches against the same policies, so every arm
commits the vanilla tokens (checked: "same") and the arms differ only in how they propose. The
heads arms start from root-conditioned heads fitted on step 0: by default (--start-heads ceiling)
the ceiling's own fit of step 0 (below), so (a) and (f) share one recipe and the (a)-(f) gap is
the drift alone (0 at batch 0); --start-heads shipped starts from the heads shipped beside the
model (fitted on step 0's own rollouts with the shipping recipe). Every heads arm proposes with the
same ranked expansion (``ReflexConfig``'s topk / beams / max_nodes, uncalibrated table); every arm
runs the same ``SpecConfig`` (--node-budget, or --nodes per row). --no-drift replays the step-0
policy in every batch: a null run, where any slow-path refresh is a false alarm.

  (a) static       the step-0 heads, never changed: the plain ``RankedHeads`` proposer, the
                   ceiling's program with step 0's heads (what ``adaptation`` proposes with its
                   corrections and the slow path off)
  (b) reflex       Reflex fast path only (slow path off)
  (c) slow         slow path only ("degradation"; Reflex records but never corrects)
  (d) both         SpecRoll: Reflex + slow path ("degradation")
  (d') trainer     SpecRoll with the slow path's records from the trainer's forward of each batch
                   (``trainer_records``; ``AdaptationConfig(records="trainer")``): --trainer-anchors
                   anchors drawn per batch from the teacher-forced forward GRPO's loss runs anyway
                   (``TrainStep(return_hidden=True)`` hands it out), none recorded in the decode
                   loop; Reflex feedback every ceil(--trainer-stride-rows x active / batch rows)
                   steps, and Reflex sleeps (the plain heads propose, no in-loop cost) for
                   --trainer-sleep batches after an awake batch whose corrections did not pay
                   (``ReflexConfig.sleep_batches``; the batch after a sleep is awake), each
                   further unpaid probe doubling the sleep up to --trainer-sleep-max. The
                   replay has no trainer, so it runs that forward (``grpo.trainer_hidden``) and
                   reports its seconds apart, not charged; the records' construction and the
                   slow path are charged as host time
  (e) every_batch  slow path refitting every batch (FastGRPO-style), no Reflex corrections
  (e') scheduled   Reflex + the slow path's budgeted schedule ("scheduled": --slow-steps steps on
                   the head with the highest TV whenever 3 batches have passed and the refresh
                   time so far fits in --slow-budget of the rollout time), not on degradation
  (f) ceiling      heads fitted from scratch on each policy's own rollouts of synthetic *train*
                   prompts (--ceiling-prompts, --ceiling-steps; every --ceiling-every-th policy,
                   reused in between): the ceiling, not a method; fitting time is reported, not
                   charged
  (g) lookup       ``GroupLookup`` alone (own text + siblings, group_size = --group)
  (h) merged       ``Merged(RankedHeads, GroupLookup)`` whose heads at batch b are arm (d)'s heads
                   at batch b: (d)'s slow-path heads, *not* its in-loop Reflex corrections (the
                   library has no Reflex + lookup proposer)
The slow-path arms run ``SlowPathConfig.for_tests`` windows (a 41-batch replay, not thousands)
with --calibration batches, a check every --slow-check-every batches, z > --slow-z and an
acceptance drop of --slow-acc-drop (--slow-signal tv; with regret: a rise of the acceptance the
tree leaves on the table), a reservoir of --slow-reservoir records and --slow-steps AdamW steps
per refresh at --slow-lr. Reflex gives feedback, and the slow path its records, every
ceil(--reflex-stride-rows x active / batch rows) steps (default 1: every step of a full batch; the
library's default 4 thins the records fourfold).
(g) and (h) score with a table calibrated online (``calibration``) from the batches before (host
time charged as adaptation); --no-calibration keeps the priors.

Per batch and arm: tau, depth-1 acceptance, rollout seconds and adaptation host seconds apart, ms
per target forward (the in-loop cost against (a)). Per policy: its mean KL to step 0 and its mean
next-token entropy on the vanilla rollouts, and its parameters' relative change. Summary per arm:
mean tau, tau over the first 5 / last 10 batches, recovery as a share of the (a)-(f) gap,
(tau_arm - tau_static) / (tau_ceiling - tau_static), on the batches where the gap exceeds
--min-gap, adaptation cost as a share of rollout time (in-loop and host apart). Goals, printed as
PASS / MISS (SKIP when an arm they need was not run): (d) recovers >= 50% of the gap where it
exceeds --min-gap; (d) >= max((b), (c)) in mean tau; (d)'s adaptation <= 5% of its rollout time.
A gap that never exceeds --min-gap is reported as drift that did not stale the heads. Compile is
excluded (a warm-up call per arm, then an untimed pass of batch 0 by every arm once all are
compiled; the slow path's refresh compile is reported apart). The arms take turns within each
batch (the order rotating by one per batch), so each arm's batch b is timed within seconds of
(a)'s: the in-loop cost compares the same batch on the same machine state, and the ceiling's own
difference against (a) (it runs (a)'s program) is the noise that remains. Writes JSON and a PNG
beside it (tau per batch per arm; KL to step 0 and entropy per policy; recovered share).

Cost on 2 CPU cores: a ceiling fit at the defaults (512 prompts, 1500 steps) takes about 50 s,
once per --ceiling-every-th replayed policy (default every 2nd); fits are cached in
--policies/ceiling, keyed by the policy and every setting the fit reads, so reruns refit nothing.
--quick: 2 GRPO steps of 2 x 4 saved at every step (3 policies), 3 batches of 2 x 2, 24 tokens,
one row bucket (--buckets 1.0: one decode loop per program, in the GRPO run's and the ceiling's
vanilla rollouts too), arms static, trainer ((d'), the adaptation arm: Reflex and the slow path)
and ceiling (16 prompts, 20 steps; static, ceiling and a sleeping Reflex's batches share one
program); its policies go to --policies (default ..._quick).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import sys
import time
import warnings
from pathlib import Path

import _common
import jax
import jax.numpy as jnp
import numpy as np

from specroll_jax import adaptation as A
from specroll_jax import calibration, cli, pipeline, rollout
from specroll_jax import cond_heads as CH
from specroll_jax import slow_path as SP
from specroll_jax import trainer_records as TR
from specroll_jax.checkpoint import Checkpointer
from specroll_jax.data import gsm8k
from specroll_jax.data import synthetic as _synthetic
from specroll_jax.data.tasks import Task
from specroll_jax.grpo import logprobs as _logprobs
from specroll_jax.models import decoder as _dec
from specroll_jax.progress import progress_range
from specroll_jax.proposers import ReflexProposer
from specroll_jax.proposers.group_lookup import GroupLookup
from specroll_jax.proposers.merged import Merged
from specroll_jax.reflex import ReflexConfig
from specroll_jax.sampling import allowed_logits

ARMS = ("static", "reflex", "slow", "both", "trainer", "every_batch", "scheduled", "ceiling",
        "lookup", "merged")
QUICK_ARMS = ("static", "trainer", "ceiling")
# the adaptation arms: (Reflex corrections, slow-path mode)
ADAPT = {"reflex": (True, "off"), "slow": (False, "degradation"),
         "both": (True, "degradation"), "trainer": (True, "degradation"),
         "every_batch": (False, "every_batch"),
         "scheduled": (True, "scheduled")}
GRPO_TEMPERATURE = 1.0
DEFAULT_POLICIES = "runs/bench_adaptation/policies"


_SMALL = SP.SlowPathConfig.for_small_models()  # the slow-path flags' defaults


def parse(argv):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  _common.add_shared_flags(ap, out=None, prompts=4, group=8, max_new_tokens=48,
                           prompts_help="benchmark prompts per batch")
  ap.add_argument("--policies", default=None,
                  help=f"the policy sequence's folder (default {DEFAULT_POLICIES}, "
                       "+ '_quick' with --quick)")
  ap.add_argument("--grpo-steps", type=int, default=80, help="GRPO steps (the main job's: 80)")
  ap.add_argument("--save-every", type=int, default=8, help="save the policy every n GRPO steps")
  ap.add_argument("--grpo-lr", type=float, default=3e-4)
  ap.add_argument("--grpo-warmup", type=int, default=10,
                  help="GRPO learning-rate warm-up steps (the main job's: 10)")
  ap.add_argument("--grpo-prompts", type=int, default=16, help="GRPO prompts per step")
  ap.add_argument("--grpo-group", type=int, default=8, help="GRPO responses per prompt")
  ap.add_argument("--grpo-max-new-tokens", type=int, default=48)
  ap.add_argument("--level", type=int, default=0,
                  help="synthetic difficulty level (the main job's: 0)")
  ap.add_argument("--temperature", type=float, default=1.0, help="replay sampling temperature")
  ap.add_argument("--batches", type=int, default=None,
                  help="replayed batches = policies 0..n-1 (default: every saved policy)")
  ap.add_argument("--slow-lr", type=float, default=_SMALL.learning_rate)
  ap.add_argument("--slow-reservoir", type=int, default=_SMALL.reservoir_size,
                  help="slow-path reservoir records (all heads together)")
  ap.add_argument("--slow-steps", type=int, default=_SMALL.refresh_steps,
                  help="optimiser steps per refresh")
  ap.add_argument("--slow-chunk-size", type=int, default=_SMALL.chunk_size,
                  help="records per head in a reservoir chunk (SlowPathConfig.chunk_size)")
  ap.add_argument("--slow-step-chunks", type=int, default=_SMALL.step_chunks,
                  help="reservoir chunks per optimiser step (0: full batch; SlowPathConfig."
                       "step_chunks)")
  ap.add_argument("--slow-refresh-budget", type=float, default=_SMALL.degradation_budget,
                  help="degradation mode: refresh seconds as a share of rollout seconds at most, "
                       "0 = no cap (SlowPathConfig.degradation_budget)")
  ap.add_argument("--slow-refresh-vocab", choices=SP.VOCABS, default=_SMALL.refresh_vocab,
                  help="the refresh's training softmax: over the full vocabulary, or over each "
                       "record's support alone (SlowPathConfig.refresh_vocab)")
  ap.add_argument("--slow-selection", choices=SP.SELECTIONS, default=_SMALL.refresh_selection,
                  help="which heads a firing refreshes: those that fired, or every head degraded "
                       "at that check (SlowPathConfig.refresh_selection)")
  ap.add_argument("--slow-check-every", type=int, default=_SMALL.check_every,
                  help="slow-path batches per monitor check (records pooled over them)")
  ap.add_argument("--slow-budget", type=float, default=_SMALL.time_budget,
                  help="arm scheduled: refresh time as a share of rollout time at most")
  ap.add_argument("--slow-signal", choices=SP.SIGNALS, default="tv",
                  help="what the slow-path monitor watches (SlowPathConfig.signal)")
  ap.add_argument("--slow-acc-drop", type=float, default=_SMALL.acceptance_drop,
                  help="slow-path acceptance drop below the calibration median that a degraded "
                       "check needs besides z (SlowPathConfig.acceptance_drop; -1: TV alone)")
  ap.add_argument("--slow-z", type=float, default=_SMALL.z_threshold,
                  help="slow-path z threshold on the heads' sparse TV (SlowPathConfig.z_threshold)")
  ap.add_argument("--reflex-stride-rows", type=float, default=1.0,
                  help="Reflex feedback (and so slow-path records) every ceil(x * active rows / "
                       "batch rows) steps (ReflexConfig.stride_rows; the library default is 4)")
  ap.add_argument("--trainer-anchors", type=int, default=128,
                  help="arm trainer: anchors drawn per batch from the trainer's forward (records "
                       "per head per batch, at most; 128: the same refreshes and recovery as 512 "
                       "on the drift replay at a quarter of the records' cost, docs/benchmarks.md)")
  ap.add_argument("--trainer-stride-rows", type=float, default=4.0,
                  help="arm trainer: Reflex feedback every ceil(x * active rows / batch rows) "
                       "steps (its records are not needed: the library default 4)")
  ap.add_argument("--trainer-sleep", type=int, default=3,
                  help="arm trainer: batches Reflex sleeps after an awake batch whose corrections "
                       "did not pay (ReflexConfig.sleep_batches; 0: never sleeps)")
  ap.add_argument("--trainer-sleep-max", type=int, default=24,
                  help="arm trainer: each further awake batch that did not pay doubles the "
                       "sleep, up to this many batches (ReflexConfig.sleep_max_batches; 0: no "
                       "backoff; 24: on the 128-row replay the same tau and recovery as 0 with "
                       "Reflex awake in 4 batches of 41 instead of 11, docs/benchmarks.md)")
  ap.add_argument("--calibration", type=int, default=_SMALL.calibration_batches,
                  help="slow-path calibration batches")
  ap.add_argument("--node-budget", type=int, default=None,
                  help="tree nodes per verify forward (default: 32 or one per row of a replayed "
                       "batch, --prompts x --group, whichever is more; fewer than the rows leave "
                       "full batches without trees until rows finish)")
  ap.add_argument("--nodes", type=int, default=None,
                  help="nodes per row in every bucket (overrides --node-budget)")
  ap.add_argument("--buckets", type=float, nargs="+", default=None,
                  help="row buckets of the replay's engines, as fractions of the batch "
                       "(descending from 1.0; default the engines' own: each bucket is one more "
                       "decode loop to compile)")
  ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
  ap.add_argument("--ceiling-prompts", type=int, default=512)
  ap.add_argument("--ceiling-steps", type=int, default=1500)
  ap.add_argument("--ceiling-every", type=int, default=2,
                  help="fit the ceiling's heads on every k-th policy (reused in between)")
  ap.add_argument("--start-heads", choices=("shipped", "ceiling"), default="ceiling",
                  help="the heads every heads arm starts from: the shipped heads, or the "
                       "ceiling's own fit on step 0 (same recipe as (f): the gap is drift alone)")
  ap.add_argument("--no-drift", action="store_true",
                  help="a null run: every batch replays the step-0 policy (the gap is noise, any "
                       "slow-path refresh a false alarm)")
  ap.add_argument("--min-gap", type=float, default=0.05,
                  help="recovery counts batches where tau_ceiling - tau_static exceeds this")
  ap.add_argument("--no-calibration", action="store_true",
                  help="lookup / merged score with their prior tables")
  ap.add_argument("--quick", action="store_true",
                  help="smoke run: 2 GRPO steps, 3 batches of 2 x 2, 24 tokens, 3 arms")
  a = ap.parse_args(argv)
  _common.check_shared_flags(a, grpo_steps=1, save_every=1, grpo_warmup=0, grpo_prompts=1,
                             grpo_group=2, grpo_max_new_tokens=1, level=0, batches=2, calibration=1,
                             slow_reservoir=2, slow_steps=1, slow_check_every=1, trainer_anchors=1,
                             trainer_sleep=0, trainer_sleep_max=0, slow_step_chunks=0,
                             slow_chunk_size=1,
                             node_budget=0, nodes=0, ceiling_prompts=1, ceiling_steps=1,
                             ceiling_every=1, min_gap=0.0)
  if not 0 <= a.temperature < float("inf"):
    cli.fail("--temperature", a.temperature, "must be a finite number >= 0")
  if not (a.grpo_lr > 0 and a.grpo_lr < float("inf")):
    cli.fail("--grpo-lr", a.grpo_lr, "must be a finite number > 0")
  if not 0 <= a.slow_budget < float("inf"):
    cli.fail("--slow-budget", a.slow_budget, "must be a finite number >= 0")
  if not 0 <= a.slow_refresh_budget < float("inf"):
    cli.fail("--slow-refresh-budget", a.slow_refresh_budget, "must be a finite number >= 0")
  if not -1 <= a.slow_acc_drop <= 1:
    cli.fail("--slow-acc-drop", a.slow_acc_drop, "must be a number in [-1, 1]")
  for flag in ("reflex_stride_rows", "trainer_stride_rows"):
    if not 0 < getattr(a, flag) < float("inf"):
      cli.fail("--" + flag.replace("_", "-"), getattr(a, flag), "must be a finite number > 0")
  if not -float("inf") < a.slow_z < float("inf"):
    cli.fail("--slow-z", a.slow_z, "must be a finite number")
  if not (a.slow_lr > 0 and a.slow_lr < float("inf")):
    cli.fail("--slow-lr", a.slow_lr, "must be a finite number > 0")
  try:
    _synthetic.Difficulty.from_level(a.level)
  except ValueError as e:
    cli.fail("--level", a.level, _one_line(e))
  if a.buckets is not None:
    try:
      rollout.SpecConfig(bucket_fractions=tuple(a.buckets))
    except ValueError as e:
      cli.fail("--buckets", a.buckets, _one_line(e))
  if a.model is not None and not Path(a.model).is_dir():
    cli.fail("--model", a.model, "is not a folder (a Hugging Face model folder is expected)")
  if a.quick:
    a.grpo_steps, a.save_every, a.grpo_prompts, a.grpo_group, a.grpo_max_new_tokens = 2, 1, 2, 4, 24
    a.batches, a.prompts, a.group, a.max_new_tokens = 3, 2, 2, 24
    a.arms, a.ceiling_prompts, a.ceiling_steps, a.calibration = list(QUICK_ARMS), 16, 20, 1
    a.buckets = [1.0]  # one decode loop per program: a third of the compile at 4 rows
  suffix = "_quick" if a.quick else ""
  a.policies = a.policies or DEFAULT_POLICIES + suffix
  a.out = a.out or f"runs/bench_adaptation{suffix}.json"
  if Path(a.policies).exists() and not Path(a.policies).is_dir():
    cli.fail("--policies", a.policies, "exists and is not a folder")
  if Path(a.out).is_dir():
    cli.fail("--out", a.out, "is a folder (a .json file path is expected)")
  n = len(policy_steps(a))
  if a.batches is None:
    a.batches = n
  if a.batches > n:
    cli.fail("--batches", a.batches, f"the GRPO run saves {n} policies (--grpo-steps "
             f"{a.grpo_steps}, --save-every {a.save_every}); replay at most {n}")
  arms = [x for x in ARMS if x in set(a.arms)]
  if "merged" in arms and "both" not in arms:
    print("arm merged takes arm both's heads: running both too", flush=True)
    arms.insert(arms.index("merged"), "both")
    arms = [x for x in ARMS if x in set(arms)]
  a.arms = arms
  return a


def _one_line(e) -> str:
  return " ".join(str(e).split())


# ---------------------------------------------------------------------------------------------
# Phase 1: the policy sequence


def policy_steps(a) -> list[int]:
  """GRPO steps whose policy is saved: 0, every --save-every-th and the last."""
  return sorted(set(range(0, a.grpo_steps + 1, a.save_every)) | {a.grpo_steps})


def grpo_settings(a) -> dict:
  return {"task": "synthetic", "level": a.level, "steps": a.grpo_steps, "save_every": a.save_every,
          "learning_rate": a.grpo_lr, "warmup_steps": a.grpo_warmup,
          "prompts_per_step": a.grpo_prompts, "group": a.grpo_group,
          "max_new_tokens": a.grpo_max_new_tokens, "temperature": GRPO_TEMPERATURE,
          "seed": a.seed, "rollout": "vanilla"}


def model_identity(params, path) -> dict:
  """The model folder, a hash of its config.json and a fingerprint of its weights (every leaf's
  path, shape, dtype and first 4096 values)."""
  cfg = hashlib.sha1((Path(path) / "config.json").read_bytes()).hexdigest()[:16]
  h = hashlib.sha1()
  for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    x = np.asarray(jnp.ravel(leaf)[:4096])
    h.update(f"{jax.tree_util.keystr(kp)} {np.shape(leaf)} {x.dtype}".encode())
    h.update(np.ascontiguousarray(x).tobytes())
  return {"path": str(Path(path).resolve()), "config_hash": cfg, "weights_hash": h.hexdigest()[:16]}


class Policies:
  """The saved policy sequence; ``get(i)`` restores policy i (kept in memory when all fit in a few
  GiB)."""

  def __init__(self, ckpt: Checkpointer, steps: list[int], like, metas: dict):
    self.ckpt, self.steps, self.like, self.metas = ckpt, steps, like, metas
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(like))
    self.keep_all = nbytes * len(steps) < 4 * 2 ** 30
    self._cache = {}

  def get(self, i: int):
    step = self.steps[i]
    if step not in self._cache:
      if not self.keep_all:
        self._cache.clear()
      self._cache[step] = self.ckpt.restore(step, like=self.like)[0]
    return self._cache[step]

  def frozen(self) -> Policies:
    """The same number of policies, every one the first (--no-drift)."""
    return Policies(self.ckpt, [self.steps[0]] * len(self.steps), self.like, self.metas)


def ensure_policies(a, config, params, tok, ident) -> Policies:
  """The policy sequence of --policies: reused when complete, resumed when interrupted, else made
  by a GRPO run. Refuses (exit 2) checkpoints of other parameters, models or settings."""
  d = Path(a.policies)
  want, settings = policy_steps(a), grpo_settings(a)
  like = jax.tree.map(jnp.asarray, params)
  bad = lambda why: cli.fail("--policies", a.policies, why)
  try:
    ck = Checkpointer(d, max_to_keep=None, async_save=False)
    have = ck.all_steps()
  except Exception as e:  # noqa: BLE001 (an unreadable folder: one line, exit 2)
    bad(f"cannot be read as a policy checkpoint folder: {_one_line(e)}")
  for s in sorted({have[0], have[-1]}) if have else []:
    try:
      ck.restore(s, like=like)
    except Exception as e:  # noqa: BLE001
      bad(f"holds checkpoints whose params do not match the model {ident['path']} (step {s}): "
          f"{_one_line(e)[:400]}")
  metas = {}
  for s in have:
    m = ck.restore_meta(s)
    mm = m.get("model") or {}
    if (mm.get("config_hash"), mm.get("weights_hash")) != (ident["config_hash"],
                                                           ident["weights_hash"]):
      bad(f"step {s} was saved from another model ({mm.get('path')}, config "
          f"{mm.get('config_hash')}, weights {mm.get('weights_hash')}), not {ident['path']} "
          f"(config {ident['config_hash']}, weights {ident['weights_hash']}); use another folder")
    if m.get("grpo") != settings:
      other = m.get("grpo") or {}
      diff = {k: other.get(k) for k in sorted(set(settings) | set(other))
              if other.get(k) != settings.get(k)}
      bad(f"holds a policy sequence with other GRPO settings {diff} (this run: "
          f"{ {k: settings.get(k) for k in diff} }); use another folder or those settings")
    metas[s] = m
  if set(have) - set(want):
    bad(f"holds steps {sorted(set(have) - set(want))} that these settings never save")
  if have == want:
    print(f"policies: reusing the {len(want)} saved policies in {d} (GRPO steps 0..{want[-1]} "
          f"every {a.save_every}, lr {a.grpo_lr}; same model and settings)", flush=True)
    return Policies(ck, want, like, metas)
  run_grpo(a, config, params, tok, ident, ck, have, want, metas)
  return Policies(ck, want, like, metas)


def run_grpo(a, config, params, tok, ident, ck, have, want, metas) -> None:
  from specroll_jax.grpo import GRPOConfig
  from specroll_jax.grpo.loop import Run, RunConfig
  sampling = rollout.SamplingConfig(temperature=GRPO_TEMPERATURE)
  cfg = RunConfig(grpo=GRPOConfig(group_size=a.grpo_group, learning_rate=a.grpo_lr,
                                  warmup_steps=a.grpo_warmup, sampling=sampling),
                  task=Task(name="synthetic", level=a.level), prompts_per_step=a.grpo_prompts,
                  max_new_tokens=a.grpo_max_new_tokens, steps=a.grpo_steps, seed=a.seed,
                  rollout="vanilla",
                  vanilla_buckets=None if a.buckets is None else tuple(a.buckets))
  resume = bool(have)
  try:
    r = Run(cfg, config, params, tok, None, Path(a.policies) / "grpo", resume=resume,
            log=lambda m: print(f"GRPO: {m}", flush=True))
  except ValueError as e:
    cli.fail("--policies", a.policies, _one_line(e))
  n = r.next_step  # updates done
  if not ({s for s in want if s < n} <= set(have) <= {s for s in want if s <= n}):
    r.close()
    cli.fail("--policies", a.policies, f"holds policies {have} that do not match its GRPO run "
             f"(next step {n}); remove the folder")
  print(f"policies: GRPO on the synthetic task (level {a.level}), {a.grpo_prompts} x "
        f"{a.grpo_group} per step, lr {a.grpo_lr}, {a.grpo_max_new_tokens} tokens; saving steps "
        f"{want[0]}..{want[-1]} every {a.save_every} into {a.policies}"
        + (f" (resumed at step {n})" if resume else ""), flush=True)
  meta = lambda s, rec: {"step": s, "model": ident, "grpo": grpo_settings(a), "metrics": None
                         if rec is None else {k: rec[k] for k in (
                             "reward_mean", "accuracy", "groups_mixed", "entropy", "mean_length",
                             "grad_norm")}}
  for s, state in ((0, params), (n, r.state.params)):
    if s in want and s not in have:  # step 0, or the step an interruption left unsaved
      metas[s] = meta(s, None)
      ck.save(s, state, metas[s])
      have = sorted([*have, s])
  rewards = []
  for _ in progress_range(cfg.steps - n, "GRPO steps"):
    rec = r.step()
    rewards.append(rec["reward_mean"])
    s = rec["step"] + 1
    if s in want:
      metas[s] = meta(s, rec)
      ck.save(s, r.state.params, metas[s])
  r.close()
  if rewards:
    print(f"GRPO: reward first {min(3, len(rewards))} {np.mean(rewards[:3]):.3f} -> last "
          f"{min(3, len(rewards))} {np.mean(rewards[-3:]):.3f}", flush=True)


# ---------------------------------------------------------------------------------------------
# Phase 2: replay


@functools.partial(jax.jit, static_argnames=("config", "sampling"))
def policy_scores(params, ref, prompts, prompt_lengths, tokens, lengths, *, config, sampling):
  """Mean next-token entropy of ``params`` and its mean KL(params || ref) over the response
  tokens (the sampling rule's distributions, teacher forced as the trainer does)."""
  seq, pos, mask, anchors = _logprobs.sequences(prompts, prompt_lengths, tokens, lengths)

  def logp(p):
    out = _dec.step(config, p, seq, pos, None, mask, compute_logits=False)
    h = jnp.take_along_axis(out.hidden, anchors[..., None], axis=1)
    return jax.nn.log_softmax(allowed_logits(_dec.logits_from_hidden(config, p, h), sampling), -1)

  lp, lq = logp(params), logp(ref)
  pr = jnp.exp(lp)
  ent = -jnp.sum(jnp.where(pr > 0, pr * lp, 0.0), -1)
  kl = jnp.sum(jnp.where(pr > 0, pr * (lp - lq), 0.0), -1)
  live = jnp.arange(tokens.shape[1])[None] < lengths[:, None]
  n = jnp.maximum(live.sum(), 1)
  return jnp.where(live, ent, 0.0).sum() / n, jnp.where(live, kl, 0.0).sum() / n


def param_change(params, ref) -> float:
  """||params - ref|| / ||ref|| over every leaf."""
  num = sum(float(jnp.sum((jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)) ** 2))
            for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True))
  den = sum(float(jnp.sum(jnp.asarray(y, jnp.float32) ** 2)) for y in jax.tree.leaves(ref))
  return float(np.sqrt(num / max(den, 1e-30)))


def replay_batches(a, tok, task):
  """[(prompts [B, W], sample ids [B], prompt lengths [B])] per batch: fresh test prompts each
  batch, one width for all."""
  exs = task.examples("test")
  ids = tok.encode_batch([gsm8k.format_prompt(exs[i % len(exs)].question)
                          for i in range(a.batches * a.prompts)])
  width = rollout.pad_prompts(ids)[0].shape[1]
  out = []
  for b in range(a.batches):
    rows, sids = pipeline.grpo_batch(ids[b * a.prompts:(b + 1) * a.prompts], a.group,
                                     first_prompt_index=b * a.prompts)
    arr, lens = rollout.pad_prompts(rows, width)
    out.append((arr, sids, lens))
  return out, width


def slow_config(a, mode: str) -> SP.SlowPathConfig:
  """CPU-sized windows (tens of batches, not thousands) and a learning rate for a tiny model's
  heads (the DESIGN default 1e-5 is for 1.5B-parameter heads trained at ~1e-4)."""
  return SP.SlowPathConfig.for_tests(mode=mode, learning_rate=a.slow_lr,
                                     reservoir_size=a.slow_reservoir, refresh_steps=a.slow_steps,
                                     chunk_size=a.slow_chunk_size,
                                     step_chunks=a.slow_step_chunks,
                                     degradation_budget=a.slow_refresh_budget,
                                     refresh_selection=a.slow_selection,
                                     refresh_vocab=a.slow_refresh_vocab,
                                     check_every=a.slow_check_every, z_threshold=a.slow_z,
                                     scheduled_steps=a.slow_steps, time_budget=a.slow_budget,
                                     acceptance_drop=a.slow_acc_drop, signal=a.slow_signal,
                                     calibration_batches=a.calibration)


def _commit(tree):
  """``tree`` committed to the first device, like the restored policies and everything computed
  from them: a jitted call whose arguments change from uncommitted to committed compiles again
  (the adaptation state is uncommitted when built, committed once a batch has updated it)."""
  return jax.device_put(tree, jax.devices()[0])


def _release():
  """Drop compiled programs nothing later reuses: each speculative rollout program holds ~3k
  memory mappings (XLA:CPU maps every kernel), and one process may hold 65530. The arms take
  turns per batch, so all of their programs are live at once: all ten arms peaked at about 27k
  mappings (3 batches of 128 rows, default buckets)."""
  import gc
  jax.clear_caches()
  gc.collect()


class AdaptArm:
  """An arm carried by ``adaptation`` (heads + Reflex + slow path, or the static heads)."""

  def __init__(self, state, keep_heads: bool):
    self.state = state
    self.heads = [] if keep_heads else None  # the heads each batch proposed with (arm merged)

  def kwargs(self, b):
    return {"adaptation": self.state}, 0.0

  def heads_at(self, b: int):
    """The heads batch ``b`` proposed with (or, before that batch ran, proposes with)."""
    return self.heads[b] if b < len(self.heads) else self.state.heads

  def warm(self, out) -> None:
    """Nothing more to warm up: the warm-up rollout ran ``after_rollout`` (its state dropped)."""

  def more_warmups(self) -> list[dict]:
    """generate() keywords of further warm-up rollouts: with ``sleep_batches`` > 0, a sleeping
    Reflex's batch (the plain heads' program), so no timed batch compiles."""
    if self.state.config.reflex.sleep_batches == 0:
      return []
    r = self.state.reflex
    return [{"adaptation": self.state.replace(reflex=r.replace(sleep=r.sleep + 1))}]

  def after(self, out) -> tuple[float, float, dict]:
    """(host seconds, compile seconds, report) of the batch just rolled out."""
    if self.heads is not None:
      self.heads.append(self.state.heads)
    self.state = out.adaptation
    rep = out.adaptation_report
    slow = rep.get("slow") or {}
    comp = float(slow.get("compile_seconds") or 0.0)
    info = {"reflex": rep.get("reflex"), "safety": rep.get("safety")}
    if slow:
      info["slow"] = {k: slow.get(k) for k in ("decision", "heads", "kept", "rolled_back",
                                               "refresh_seconds", "z", "tv", "records")}
    return float(rep["adaptation_seconds"]) - comp, comp, info


class TrainerArm(AdaptArm):
  """Arm trainer: ``adaptation`` with ``records="trainer"``. After each rollout the trainer's
  teacher-forced forward of the batch under the policy that rolled it out (run here, since the
  replay has no trainer: its seconds are reported apart, not charged), ``trainer_records`` from
  its hidden states and ``adaptation.after_trainer`` (both charged as host time)."""

  def __init__(self, state, *, config, policies, batches, sampling, num_anchors, seed):
    super().__init__(state, keep_heads=False)
    self.config, self.policies, self.batches = config, policies, batches
    self.sampling, self.num_anchors, self.seed = sampling, num_anchors, seed
    self.b = 0

  def kwargs(self, b):
    self.b = b
    return super().kwargs(b)

  def _records(self, out, b):
    cfg = out.adaptation.config.reflex
    pb = self.policies.get(b)
    arr, _, lens = self.batches[b]
    t = time.perf_counter()
    hid = jax.block_until_ready(TR.anchor_hidden(self.config, pb, arr, lens, out.tokens,
                                                 out.lengths))
    fwd = time.perf_counter() - t
    t = time.perf_counter()
    recs = jax.block_until_ready(TR.from_hidden(
        cfg, self.config, pb, out.adaptation.heads, hid, out.tokens, out.lengths,
        jnp.asarray(lens), sampling=self.sampling, key=jax.random.key(self.seed * 7919 + b),
        num_anchors=self.num_anchors))
    return pb, recs, fwd, time.perf_counter() - t

  def warm(self, out) -> None:
    """Compile the trainer's forward, the records and the slow path's monitor on the warm-up
    rollout (results dropped: the monitor is still calibrating, nothing refreshes)."""
    pb, recs, _, _ = self._records(out, 0)
    A.after_trainer(out.adaptation, self.config, pb, recs, out.adaptation_report)

  def after(self, out) -> tuple[float, float, dict]:
    rep = out.adaptation_report
    pb, recs, fwd, build = self._records(out, self.b)
    self.state, slow = A.after_trainer(out.adaptation, self.config, pb, recs, rep)
    comp = float(slow.get("compile_seconds") or 0.0)
    info = {"reflex": rep.get("reflex"), "safety": rep.get("safety"),
            "trainer_forward_seconds": fwd, "records_seconds": build,
            "slow": {k: slow.get(k) for k in ("decision", "heads", "kept", "rolled_back",
                                              "refresh_seconds", "z", "tv", "records")}}
    host = float(rep["adaptation_seconds"]) + build + float(slow["adaptation_seconds"]) - comp
    return host, comp, info


class ProposerArm:
  """A fixed proposer whose parameters come per batch from ``make(b, table)``; with a calibration,
  the table is updated on the host after every batch (its time charged as adaptation)."""

  def __init__(self, proposer, make, calibrate: bool, commit: bool = True):
    self.proposer, self.make, self.commit = proposer, make, commit  # commit: _commit the params
    self.cal = calibration.init(proposer.default_acceptance()) if calibrate else None

  def kwargs(self, b):
    t0 = time.perf_counter()
    table = None if self.cal is None else self.cal.table()
    pp = self.make(b, table)
    pp = _commit(pp) if self.commit else pp
    return {"proposer": self.proposer, "proposer_params": pp}, time.perf_counter() - t0

  def warm(self, out) -> None:
    """Run the calibration update once on the warm-up rollout (result dropped): its first call
    compiles eager ops."""
    if self.cal is not None:
      jax.block_until_ready(self.cal.update(out.stats.spec.proposer).table())

  def more_warmups(self) -> list[dict]:
    return []

  def after(self, out) -> tuple[float, float, dict]:
    t0 = time.perf_counter()
    if self.cal is not None:
      self.cal = self.cal.update(out.stats.spec.proposer)
    return time.perf_counter() - t0, 0.0, {}


def fit_ceilings(a, config, policies, tok, task, sampling, heads0,
                 batches: int) -> tuple[list, list, list]:
  """(heads, fit seconds, final per-head soft CE) per batch: heads fitted from scratch on policy
  b's own rollouts of the task's *train* prompts, every --ceiling-every-th policy. Each fit is
  cached in --policies/ceiling (keyed by the policy's step and every setting the fit reads), so a
  rerun on the same policies refits nothing; the fit seconds reported are the original fit's."""
  heads, secs, ce = [], [], []
  cache = Path(a.policies) / "ceiling"
  for b in progress_range(batches, f"ceiling: fit heads on policies' own rollouts "
                                     f"({a.ceiling_prompts} prompts, {a.ceiling_steps} steps)"):
    if b % a.ceiling_every:
      heads.append(heads[-1])
      secs.append(0.0)
      ce.append(ce[-1])
      continue
    what = {"step": policies.steps[b], "model": policies.metas[policies.steps[b]].get("model"),
            "grpo": grpo_settings(a), "prompts": a.ceiling_prompts,
            "fit_steps": a.ceiling_steps, "max_new_tokens": a.max_new_tokens,
            "sampling": repr(sampling), "seed": a.seed, "level": a.level,
            "num_heads": heads0.num_heads, "width": heads0.width}
    if a.buckets is not None:  # the rollouts' row layout (same tokens; hidden states to rounding)
      what["buckets"] = list(a.buckets)
    key = hashlib.sha1(json.dumps(what, sort_keys=True).encode())
    file = cache / f"step{policies.steps[b]:05d}_{key.hexdigest()[:12]}.safetensors"
    side = file.with_suffix(".json")
    if file.exists() and side.exists():
      heads.append(_commit(CH.load(file)))
      info = json.loads(side.read_text())
      secs.append(info["fit_seconds"])
      ce.append(info["final_soft_ce"])
      continue
    t0 = time.perf_counter()
    params = policies.get(b)
    toks, lens, hid = pipeline.self_rollouts(config, params, tok, num_prompts=a.ceiling_prompts,
                                             max_new_tokens=a.max_new_tokens, sampling=sampling,
                                             seed=a.seed + 1, chunk=64, task=task,
                                             bucket_fractions=None if a.buckets is None
                                             else tuple(a.buckets))
    hd = CH.init(jax.random.key(a.seed + 1234), config, heads0.num_heads, width=heads0.width)
    hd, hist = CH.fit(config, params, hd, toks, lens, hid, sampling=sampling,
                      steps=a.ceiling_steps, progress=False)
    heads.append(hd)
    secs.append(time.perf_counter() - t0)
    ce.append(np.asarray(hist[-1]).tolist())
    cache.mkdir(parents=True, exist_ok=True)
    CH.save(file, hd)
    tmp = side.with_suffix(".tmp")
    tmp.write_text(json.dumps({"fit_seconds": secs[-1], "final_soft_ce": ce[-1]}))
    tmp.replace(side)
  return heads, secs, ce


def _nan_to_none(xs):
  return [None if not np.isfinite(x) else float(x) for x in xs]


def main(argv=None):
  a = parse(argv)
  try:
    config, params, tok, path = pipeline.load_model(a.model)
  except ValueError as e:
    cli.fail("--model", a.model, _one_line(e))
  ident = model_identity(params, path)
  policies = ensure_policies(a, config, params, tok, ident)
  if a.no_drift:
    policies = policies.frozen()
  _release()
  task = Task(name="synthetic", level=a.level)
  sampling = rollout.SamplingConfig(temperature=a.temperature)
  heads0 = pipeline.default_heads(config, params, tok, path, conditioned=True)
  if not isinstance(heads0, CH.CondHeads):  # every heads arm uses root-conditioned heads
    print(f"note: {path} ships no root-conditioned heads: fitting them on step 0's own rollouts "
          f"({a.ceiling_prompts} synthetic train prompts, {a.ceiling_steps} steps; cached)",
          flush=True)
    heads0 = pipeline.fitted_cond_heads(config, params, tok, path, num_prompts=a.ceiling_prompts,
                                        max_new_tokens=a.max_new_tokens, sampling=sampling,
                                        steps=a.ceiling_steps, task=task)
  fractions = rollout.SpecConfig().bucket_fractions if a.buckets is None else tuple(a.buckets)
  budget = max(32, a.prompts * a.group) if a.node_budget is None else a.node_budget
  spec = rollout.SpecConfig(node_budget=budget, bucket_fractions=fractions,
                            nodes=None if a.nodes is None else (a.nodes,) * len(fractions))
  rcfg = ReflexConfig(topk=spec.topk, conditioned=True, stride_rows=a.reflex_stride_rows)
  batches, width = replay_batches(a, tok, task)
  kw = lambda b: dict(sampling=sampling, max_new_tokens=a.max_new_tokens, seed=a.seed,
                      sample_ids=batches[b][1], eos_ids=tok.eos_ids,
                      prompt_lengths=batches[b][2], cache_length=width + a.max_new_tokens)
  van_kw = {} if a.buckets is None else {"bucket_fractions": fractions}
  # vanilla: the reference tokens, the policies' entropy and KL to step 0 along them
  ref, van_s, pol = [], [], []
  p0 = policies.get(0)
  for b in progress_range(a.batches, "vanilla rollouts + KL / entropy per policy"):
    pb = policies.get(b)
    if b == 0:  # compile
      jax.block_until_ready(rollout.generate(config, pb, batches[b][0], **kw(b), **van_kw).tokens)
    t = time.perf_counter()
    out = rollout.generate(config, pb, batches[b][0], **kw(b), **van_kw)
    jax.block_until_ready(out.tokens)
    van_s.append(time.perf_counter() - t)
    ref.append((np.asarray(out.tokens), np.asarray(out.lengths)))
    ent, kl = policy_scores(pb, p0, jnp.asarray(batches[b][0]), jnp.asarray(batches[b][2]),
                            out.tokens, out.lengths, config=config, sampling=sampling)
    m = policies.metas[policies.steps[b]]
    pol.append({"index": b, "step": policies.steps[b], "kl_to_step0": float(kl),
                "entropy": float(ent), "param_change": param_change(pb, p0),
                "grpo": m.get("metrics")})
  _release()
  ceiling = None
  if "ceiling" in a.arms or a.start_heads == "ceiling":  # without arm ceiling: step 0's fit only
    c_heads, c_secs, c_ce = fit_ceilings(a, config, policies, tok, task, sampling, heads0,
                                         a.batches if "ceiling" in a.arms else 1)
    if "ceiling" in a.arms:
      ceiling = {"fit_seconds": c_secs, "final_soft_ce": c_ce, "every": a.ceiling_every,
                 "prompts": a.ceiling_prompts, "steps": a.ceiling_steps}
    _release()
    if a.start_heads == "ceiling":
      heads0 = c_heads[0]
  ranked = ReflexProposer(rcfg).ranked
  gl = GroupLookup(group_size=a.group)
  mg = Merged(heads=ranked, lookup=gl, max_nodes=rcfg.max_nodes)
  calibrate = not a.no_calibration
  warmup_s, runners = {}, {}
  heads0 = _commit(heads0)  # the ranked arms pass heads as they are, committed like the policies
  if ceiling is not None:
    c_heads = [_commit(h) for h in c_heads]
  order = sorted(a.arms, key=lambda x: (x not in ("static", "ceiling"), ARMS.index(x)))
  for arm in order:
    if arm == "trainer":
      ac = A.AdaptationConfig(
          reflex=dataclasses.replace(rcfg, stride_rows=a.trainer_stride_rows, record_capacity=0,
                                     sleep_batches=a.trainer_sleep,
                                     sleep_max_batches=a.trainer_sleep_max),
          slow=slow_config(a, "degradation"), records="trainer").for_sampling(sampling)
      runner = TrainerArm(_commit(A.init(ac, heads0)), config=config, policies=policies,
                          batches=batches, sampling=sampling, num_anchors=a.trainer_anchors,
                          seed=a.seed)
    elif arm == "static":  # the ceiling's program (same proposer, step 0's heads): one compile
      # committed heads (committed once, below), the acceptance table as RankedHeads.params
      # makes it: as a sleeping Reflex's batch passes them (adaptation.proposer), so arm trainer
      # reuses this program
      runner = ProposerArm(ranked, lambda b, t: ranked.params(heads0), calibrate=False,
                           commit=False)
    elif arm in ADAPT:
      corr, mode = ADAPT[arm]
      ac = A.AdaptationConfig(reflex=dataclasses.replace(rcfg, apply_corrections=corr),
                              slow=slow_config(a, mode)).for_sampling(sampling)
      runner = AdaptArm(_commit(A.init(ac, heads0)),
                        keep_heads=arm == "both" and "merged" in a.arms)
    elif arm == "ceiling":
      runner = ProposerArm(ranked, lambda b, t: ranked.params(c_heads[b]), calibrate=False,
                           commit=False)
    elif arm == "lookup":
      runner = ProposerArm(gl, lambda b, t: gl.context(
          None if t is None else t.reshape(gl.acceptance_shape)), calibrate=calibrate)
    else:  # merged: arm both's heads at batch b (those it proposes batch b with)
      runner = ProposerArm(mg, lambda b, t, both=runners["both"]: mg.params(both.heads_at(b), t),
                           calibrate=calibrate)
    gk, _ = runner.kwargs(0)
    t = time.perf_counter()  # warm-up (compile); its output state is discarded
    warm = rollout.generate(config, policies.get(0), batches[0][0], spec=spec, **gk, **kw(0))
    jax.block_until_ready(warm.tokens)
    runner.warm(warm)
    for extra in runner.more_warmups():  # e.g. a sleeping Reflex's program (the plain heads)
      jax.block_until_ready(rollout.generate(config, policies.get(0), batches[0][0], spec=spec,
                                             **extra, **kw(0)).tokens)
    warmup_s[arm] = time.perf_counter() - t
    del warm
    runners[arm] = runner
  # one more untimed pass of batch 0 per arm, now that every program is compiled: in a run where
  # the first timed call followed the other arms' compiles, static's batch 0 took 1.7x its later
  # ms per forward (its output, and any state it would carry, is dropped)
  for arm in order:
    gk, _ = runners[arm].kwargs(0)
    jax.block_until_ready(rollout.generate(config, policies.get(0), batches[0][0], spec=spec,
                                           **gk, **kw(0)).tokens)
  # the arms take turns within each batch, the order rotating by one per batch: every arm's
  # batch b runs within seconds of the others', so the machine's drift over the run (this VM's
  # speed moves by tens of percent) cancels from the per-batch comparisons against (a)
  results = {arm: [] for arm in order}
  for b in progress_range(a.batches, f"arms {', '.join(order)} (in turn per batch)"):
    pb = policies.get(b)
    for j in range(len(order)):
      arm = order[(b + j) % len(order)]
      runner = runners[arm]
      gk, host_before = runner.kwargs(b)
      t = time.perf_counter()
      out = rollout.generate(config, pb, batches[b][0], spec=spec, **gk, **kw(b))
      jax.block_until_ready(out.tokens)
      sec = time.perf_counter() - t
      in_gen = float((out.adaptation_report or {}).get("adaptation_seconds", 0.0))
      host, comp, info = runner.after(out)
      st = out.stats
      acc = np.where(np.asarray(st.head_proposed) > 0, np.asarray(st.head_acceptance), np.nan)
      same = bool((np.asarray(out.tokens) == ref[b][0]).all()
                  and (np.asarray(out.lengths) == ref[b][1]).all())
      results[arm].append({
          "batch": b, "policy_step": policies.steps[b], "tau": st.tokens_per_forward,
          "depth1": None if not np.isfinite(acc[0]) else float(acc[0]),
          "acceptance": _nan_to_none(acc), "same": same, "turn": j,
          "forwards": st.forwards, "seconds": sec - in_gen,
          "ms_per_forward": 1e3 * (sec - in_gen) / (st.forwards),
          "adaptation_seconds": host + host_before, "compile_seconds": comp, **info})
      del out
  del runners
  _release()
  results = {x: results[x] for x in a.arms}
  summary, goals = report(results, pol, van_s, a)
  meta = {"command": "experiments/bench_adaptation.py " + " ".join(
      sys.argv[1:] if argv is None else argv), "cpu": _common.cpu_model(), "jax": jax.__version__,
      "device": jax.devices()[0].device_kind, "model": ident, "policies": str(a.policies),
      "grpo": grpo_settings(a), "args": vars(a), "spec": dataclasses.asdict(spec),
      "heads": type(heads0).__name__, "warmup_seconds": warmup_s}
  out_path = Path(a.out)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  out_path.write_text(json.dumps({"meta": meta, "summary": summary, "goals": goals,
                                  "policies": pol, "vanilla_seconds": van_s, "ceiling": ceiling,
                                  "arms": results}, indent=2))
  plot(results, pol, summary, out_path.with_suffix(".png"), a)
  print(f"wrote {out_path} and {out_path.with_suffix('.png')}")
  return {"summary": summary, "goals": goals, "policies": pol, "arms": results}


# ---------------------------------------------------------------------------------------------
# Summary, goals, table, plot


def gaps(results, a):
  """tau_ceiling - tau_static per batch and the batches where it exceeds --min-gap (None without
  both arms)."""
  if "static" not in results or "ceiling" not in results:
    return None, None
  gap = (np.array([r["tau"] for r in results["ceiling"]])
         - np.array([r["tau"] for r in results["static"]]))
  return gap, gap > a.min_gap


def summarize(results, van_s, a) -> dict:
  ms = lambda rec: 1e3 * sum(r["seconds"] for r in rec) / sum(r["forwards"] for r in rec)
  static = results.get("static")
  on_static = lambda rec: ms([static[r["batch"]] for r in rec])  # static on the same batches
  gap, qual = gaps(results, a)
  tau_static = np.array([r["tau"] for r in results["static"]]) if "static" in results else None
  out = {}
  for arm, rec in results.items():
    tau = np.array([r["tau"] for r in rec])
    acc = np.array([[np.nan if x is None else x for x in r["acceptance"]] for r in rec],
                   np.float64)
    roll = sum(r["seconds"] for r in rec)
    host = sum(r["adaptation_seconds"] for r in rec)
    # the in-loop cost: ms per forward over static's on the same batches, charged on the batches
    # where Reflex ran; a batch where it slept ran static's own program (the plain heads), so
    # its difference is the machine's noise, reported apart (``in_loop_asleep_cost``)
    slept = [r for r in rec if (r.get("reflex") or {}).get("asleep")]
    awake = [r for r in rec if not (r.get("reflex") or {}).get("asleep")]
    in_loop, in_loop_s, noise = None, 0.0, None
    if static is not None:
      in_loop = ms(awake) / on_static(awake) - 1 if awake else 0.0
      if awake:
        in_loop_s = (max(ms(awake) - on_static(awake), 0.0)
                     * sum(r["forwards"] for r in awake) / 1e3)
      noise = ms(slept) / on_static(slept) - 1 if slept else None
    kept = sum(len((r.get("slow") or {}).get("kept") or []) for r in rec)
    back = sum(len((r.get("slow") or {}).get("rolled_back") or []) for r in rec)
    with warnings.catch_warnings():  # depths no tree reached: NaN, not a warning
      warnings.simplefilter("ignore", RuntimeWarning)
      mean_acc = _nan_to_none(np.nanmean(acc, axis=0)) if acc.size else []
    s = {"mean_tau": float(tau.mean()), "tau_first5": float(tau[:5].mean()),
         "tau_last10": float(tau[-10:].mean()), "acceptance": mean_acc,
         "all_same": all(r["same"] for r in rec), "ms_per_forward": ms(rec),
         "rollout_seconds": roll, "adaptation_seconds": host,
         "compile_seconds": sum(r["compile_seconds"] for r in rec),
         "in_loop_cost": in_loop, "in_loop_share": in_loop_s / max(roll, 1e-9),
         "in_loop_asleep_cost": noise,
         "host_share": host / max(roll, 1e-9), "kept": kept, "rolled_back": back,
         "speedup_vs_vanilla": sum(van_s) / max(roll + host, 1e-9)}
    s["adaptation_share"] = s["in_loop_share"] + s["host_share"]
    # arm trainer: the teacher-forced forward GRPO's loss runs anyway (not charged)
    s["trainer_forward_seconds"] = sum(r.get("trainer_forward_seconds") or 0.0 for r in rec)
    s["records_seconds"] = sum(r.get("records_seconds") or 0.0 for r in rec)
    # ReflexConfig.sleep_batches: batches the plain heads proposed while Reflex slept
    s["asleep_batches"] = len(slept)
    s["recovery_batches"] = 0
    s["recovery"] = None
    s["recovery_per_batch"] = None
    if gap is not None and arm not in ("static", "ceiling"):
      share = (tau - tau_static) / np.where(qual, gap, 1.0)
      s["recovery_per_batch"] = [float(x) if q else None for x, q in zip(share, qual, strict=True)]
      s["recovery_batches"] = int(qual.sum())
      s["recovery"] = float(share[qual].mean()) if qual.any() else None
    out[arm] = s
  return out


def goals_of(summary, results, pol, a) -> list[dict]:
  """The goals as (name, status PASS / MISS / SKIP, detail), for (d) and, when it ran, for (d')
  (SpecRoll with the trainer's records)."""
  g = []
  for arm, lab in (("both", "(d)"), ("trainer", "(d')")):
    if arm == "both" or arm in summary:
      g += _arm_goals(summary, results, pol, a, arm, lab)
  return g


def _arm_goals(summary, results, pol, a, arm, lab) -> list[dict]:
  g = []
  gap, qual = gaps(results, a)
  both = summary.get(arm)
  if both is None or gap is None:
    g.append({"goal": f"{lab} recovers >= 50% of the gap", "status": "SKIP",
              "detail": f"needs arms static, ceiling and {arm}"})
  elif not qual.any():
    g.append({"goal": f"{lab} recovers >= 50% of the gap", "status": "SKIP",
              "detail": f"the gap never exceeds {a.min_gap} tau: the drift did not stale the heads "
                        f"(max gap {gap.max():+.3f} at batch {int(gap.argmax())}; KL to step 0 at "
                        f"the last policy {pol[-1]['kl_to_step0']:.4f} nats/token; tau static "
                        f"{summary['static']['tau_first5']:.3f} first 5 -> "
                        f"{summary['static']['tau_last10']:.3f} last 10, ceiling "
                        f"{summary['ceiling']['tau_first5']:.3f} -> "
                        f"{summary['ceiling']['tau_last10']:.3f})"
                        + (f"; the ceiling is below the static heads already at step 0 "
                           f"({gap[0]:+.3f}): its fit is weaker than the shipped heads' (raise "
                           "--ceiling-prompts / --ceiling-steps)" if gap[0] < -a.min_gap else "")})
  else:
    ok = both["recovery"] >= 0.5
    g.append({"goal": f"{lab} recovers >= 50% of the gap", "status": "PASS" if ok else "MISS",
              "detail": f"mean share {100 * both['recovery']:.1f}% over the "
                        f"{both['recovery_batches']} batches where the gap exceeds {a.min_gap}"})
  others = [x for x in ("reflex", "slow") if x in summary]
  if both is None or not others:
    g.append({"goal": f"{lab} >= max((b), (c))", "status": "SKIP",
              "detail": f"needs arm {arm} and reflex or slow"})
  else:
    best = max(others, key=lambda x: summary[x]["mean_tau"])
    ok = both["mean_tau"] >= summary[best]["mean_tau"]
    g.append({"goal": f"{lab} >= max((b), (c))", "status": "PASS" if ok else "MISS",
              "detail": f"mean tau {arm} {both['mean_tau']:.4f} vs {best} "
                        f"{summary[best]['mean_tau']:.4f}"})
  if both is None or "static" not in summary:
    g.append({"goal": f"{lab} adaptation <= 5% of rollout time", "status": "SKIP",
              "detail": f"needs arms static and {arm}"})
  else:
    ok = both["adaptation_share"] <= 0.05
    extra = ""
    if arm == "trainer":
      extra = (f" (the trainer's forward, {both['trainer_forward_seconds']:.2f} s = "
               f"{100 * both['trainer_forward_seconds'] / max(both['rollout_seconds'], 1e-9):.1f}%"
               " of rollout, is GRPO's own and not charged; Reflex slept in "
               f"{both['asleep_batches']} of {len(results[arm])} batches, in-loop charged on "
               "the others")
      if both.get("in_loop_asleep_cost") is not None:
        extra += (f"; the asleep batches (static's program) ran "
                  f"{100 * both['in_loop_asleep_cost']:+.1f}% per forward vs static: the noise")
      extra += ")"
    g.append({"goal": f"{lab} adaptation <= 5% of rollout time", "status": "PASS" if ok else "MISS",
              "detail": f"{lab}: in-loop {100 * both['in_loop_share']:.1f}% + host "
                        f"{100 * both['host_share']:.1f}% = {100 * both['adaptation_share']:.1f}%"
                        + extra})
  return g


def report(results, pol, van_s, a) -> tuple[dict, list]:
  from rich.console import Console
  from rich.table import Table
  con = Console(width=220)
  summary = summarize(results, van_s, a)
  gap, qual = gaps(results, a)
  arms = list(results)
  t = Table(title=f"tau per batch: policy b of a GRPO run (lr {a.grpo_lr}, {a.grpo_prompts}x"
                  f"{a.grpo_group}), {a.prompts}x{a.group} synthetic test prompts, T="
                  f"{a.temperature}, {a.max_new_tokens} tokens")
  for c in ("batch", "GRPO step", "KL to 0", "entropy", *arms, *(["gap"] if gap is not None
                                                                 else [])):
    t.add_column(c)
  for b, p in enumerate(pol):
    cells = [f"{results[x][b]['tau']:.3f}" for x in arms]
    if gap is not None:
      cells.append(f"{gap[b]:+.3f}" + ("*" if qual[b] else ""))
    t.add_row(str(b), str(p["step"]), f"{p['kl_to_step0']:.4f}", f"{p['entropy']:.3f}", *cells)
  con.print(t)
  s = Table(title="per arm (seconds exclude compile; in-loop cost: ms per target forward vs "
                  "static; shares of the arm's rollout time)")
  for c in ("arm", "mean tau", "tau first 5", "tau last 10", "acc. depth 1/2/3", "same",
            "ms/fwd", "in-loop vs static", "in-loop share", "host share",
            f"recovery (batches gap > {a.min_gap})", "refreshes kept/back", "vs vanilla"):
    s.add_column(c)
  for arm, x in summary.items():
    rec = "-" if x["recovery_per_batch"] is None else (
        "n/a (0 batches)" if x["recovery"] is None
        else f"{100 * x['recovery']:.1f}% ({x['recovery_batches']})")
    s.add_row(arm, f"{x['mean_tau']:.3f}", f"{x['tau_first5']:.3f}", f"{x['tau_last10']:.3f}",
              " ".join("-" if v is None else f"{v:.3f}" for v in x["acceptance"][:3]),
              str(x["all_same"]), f"{x['ms_per_forward']:.2f}",
              "-" if x["in_loop_cost"] is None else f"{100 * x['in_loop_cost']:+.1f}%",
              f"{100 * x['in_loop_share']:.1f}%", f"{100 * x['host_share']:.1f}%", rec,
              f"{x['kept']}/{x['rolled_back']}", f"{x['speedup_vs_vanilla']:.2f}x")
  con.print(s)
  print(f"policies: KL to step 0 (nats/token) {pol[0]['kl_to_step0']:.4f} -> "
        f"{pol[-1]['kl_to_step0']:.4f}, entropy {pol[0]['entropy']:.3f} -> "
        f"{pol[-1]['entropy']:.3f}, parameter change {pol[-1]['param_change']:.2e}")
  if gap is not None:
    why = ("the same heads" if a.start_heads == "ceiling"
           else "the ceiling's recipe vs the shipped heads")
    print(f"gap tau_ceiling - tau_static: batch 0 {gap[0]:+.3f} (before any drift: {why}), "
          f"mean {gap.mean():+.3f}, {int(qual.sum())}/{len(gap)} batches above {a.min_gap}")
  goals = goals_of(summary, results, pol, a)
  for x in goals:
    print(f"{x['status']}  {x['goal']}: {x['detail']}")
  if not all(v["all_same"] for v in summary.values()):
    print("MISS  tokens: an arm committed tokens other than vanilla's: "
          + ", ".join(k for k, v in summary.items() if not v["all_same"]))
  return summary, goals


def plot(results, pol, summary, path, a) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 3, figsize=(19, 4.6))
  steps = [p["step"] for p in pol]
  for arm, rec in results.items():
    ax[0].plot(steps, [r["tau"] for r in rec], "o-", ms=3, label=arm)
  ax[0].set_xlabel("GRPO step of the policy (batch b replays policy b)")
  ax[0].set_ylabel("tau (tokens / target forward)")
  ax[0].set_title(f"tau per batch, T = {a.temperature}")
  ax[0].legend(fontsize=8)
  ax[1].plot(steps, [p["kl_to_step0"] for p in pol], "k.-", label="KL to step 0")
  ax[1].set_xlabel("GRPO step")
  ax[1].set_ylabel("mean KL(policy || step 0) (nats / token)")
  tw = ax[1].twinx()
  tw.plot(steps, [p["entropy"] for p in pol], "r.--", label="entropy")
  tw.set_ylabel("mean next-token entropy (nats)", color="r")
  ax[1].set_title("drift of the policies (on the vanilla rollouts)")
  for arm, s in summary.items():
    if s["recovery_per_batch"] is not None:
      ys = [np.nan if y is None else y for y in s["recovery_per_batch"]]
      ax[2].plot(steps, ys, "o-", ms=3, label=arm)
  ax[2].axhline(0.5, color="grey", ls=":", lw=1)
  ax[2].axhline(0.0, color="grey", lw=0.5)
  ax[2].set_xlabel("GRPO step")
  ax[2].set_ylabel("(tau - tau_static) / (tau_ceiling - tau_static)")
  ax[2].set_title(f"recovered share of the gap (batches with gap > {a.min_gap})")
  ax[2].set_xlim(min(steps) - 0.5, max(steps) + 0.5)
  gap, qual = gaps(results, a)
  if gap is None or not qual.any():
    ax[2].text(0.5, 0.5, "no batch where tau_ceiling - tau_static exceeds "
               f"{a.min_gap}" if gap is not None else "needs arms static and ceiling",
               transform=ax[2].transAxes, ha="center", va="center")
  elif ax[2].lines[2:]:
    ax[2].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  main()
