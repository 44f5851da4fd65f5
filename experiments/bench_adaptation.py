"""SpecRoll's adaptation on real GRPO drift: one GRPO policy sequence replayed by static heads,
Reflex, the slow path, both, per-batch refits and a refit ceiling, side by side (docs/benchmarks.md,
"SpecRoll on real GRPO drift").

  .venv/bin/python experiments/bench_adaptation.py                      # GRPO policies, then replay
  .venv/bin/python experiments/bench_adaptation.py --temperature 0.7 --out runs/bench_adapt_t07.json
  .venv/bin/python experiments/bench_adaptation.py --quick              # smoke run

Phase 1 (--policies DIR): a GRPO run (``grpo.loop.Run``, vanilla rollouts at T = 1, synthetic task)
saves its policy with orbax at step 0, every --save-every steps and the last, each meta naming the
model, the GRPO settings and the step's metrics. DIR is reused when complete for the same model and
settings, resumed when interrupted, refused otherwise (one line naming --policies, exit 2).

Phase 2: batch b (--prompts fresh synthetic test prompts x --group) is rolled out by policy b in
every arm, the arms taking turns within each batch (the order rotating per batch); every arm must
commit the vanilla tokens ("same"). An arm is a configuration (``Arm``) of the library's
adaptation: Reflex corrections, the slow path's mode (``SlowPathConfig.for_small_models`` with the
--slow-* flags) and the records' source make its ``AdaptationConfig``, and ``adaptation.proposer``,
``after_rollout`` and ``after_trainer`` run it. Every arm starts from root-conditioned heads fitted
on step 0 (--start-heads ceiling: the ceiling's own fit, so the (a)-(f) gap is drift alone) and
runs one ``SpecConfig`` (--node-budget, or --nodes per row). --no-drift replays policy 0 throughout.

  (a) static       the heads unchanged (corrections and slow path off)
  (b) reflex       Reflex corrections             (c) slow    slow path on degradation
  (d) both         (b) + (c), the slow path's records from the decode loop
  (d') trainer     (d) with records="trainer": --trainer-anchors records per batch from the
                   trainer's forward (run here: reported, not charged); Reflex asleep
                   --trainer-sleep .. --trainer-sleep-max batches after an unpaid awake batch
  (e) every_batch  a slow-path refit every batch (FastGRPO-style)
  (e') scheduled   Reflex + the slow path's budgeted schedule (--slow-budget of rollout time)
  (f) ceiling      (a) with heads fitted from scratch on every --ceiling-every-th policy's own
                   rollouts (cached in DIR/ceiling; fitting time reported, not charged)

Reported: per batch and arm tau, acceptance, rollout and host seconds; per policy KL to step 0,
entropy, parameter change; per arm recovery (tau - tau_static) / (tau_ceiling - tau_static) where
the gap exceeds --min-gap, in-loop cost (ms per forward vs (a) on the same awake batches), host
share; goals for (d) and (d') (recover >= 50%, >= max((b), (c)), adaptation <= 5% of rollout
time). Compile is excluded. Writes JSON and a PNG. --quick: 2 GRPO steps (3 policies), 3 batches of
2 x 2, 24 tokens, one row bucket, arms static, trainer and ceiling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import _common
import jax
import jax.numpy as jnp
import numpy as np
from _drift import (
  commit,
  ensure_policies,
  fit_ceilings,
  grpo_settings,
  model_identity,
  one_line,
  param_change,
  policy_scores,
  policy_steps,
)
from _drift_report import nan_to_none, plot, report

from specroll_jax import adaptation as A
from specroll_jax import cli, pipeline, rollout
from specroll_jax import cond_heads as CH
from specroll_jax import slow_path as SP
from specroll_jax import trainer_records as TR
from specroll_jax.data import gsm8k
from specroll_jax.data import synthetic as _synthetic
from specroll_jax.data.tasks import Task
from specroll_jax.progress import progress_range
from specroll_jax.reflex import ReflexConfig


class Arm(NamedTuple):
  """An arm: Reflex corrections, the slow path's mode and the records' source (its
  ``AdaptationConfig``); ceiling: the heads refitted on the batch's policy."""

  corrections: bool = False
  slow: str = "off"
  records: str = "rollout"
  ceiling: bool = False


ARMS = {"static": Arm(), "reflex": Arm(corrections=True), "slow": Arm(slow="degradation"),
        "both": Arm(corrections=True, slow="degradation"),
        "trainer": Arm(corrections=True, slow="degradation", records="trainer"),
        "every_batch": Arm(slow="every_batch"),
        "scheduled": Arm(corrections=True, slow="scheduled"), "ceiling": Arm(ceiling=True)}
