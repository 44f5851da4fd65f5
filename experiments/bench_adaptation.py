"""SpecRoll's adaptation on real GRPO drift: one GRPO policy sequence replayed by ``SpecRoll``
arms (static heads, Reflex, the slow path, both, per-batch refits) and a refit ceiling, side by
side (docs/benchmarks.md, "SpecRoll on real GRPO drift").

  .venv/bin/python experiments/bench_adaptation.py                      # GRPO policies, then replay
  .venv/bin/python experiments/bench_adaptation.py --temperature 0.7 --out runs/bench_adapt_t07.json
  .venv/bin/python experiments/bench_adaptation.py --quick              # smoke run

Phase 1 (--policies DIR): a GRPO run (``app.loop.Run``, vanilla rollouts at T = 1, synthetic task)
saves its policy with orbax at step 0, every --save-every steps and the last, each meta naming the
model, the GRPO settings and the step's metrics. DIR is reused when complete for the same model and
settings, resumed when interrupted, refused otherwise (one line naming --policies, exit 2).

Phase 2: batch b (--prompts fresh synthetic test prompts x --group, ``SpecRoll.batch``) is rolled
out by policy b in every arm, the arms taking turns within each batch (the order rotating per
batch); every arm must commit the vanilla tokens ("same"). An arm is a ``SpecRoll`` configuration
(``Arm``, ``arm_specroll``) carrying its own ``SpecRollState`` from batch to batch
(``SpecRoll.generate``). Every arm runs the same tree: the root-conditioned heads and the
group-aware lookup (the row's own text and its G - 1 siblings; no store of earlier responses)
ranked by calibrated acceptance, under one fixed ``SpecConfig`` (``budget="fixed"``;
--node-budget, or --nodes per row), because SpecRoll runs Reflex on that tree (``MergedReflex``);
--no-lookup: the heads alone (``RankedHeads``), with the arms that run Reflex refused. Reflex is
SpecRoll's (``DEFAULT_REFLEX``: asleep --reflex-sleep .. --reflex-sleep-max batches after a batch
whose corrections did not pay; --reflex-stride-rows); the slow path runs
``SlowPathConfig.for_small_models`` with the --slow-* flags on --records-per-batch records drawn
each batch from the rollout's own anchor hidden states. Every arm starts from root-conditioned
heads fitted on step 0 (--start-heads ceiling: the ceiling's own fit, so the (a)-(f) gap is drift
alone). --no-drift replays policy 0 throughout.

  (a) static       the heads unchanged (Reflex off, slow path "off")
  (b) reflex       Reflex corrections             (c) slow    slow path on degradation
  (d) both         (b) + (c): what ``SpecRoll`` runs by default
  (e) every_batch  a slow-path refit every batch (FastGRPO-style)
  (e') scheduled   Reflex + the slow path's budgeted schedule (--slow-budget of rollout time)
  (f) ceiling      (a) with heads fitted from scratch on every --ceiling-every-th policy's own
                   rollouts (cached in DIR/ceiling; fitting time reported, not charged)

Reported: per batch and arm tau, acceptance, rollout and host seconds (``SpecRollReport``), Reflex's
mode and sleep, the slow path's decision; per policy KL to step 0, entropy, parameter change; per
arm recovery (tau - tau_static) / (tau_ceiling - tau_static) where the gap exceeds --min-gap,
in-loop cost (ms per forward vs (a) on the same batches, charged where the arm's program differs
from (a)'s: Reflex awake, or hidden states returned for the records), host share; goals for (d)
(recover >= 50%, >= max((b), (c)), adaptation <= 5% of rollout time). Compile is excluded. Writes
JSON and a PNG. --quick: 2 GRPO steps (3 policies), 3 batches of 2 x 2, 24 tokens, one row
bucket, arms static, both and ceiling.
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

from app import cli, pipeline
from app import synthetic as _synthetic
from app.tasks import Task
from specroll_jax import rollout
from specroll_jax.adaptation import slow_path as SP
from specroll_jax.data import gsm8k
from specroll_jax.engines import executables as _exe
from specroll_jax.heads import conditioned as CH
from specroll_jax.progress import progress_range
from specroll_jax.proposers import GroupLookup, RankedHeads
from specroll_jax.specroll import DEFAULT_REFLEX, ReflexMode, SpecRoll


class Arm(NamedTuple):
  """An arm: a ``SpecRoll`` configuration (``arm_specroll``). reflex: Reflex corrections
  (``SpecRoll.reflex``; False: None); slow: the slow path's mode ("off": none); ceiling: (a)
  with the heads refitted on the batch's policy."""

  reflex: bool = False
  slow: str = "off"
  ceiling: bool = False