QUICK_ARMS = ("static", "trainer", "ceiling")
DEFAULT_POLICIES = "runs/bench_adaptation/policies"
_SMALL = SP.SlowPathConfig.for_small_models()  # the slow-path flags' defaults
SLOW_FLAGS = (  # flag, SlowPathConfig field, type or choices
    ("--slow-lr", "learning_rate", float), ("--slow-reservoir", "reservoir_size", int),
    ("--slow-steps", "refresh_steps", int), ("--slow-chunk-size", "chunk_size", int),
    ("--slow-step-chunks", "step_chunks", int), ("--slow-check-every", "check_every", int),
    ("--slow-refresh-budget", "degradation_budget", float), ("--slow-z", "z_threshold", float),
    ("--slow-refresh-vocab", "refresh_vocab", SP.VOCABS), ("--slow-signal", "signal", SP.SIGNALS),
    ("--slow-selection", "refresh_selection", SP.SELECTIONS),
    ("--slow-budget", "time_budget", float), ("--slow-acc-drop", "acceptance_drop", float),
    ("--calibration", "calibration_batches", int))
INT_FLAGS = {"--grpo-steps": 80, "--save-every": 8, "--grpo-warmup": 10, "--grpo-prompts": 16,
             "--grpo-group": 8, "--grpo-max-new-tokens": 48, "--level": 0, "--trainer-anchors": 128,
             "--trainer-sleep": 3, "--trainer-sleep-max": 24, "--ceiling-prompts": 512,
             "--ceiling-steps": 1500, "--ceiling-every": 2}
_INF = float("inf")
_POS, _NONNEG = (lambda v: 0 < v < _INF, "a finite number > 0"), (lambda v: 0 <= v < _INF,
                                                                   "a finite number >= 0")
FLOAT_CHECKS = {"temperature": _NONNEG, "grpo_lr": _POS, "slow_lr": _POS, "slow_budget": _NONNEG,
                "slow_refresh_budget": _NONNEG, "reflex_stride_rows": _POS,
                "trainer_stride_rows": _POS, "slow_z": (lambda v: -_INF < v < _INF,
                                                        "a finite number"),
                "slow_acc_drop": (lambda v: -1 <= v <= 1, "a number in [-1, 1]")}


def parse(argv):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  _common.add_shared_flags(ap, out=None, prompts=4, group=8, max_new_tokens=48,
                           prompts_help="benchmark prompts per batch")
  add = ap.add_argument
  add("--policies", default=None, help=f"policy folder (default {DEFAULT_POLICIES}[_quick])")
  for flag, default in INT_FLAGS.items():
    add(flag, type=int, default=default)
  for flag, field, kind in SLOW_FLAGS:
    add(flag, type=kind if isinstance(kind, type) else str, default=getattr(_SMALL, field),
        choices=None if isinstance(kind, type) else kind, help=f"SlowPathConfig.{field}")
  add("--grpo-lr", type=float, default=3e-4)
  add("--temperature", type=float, default=1.0, help="replay sampling temperature")
  add("--batches", type=int, default=None, help="replayed batches (default: every policy)")
  add("--reflex-stride-rows", type=float, default=1.0, help="ReflexConfig.stride_rows")
  add("--trainer-stride-rows", type=float, default=4.0, help="arm trainer's stride_rows")
  add("--node-budget", type=int, default=None, help="default: max(32, --prompts x --group)")
  add("--nodes", type=int, default=None, help="nodes per row in every bucket")
  add("--buckets", type=float, nargs="+", default=None, help="row buckets (fractions, from 1.0)")
  add("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
  add("--start-heads", choices=("shipped", "ceiling"), default="ceiling")
  add("--no-drift", action="store_true", help="a null run: every batch replays policy 0")
  add("--min-gap", type=float, default=0.05, help="recovery counts batches with a larger gap")
  add("--quick", action="store_true", help="smoke run: 2 GRPO steps, 3 batches of 2 x 2, 3 arms")
  a = ap.parse_args(argv)
  _common.check_shared_flags(a, grpo_steps=1, save_every=1, grpo_warmup=0, grpo_prompts=1,
                             grpo_group=2, grpo_max_new_tokens=1, level=0, batches=2, calibration=1,
                             slow_reservoir=2, slow_steps=1, slow_check_every=1, trainer_anchors=1,
                             trainer_sleep=0, trainer_sleep_max=0, slow_step_chunks=0,
                             slow_chunk_size=1, node_budget=0, nodes=0, ceiling_prompts=1,
                             ceiling_steps=1, ceiling_every=1, min_gap=0.0)
  for name, (ok, what) in FLOAT_CHECKS.items():
    if not ok(getattr(a, name)):
      cli.fail("--" + name.replace("_", "-"), getattr(a, name), f"must be {what}")
  for name, check in (("level", lambda: _synthetic.Difficulty.from_level(a.level)), (
      "buckets", lambda: a.buckets and rollout.SpecConfig(bucket_fractions=tuple(a.buckets)))):
    try:
      check()
    except ValueError as e:
      cli.fail("--" + name, getattr(a, name), one_line(e))
  if a.model is not None and not Path(a.model).is_dir():
    cli.fail("--model", a.model, "is not a folder (a Hugging Face model folder is expected)")
  if a.quick:
    a.grpo_steps, a.save_every, a.grpo_prompts, a.grpo_group, a.grpo_max_new_tokens = 2, 1, 2, 4, 24
    a.batches, a.prompts, a.group, a.max_new_tokens = 3, 2, 2, 24
    a.arms, a.ceiling_prompts, a.ceiling_steps, a.calibration = list(QUICK_ARMS), 16, 20, 1
    a.buckets = [1.0]  # one decode loop per program: a third of the compile at 4 rows
  a.policies = a.policies or DEFAULT_POLICIES + "_quick" * a.quick
  a.out = a.out or f"runs/bench_adaptation{'_quick' * a.quick}.json"
  if Path(a.policies).exists() and not Path(a.policies).is_dir():
    cli.fail("--policies", a.policies, "exists and is not a folder")
  if Path(a.out).is_dir():
    cli.fail("--out", a.out, "is a folder (a .json file path is expected)")
  n = len(policy_steps(a))
  a.batches = n if a.batches is None else a.batches
  if a.batches > n:
    cli.fail("--batches", a.batches, f"the GRPO run saves {n} policies (--grpo-steps "
             f"{a.grpo_steps}, --save-every {a.save_every}); replay at most {n}")
  a.arms = [x for x in ARMS if x in a.arms]
  return a


# -- Phase 2: replay


def replay_batches(a, tok, task):
  """([(prompts [B, W], sample ids [B], prompt lengths [B])] per batch, W): fresh test prompts
  each batch, one width W for all."""
  exs = task.examples("test")
  ids = tok.encode_batch([gsm8k.format_prompt(exs[i % len(exs)].question)
                          for i in range(a.batches * a.prompts)])
  width, out = rollout.pad_prompts(ids)[0].shape[1], []
  for b in range(a.batches):
    rows, sids = pipeline.grpo_batch(ids[b * a.prompts:(b + 1) * a.prompts], a.group,
                                     first_prompt_index=b * a.prompts)
    arr, lens = rollout.pad_prompts(rows, width)
    out.append((arr, sids, lens))
  return out, width


def adaptation_config(arm: Arm, a, rcfg: ReflexConfig, sampling) -> A.AdaptationConfig:
  """The arm's ``AdaptationConfig``; records "trainer": arm trainer's Reflex (no decode-loop
  records, its own stride, asleep after unpaid batches)."""
  reflex = dataclasses.replace(rcfg, apply_corrections=arm.corrections)
  if arm.records == "trainer":
    reflex = dataclasses.replace(reflex, stride_rows=a.trainer_stride_rows, record_capacity=0,
                                 sleep_batches=a.trainer_sleep,
                                 sleep_max_batches=a.trainer_sleep_max)
  slow = SP.SlowPathConfig.for_small_models(mode=arm.slow, scheduled_steps=a.slow_steps, **{
      field: getattr(a, flag[2:].replace("-", "_")) for flag, field, _ in SLOW_FLAGS})
  return A.AdaptationConfig(reflex=reflex, slow=slow, records=arm.records,
                            trainer_anchors=a.trainer_anchors).for_sampling(sampling)


def _release():
  """Drop compiled programs nothing later reuses (XLA:CPU maps every kernel: ~3k memory mappings
  per speculative program, 65530 per process at most)."""
  import gc
  jax.clear_caches()
  gc.collect()


def after_batch(arm: Arm, state, env, b: int, out, seconds: float):
  """(state for batch b + 1, host seconds, slow-path compile seconds, report) after batch b:
  ``adaptation.after_rollout``; with records "trainer" also the trainer's forward (timed apart,
  not charged), its records (``trainer_records``) and ``adaptation.after_trainer``."""
  pb = env.policies.get(b)
  state, rep = A.after_rollout(state, env.config, pb, out, seconds)
  host, slow = rep.adaptation_seconds, rep.slow
  info = {"reflex": None if rep.reflex is None else rep.reflex.to_dict(), "safety": rep.safety}
  if arm.records == "trainer":
    arr, _, lens = env.batches[b]
    t0 = time.perf_counter()
    hid = jax.block_until_ready(TR.anchor_hidden(env.config, pb, arr, lens, out.tokens,
                                                 out.lengths))
    t1 = time.perf_counter()
    recs = jax.block_until_ready(TR.from_hidden(
        state.config.reflex, env.config, pb, state.heads, hid, out.tokens, out.lengths,
        jnp.asarray(lens), sampling=env.sampling, key=jax.random.key(env.a.seed * 7919 + b),
        num_anchors=state.config.trainer_anchors))
    info.update(trainer_forward_seconds=t1 - t0, records_seconds=time.perf_counter() - t1)
    state, trep = A.after_trainer(state, env.config, pb, recs, rep)
    host += info["records_seconds"] + trep.adaptation_seconds
    slow = trep.slow
  comp = 0.0 if slow is None else slow.compile_seconds
  if slow is not None:
    info["slow"] = {k: getattr(slow, k) for k in ("decision", "heads", "kept", "rolled_back",
                                                  "refresh_seconds", "z", "tv", "records")}
  return state, host - comp, comp, info


def main(argv=None):
  a = parse(argv)
  try:
    config, params, tok, path = pipeline.load_model(a.model)
  except ValueError as e:
    cli.fail("--model", a.model, one_line(e))
  ident = model_identity(params, path)
  policies = ensure_policies(a, config, params, tok, ident)
  policies = policies.frozen() if a.no_drift else policies
  _release()
  task, sampling = Task(name="synthetic", level=a.level), rollout.SamplingConfig(a.temperature)
  heads0 = pipeline.default_heads(config, params, tok, path, conditioned=True)
  if not isinstance(heads0, CH.CondHeads):  # every arm proposes with root-conditioned heads
    print(f"note: {path} ships no root-conditioned heads: fitting them on step 0 (cached)")
    heads0 = pipeline.fitted_cond_heads(config, params, tok, path, num_prompts=a.ceiling_prompts,
                                        max_new_tokens=a.max_new_tokens, sampling=sampling,
                                        steps=a.ceiling_steps, task=task)
  fractions = tuple(a.buckets or rollout.SpecConfig().bucket_fractions)
  spec = rollout.SpecConfig(
      node_budget=max(32, a.prompts * a.group) if a.node_budget is None else a.node_budget,
      bucket_fractions=fractions, nodes=a.nodes and (a.nodes,) * len(fractions))
  rcfg = ReflexConfig(topk=spec.topk, conditioned=True, stride_rows=a.reflex_stride_rows)
  batches, width = replay_batches(a, tok, task)

  def generate(b, params, state=None, heads=None, **options):
    """Batch b under ``params``: vanilla, or proposed by ``adaptation.proposer(state)``."""
    prop = state and A.proposer(state if heads is None else state.replace(heads=heads))
    out = rollout.generate(config, params, batches[b][0], sampling=sampling, seed=a.seed,
                           max_new_tokens=a.max_new_tokens, sample_ids=batches[b][1],
                           eos_ids=tok.eos_ids, prompt_lengths=batches[b][2],
                           speculation=prop and rollout.Speculation(*prop, spec),
                           options=rollout.DecodeOptions(cache_length=width + a.max_new_tokens,
                                                         **options))
    jax.block_until_ready(out.tokens)
    return out

  # vanilla: the reference tokens, the policies' entropy and KL to step 0 along them
  ref, van_s, pol = [], [], []
  for b in progress_range(a.batches, "vanilla rollouts + KL / entropy per policy"):
    pb, p0 = policies.get(b), policies.get(0)
    if b == 0:  # compile
      generate(b, pb, bucket_fractions=a.buckets and fractions)
    t = time.perf_counter()
    out = generate(b, pb, bucket_fractions=a.buckets and fractions)
    van_s.append(time.perf_counter() - t)
    ref.append((np.asarray(out.tokens), np.asarray(out.lengths)))
    ent, kl = policy_scores(pb, p0, jnp.asarray(batches[b][0]), jnp.asarray(batches[b][2]),
                            out.tokens, out.lengths, config=config, sampling=sampling)
    pol.append({"index": b, "step": policies.steps[b], "kl_to_step0": float(kl),
                "entropy": float(ent), "param_change": param_change(pb, p0),
                "grpo": policies.metas[policies.steps[b]].get("metrics")})
  _release()
  ceiling, c_heads = None, [None] * a.batches
  if "ceiling" in a.arms or a.start_heads == "ceiling":  # without arm ceiling: step 0's fit only
    c_heads, c_secs, c_ce = fit_ceilings(a, config, policies, tok, task, sampling, heads0,
                                         a.batches if "ceiling" in a.arms else 1)
    if "ceiling" in a.arms:
      ceiling = {"fit_seconds": c_secs, "final_soft_ce": c_ce, "every": a.ceiling_every,
                 "prompts": a.ceiling_prompts, "steps": a.ceiling_steps}
    heads0 = c_heads[0] if a.start_heads == "ceiling" else heads0
    _release()
  env = argparse.Namespace(a=a, config=config, policies=policies, batches=batches,
                           sampling=sampling)
  # static and ceiling first: their program (the plain heads) is a sleeping Reflex's too
  order = sorted(a.arms, key=lambda x: (x not in ("static", "ceiling"), list(ARMS).index(x)))
  states = {x: commit(A.init(adaptation_config(ARMS[x], a, rcfg, sampling), commit(heads0)))
            for x in order}
  ceil = {x: c_heads if ARMS[x].ceiling else [None] * a.batches for x in order}
  warmup_s = {}
  for x in order:  # warm-up (compile): a batch and the host work after it, results dropped
    t, s = time.perf_counter(), states[x]
    after_batch(ARMS[x], s, env, 0, generate(0, policies.get(0), s, ceil[x][0]), 1.0)
    if s.config.reflex.sleep_batches and not s.config.static_heads:  # a sleeping Reflex's
      generate(0, policies.get(0), s.replace(reflex=s.reflex.replace(sleep=1)))
    warmup_s[x] = time.perf_counter() - t
  # an untimed pass of batch 0 per arm once every program is compiled (the first timed call after
  # the other arms' compiles ran 1.7x its later ms per forward)
  for x in order:
    generate(0, policies.get(0), states[x], ceil[x][0])
  # the arms take turns within each batch, the order rotating by one per batch: the machine's
  # drift over the run cancels from the per-batch comparisons against (a)
  results = {x: [] for x in order}
  for b in progress_range(a.batches, f"arms {', '.join(order)} (in turn per batch)"):
    for j in range(len(order)):
      x = order[(b + j) % len(order)]
      t = time.perf_counter()
      out = generate(b, policies.get(b), states[x], ceil[x][b])
      sec = time.perf_counter() - t
      states[x], host, comp, info = after_batch(ARMS[x], states[x], env, b, out, sec)
      st = out.stats
      acc = np.where(np.asarray(st.head_proposed) > 0, np.asarray(st.head_acceptance), np.nan)
      same = bool((np.asarray(out.tokens) == ref[b][0]).all()
                  and (np.asarray(out.lengths) == ref[b][1]).all())
      results[x].append({
          "batch": b, "policy_step": policies.steps[b], "tau": st.tokens_per_forward,
          "depth1": nan_to_none(acc[:1])[0], "acceptance": nan_to_none(acc), "same": same,
          "turn": j, "forwards": st.forwards, "seconds": sec,
          "ms_per_forward": 1e3 * sec / st.forwards, "adaptation_seconds": host,
          "compile_seconds": comp, **info})
      del out
  del states
  _release()
  results = {x: results[x] for x in a.arms}
  summary, goals = report(results, pol, van_s, a)
  meta = {"command": "experiments/bench_adaptation.py " + " ".join(
      sys.argv[1:] if argv is None else argv), "cpu": _common.cpu_model(), "jax": jax.__version__,
      "device": jax.devices()[0].device_kind, "model": ident, "policies": str(a.policies),
      "grpo": grpo_settings(a), "args": vars(a), "spec": dataclasses.asdict(spec),
      "arms": {x: ARMS[x]._asdict() for x in a.arms},
      "heads": type(heads0).__name__, "warmup_seconds": warmup_s}
  out_path = Path(a.out)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  out_path.write_text(json.dumps({"meta": meta, "summary": summary, "goals": goals,
                                  "policies": pol, "vanilla_seconds": van_s, "ceiling": ceiling,
                                  "arms": results}, indent=2))
  plot(results, pol, summary, out_path.with_suffix(".png"), a)
  print(f"wrote {out_path} and {out_path.with_suffix('.png')}")
  return {"summary": summary, "goals": goals, "policies": pol, "arms": results}


if __name__ == "__main__":
  main()