ARMS = {"static": Arm(), "reflex": Arm(reflex=True), "slow": Arm(slow="degradation"),
        "both": Arm(reflex=True, slow="degradation"), "every_batch": Arm(slow="every_batch"),
        "scheduled": Arm(reflex=True, slow="scheduled"), "ceiling": Arm(ceiling=True)}
QUICK_ARMS = ("static", "both", "ceiling")
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
             "--grpo-group": 8, "--grpo-max-new-tokens": 48, "--level": 0,
             "--records-per-batch": 128, "--reflex-sleep": DEFAULT_REFLEX.sleep_batches,
             "--reflex-sleep-max": DEFAULT_REFLEX.sleep_max_batches, "--ceiling-prompts": 512,
             "--ceiling-steps": 1500, "--ceiling-every": 2}
_INF = float("inf")
_POS, _NONNEG = (lambda v: 0 < v < _INF, "a finite number > 0"), (lambda v: 0 <= v < _INF,
                                                                   "a finite number >= 0")
FLOAT_CHECKS = {"temperature": _NONNEG, "grpo_lr": _POS, "slow_lr": _POS, "slow_budget": _NONNEG,
                "slow_refresh_budget": _NONNEG, "reflex_stride_rows": _POS,
                "slow_z": (lambda v: -_INF < v < _INF, "a finite number"),
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
  add("--reflex-stride-rows", type=float, default=DEFAULT_REFLEX.stride_rows,
      help="ReflexConfig.stride_rows")
  add("--node-budget", type=int, default=None, help="default: max(32, --prompts x --group)")
  add("--nodes", type=int, default=None, help="nodes per row in every bucket")
  add("--buckets", type=float, nargs="+", default=None, help="row buckets (fractions, from 1.0)")
  add("--arms", nargs="+", default=None, choices=list(ARMS),
      help="default: every arm (without the Reflex arms under --no-lookup)")
  add("--no-lookup", action="store_true",
      help="the heads alone propose (SpecRoll(lookup=None)); Reflex needs the lookup")
  add("--start-heads", choices=("shipped", "ceiling"), default="ceiling")
  add("--no-drift", action="store_true", help="a null run: every batch replays policy 0")
  add("--min-gap", type=float, default=0.05, help="recovery counts batches with a larger gap")
  add("--quick", action="store_true", help="smoke run: 2 GRPO steps, 3 batches of 2 x 2, 3 arms")
  a = ap.parse_args(argv)
  _common.check_shared_flags(a, grpo_steps=1, save_every=1, grpo_warmup=0, grpo_prompts=1,
                             grpo_group=2, grpo_max_new_tokens=1, level=0, batches=2, calibration=1,
                             slow_reservoir=2, slow_steps=1, slow_check_every=1,
                             records_per_batch=1, reflex_sleep=0, reflex_sleep_max=0,
                             slow_step_chunks=0, slow_chunk_size=1, node_budget=0, nodes=0,
                             ceiling_prompts=1, ceiling_steps=1, ceiling_every=1, min_gap=0.0)
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
  reflex_arms = [x for x in (a.arms or []) if ARMS[x].reflex]
  if a.no_lookup and reflex_arms:
    cli.fail("--arms", " ".join(a.arms), f"{', '.join(reflex_arms)} run Reflex, which SpecRoll "
             "runs on the heads + lookup tree (MergedReflex): drop them or --no-lookup")
  if a.arms is None:
    a.arms = [x for x in ARMS if not (a.no_lookup and ARMS[x].reflex)]
  if a.quick:
    a.grpo_steps, a.save_every, a.grpo_prompts, a.grpo_group, a.grpo_max_new_tokens = 2, 1, 2, 4, 24
    a.batches, a.prompts, a.group, a.max_new_tokens = 3, 2, 2, 24
    a.arms = [x for x in QUICK_ARMS if not (a.no_lookup and ARMS[x].reflex)]
    a.ceiling_prompts, a.ceiling_steps, a.calibration = 16, 20, 1
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


def replay_prompts(a, tok, task):
  """([(prompts: P token-id lists, prompt ids [P])] per batch, the longest prompt): fresh test
  prompts each batch, global prompt ids b * P + i (sample id = prompt id * G + member)."""
  exs = task.examples("test")
  ids = tok.encode_batch([gsm8k.format_prompt(exs[i % len(exs)].question)
                          for i in range(a.batches * a.prompts)])
  out = [(ids[b * a.prompts:(b + 1) * a.prompts], np.arange(b * a.prompts, (b + 1) * a.prompts))
         for b in range(a.batches)]
  return out, max(len(x) for x in ids)


def arm_specroll(arm: Arm, a, config, *, sampling, spec, num_heads: int, prompt_width: int,
                 eos_ids) -> SpecRoll:
  """The arm's ``SpecRoll``: one tree (heads + lookup, or the heads alone with --no-lookup), the
  fixed budget of ``spec``, no store; Reflex (``DEFAULT_REFLEX`` with the --reflex-* flags) on
  or off; the slow path (``SlowPathConfig.for_small_models`` with the --slow-* flags) in the
  arm's mode, on --records-per-batch records per batch."""
  reflex = dataclasses.replace(DEFAULT_REFLEX, stride_rows=a.reflex_stride_rows,
                               sleep_batches=a.reflex_sleep, sleep_max_batches=a.reflex_sleep_max)
  slow = SP.SlowPathConfig.for_small_models(mode=arm.slow, scheduled_steps=a.slow_steps, **{
      field: getattr(a, flag[2:].replace("-", "_")) for flag, field, _ in SLOW_FLAGS})
  return SpecRoll(config, sampling=sampling, group_size=a.group, max_new_tokens=a.max_new_tokens,
                  eos_ids=eos_ids, heads_tree=RankedHeads(num_heads=num_heads),
                  lookup=None if a.no_lookup else GroupLookup(),
                  reflex=reflex if arm.reflex else None, slow=slow,
                  records_per_batch=a.records_per_batch, spec=spec, budget="fixed",
                  store_prompts=0, prompt_width=prompt_width)


def _release():
  """Drop compiled programs nothing later reuses (XLA:CPU maps every kernel: ~3k memory mappings
  per speculative program, 65530 per process at most)."""
  import gc
  _exe.clear()
  jax.clear_caches()
  gc.collect()


def batch_record(rep, out, state) -> dict:
  """One batch of an arm from its ``SpecRollReport``, rollout and the state after it: host
  seconds without the slow path's refresh compile, Reflex's mode and the sleep left, the slow
  path's decision."""
  slow = rep.slow
  refresh_compile = 0.0 if slow is None else slow.compile_seconds
  st = out.stats
  acc = np.where(np.asarray(st.head_proposed) > 0, np.asarray(st.head_acceptance), np.nan)
  info = {"tau": rep.tau, "depth1": nan_to_none(acc[:1])[0], "acceptance": nan_to_none(acc),
          "mode": str(rep.mode), "forwards": st.forwards, "seconds": rep.rollout_seconds,
          "ms_per_forward": 1e3 * rep.rollout_seconds / st.forwards,
          "host_seconds": rep.host_seconds - refresh_compile,
          "compile_seconds": rep.compile_seconds + refresh_compile, "events": list(rep.events),
          "reflex": None, "slow": None}
  if rep.reflex != ReflexMode.OFF:
    info["reflex"] = {"mode": str(rep.reflex), "asleep": rep.reflex == ReflexMode.ASLEEP,
                      "sleep_left": int(np.asarray(state.reflex.sleep)),
                      "safety": list(rep.safety)}
  if slow is not None:
    info["slow"] = {k: getattr(slow, k) for k in ("decision", "heads", "kept", "rolled_back",
                                                  "refresh_seconds", "z", "tv", "records",
                                                  "learning")}
  return info


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
  prompts, width = replay_prompts(a, tok, task)
  objs = {x: arm_specroll(ARMS[x], a, config, sampling=sampling, spec=spec,
                          num_heads=heads0.num_heads, prompt_width=width,
                          eos_ids=tuple(tok.eos_ids)) for x in a.arms}
  # one SpecRoll.batch per batch for every arm: the rows depend on settings the arms share
  batches = [objs[a.arms[0]].batch(p, ids) for p, ids in prompts]

  def vanilla(b, params):
    """Batch b under ``params`` through the vanilla engine (the tokens every arm must commit)."""
    bt = batches[b]
    out = rollout.generate(config, params, bt.tokens, sampling=sampling, seed=a.seed,
                           max_new_tokens=a.max_new_tokens, sample_ids=bt.sample_ids,
                           eos_ids=objs[a.arms[0]].eos_ids, prompt_lengths=bt.lengths,
                           options=rollout.DecodeOptions(cache_length=bt.cache_length,
                                                         bucket_fractions=a.buckets and fractions))
    jax.block_until_ready(out.tokens)
    return out

  # vanilla: the reference tokens, the policies' entropy and KL to step 0 along them
  ref, van_s, pol = [], [], []
  for b in progress_range(a.batches, "vanilla rollouts + KL / entropy per policy"):
    pb, p0 = policies.get(b), policies.get(0)
    if b == 0:  # compile
      vanilla(b, pb)
    t = time.perf_counter()
    out = vanilla(b, pb)
    van_s.append(time.perf_counter() - t)
    ref.append((np.asarray(out.tokens), np.asarray(out.lengths)))
    ent, kl = policy_scores(pb, p0, jnp.asarray(batches[b].tokens),
                            jnp.asarray(batches[b].lengths), out.tokens, out.lengths,
                            config=config, sampling=sampling)
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
  order = sorted(a.arms, key=lambda x: (x not in ("static", "ceiling"), list(ARMS).index(x)))
  states = {x: objs[x].init(commit(heads0)) for x in order}

  def run(x, b, state):
    """(rollout, report, state after it) of arm x on batch b (the ceiling: its heads for b)."""
    if ARMS[x].ceiling:
      state = state.replace(heads=c_heads[b])
    return objs[x].generate(policies.get(b), batches[b], state, seed=a.seed)

  warmup_s = {}
  for x in order:  # warm-up: a state's first batch compiles every program it can run (Reflex
    t = time.perf_counter()  # awake and asleep, the records), then its host work; state dropped
    run(x, 0, states[x])
    warmup_s[x] = time.perf_counter() - t
  # an untimed pass of batch 0 per arm once every program is compiled (the first timed call after
  # the other arms' compiles ran 1.7x its later ms per forward)
  for x in order:
    run(x, 0, states[x])
  # the arms take turns within each batch, the order rotating by one per batch: the machine's
  # drift over the run cancels from the per-batch comparisons against (a)
  results = {x: [] for x in order}
  for b in progress_range(a.batches, f"arms {', '.join(order)} (in turn per batch)"):
    for j in range(len(order)):
      x = order[(b + j) % len(order)]
      out, rep, states[x] = run(x, b, states[x])
      same = bool((np.asarray(out.tokens) == ref[b][0]).all()
                  and (np.asarray(out.lengths) == ref[b][1]).all())
      results[x].append({"batch": b, "policy_step": policies.steps[b], "same": same, "turn": j,
                         **batch_record(rep, out, states[x])})
      del out
  describe = {x: objs[x].describe(states[x]) for x in a.arms}
  del states
  _release()
  results = {x: results[x] for x in a.arms}
  summary, goals = report(results, pol, van_s, a)
  meta = {"command": "experiments/bench_adaptation.py " + " ".join(
      sys.argv[1:] if argv is None else argv), "cpu": _common.cpu_model(), "jax": jax.__version__,
      "device": jax.devices()[0].device_kind, "model": ident, "policies": str(a.policies),
      "grpo": grpo_settings(a), "args": vars(a), "spec": dataclasses.asdict(spec),
      "arms": {x: {**ARMS[x]._asdict(), "specroll": describe[x]} for x in a.arms},
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
