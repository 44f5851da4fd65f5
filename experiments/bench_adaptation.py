"""Adaptation under a drifting target: static heads, Reflex, the slow path and both, side by side.

  .venv/bin/python experiments/bench_adaptation.py --temperature 1.0 --out runs/bench_adapt_t1.json
  .venv/bin/python experiments/bench_adaptation.py --temperature 0.7 --out runs/bench_adapt_t07.json

The target drifts between rollout batches the way a policy does in training: before batch b it
takes --drift-steps AdamW steps of SFT on a fresh slice of GSM8K train (--drift-lr), starting from
the embedded model. The drift is computed once; every arm sees the same target, the same GSM8K
*test* prompts (fresh ones each batch) and the same seeds, so every arm commits the same tokens
(checked) and only the speed differs. The heads of every arm start as the same heads, fitted once
on the initial model's own rollouts. Arms:

  (a) static      heads fitted once, never changed
  (b) reflex      Reflex fast path only
  (c) slow        slow path only ("degradation"; Reflex records but never corrects)
  (d) both        Reflex + slow path ("degradation")
  (e) scheduled   Reflex + slow path ("scheduled")
  (f) every_batch slow path retraining every batch (FastGRPO-style), no Reflex corrections
  (g) lookup      prompt lookup (n-gram copy), for reference

Per arm: tau per batch (PNG), mean tau, head acceptance per depth, the slow path's host time as a
share of rollout time, the in-loop cost of Reflex (ms per verify forward vs the static arm), and
the target's mean next-token entropy per batch. Compile is excluded (a warm-up call per arm).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _common
import jax
import jax.numpy as jnp
import numpy as np
import optax

from specroll_jax import adaptation as A
from specroll_jax import cli, pipeline, rollout, sft
from specroll_jax import slow_path as SP
from specroll_jax.data import gsm8k
from specroll_jax.grpo import trainer_logprobs
from specroll_jax.progress import progress_range
from specroll_jax.proposers import PromptLookup
from specroll_jax.reflex import ReflexConfig

ARMS = ("static", "reflex", "slow", "both", "scheduled", "every_batch", "lookup")


def slow_config(args, mode: str) -> SP.SlowPathConfig:
  """CPU-sized windows (tens of batches, not thousands) and a learning rate for a tiny model's
  heads (the DESIGN default 1e-5 is for 1.5B-parameter heads trained at ~1e-4)."""
  return SP.SlowPathConfig.for_tests(mode=mode, learning_rate=args.slow_lr,
                                     calibration_batches=args.calibration)


def arm_setup(args, arm: str, heads, sampling):
  """(kwargs for generate, adaptation state or None)."""
  spec = rollout.SpecConfig(node_budget=args.node_budget)
  reflex = ReflexConfig(topk=spec.topk)
  off = ReflexConfig(topk=spec.topk, apply_corrections=False)
  cfgs = {"reflex": (reflex, "off"), "slow": (off, "degradation"), "both": (reflex, "degradation"),
          "scheduled": (reflex, "scheduled"), "every_batch": (off, "every_batch")}
  if arm == "static":
    return dict(spec=spec, heads=heads), None
  if arm == "lookup":
    return dict(spec=spec, proposer=PromptLookup(), proposer_params=()), None
  rc, mode = cfgs[arm]
  ac = A.AdaptationConfig(reflex=rc, slow=slow_config(args, mode)).for_sampling(sampling)
  return dict(spec=spec), A.init(ac, heads)


def drift_targets(config, params, tok, args) -> list:
  """params of batch 0..B-1: batch b's target has taken b * drift_steps SFT steps."""
  exs = gsm8k.load("train")[2000:]  # fresh slices, away from the prompts the heads were fit on
  tokens, mask, _ = sft.encode_examples(tok, exs, 288)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.drift_lr, weight_decay=0.01))
  opt = tx.init(params)
  update = sft._update_fn(config, tx)
  out = [params]
  rng = np.random.default_rng(args.seed)
  for _ in progress_range(args.batches - 1, "drift the target"):
    for _ in range(args.drift_steps):
      idx = rng.integers(0, len(tokens), 16)
      params, opt, _ = update(params, opt, jnp.asarray(tokens[idx]), jnp.asarray(mask[idx]))
    out.append(params)
  return out


def main(argv=None):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default=None)
  ap.add_argument("--temperature", type=float, default=1.0)
  ap.add_argument("--batches", type=int, default=30)
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--group", type=int, default=4)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--drift-steps", type=int, default=3)
  ap.add_argument("--drift-lr", type=float, default=2e-3)
  ap.add_argument("--slow-lr", type=float, default=1e-3)
  ap.add_argument("--calibration", type=int, default=6, help="slow-path calibration batches")
  ap.add_argument("--node-budget", type=int, default=32)
  ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default="runs/bench_adaptation.json")
  ap.add_argument("--quick", action="store_true", help="3 batches, 2 arms, short rollouts")
  a = ap.parse_args(argv)
  cli.require(a, batches=2, prompts=1, group=1, max_new_tokens=1, drift_steps=0, node_budget=0,
              calibration=1)
  if not 0 <= a.temperature < float("inf"):
    cli.fail("--temperature", a.temperature, "must be a finite number >= 0")
  if not (a.drift_lr >= 0 and a.slow_lr > 0):
    cli.fail("--drift-lr/--slow-lr", (a.drift_lr, a.slow_lr), "must be >= 0 / > 0")
  if a.quick:
    a.batches, a.max_new_tokens, a.arms, a.calibration = 3, 32, ["static", "both"], 1
  try:
    config, params, tok, path = pipeline.load_model(a.model)
  except ValueError as e:
    cli.fail("--model", a.model, str(e))
  heads = pipeline.default_heads(config, params, tok, path)
  sampling = rollout.SamplingConfig(temperature=a.temperature)
  t0 = time.perf_counter()
  targets = drift_targets(config, params, tok, a)
  drift_s = time.perf_counter() - t0
  exs = gsm8k.load("test")
  ids = [[tok.encode(gsm8k.format_prompt(e.question))
          for e in exs[(b * a.prompts) % len(exs):][: a.prompts]] for b in range(a.batches)]
  # one fixed width for every batch (the same shapes: one compile per arm)
  width = rollout.pad_prompts([p for chunk in ids for p in chunk])[0].shape[1]
  batches = []
  for b in range(a.batches):
    rows, sids = pipeline.grpo_batch(ids[b], a.group, first_prompt_index=b * a.prompts)
    arr, lens = rollout.pad_prompts(rows, width)
    batches.append((arr, sids, lens))
  kw = lambda b: dict(sampling=sampling, max_new_tokens=a.max_new_tokens, seed=a.seed,
                      sample_ids=batches[b][1], eos_ids=tok.eos_ids,
                      prompt_lengths=batches[b][2], cache_length=width + a.max_new_tokens)
  # the vanilla rollouts: reference tokens and the target's entropy along them
  ref, entropy, van_s = [], [], []
  for b in progress_range(a.batches, "vanilla + entropy"):
    if b == 0:  # compile
      jax.block_until_ready(rollout.generate(config, targets[b], batches[b][0], **kw(b)).tokens)
    t = time.perf_counter()
    out = rollout.generate(config, targets[b], batches[b][0], **kw(b))
    jax.block_until_ready(out.tokens)
    van_s.append(time.perf_counter() - t)
    ref.append((np.asarray(out.tokens), np.asarray(out.lengths)))
    sc = trainer_logprobs(config, targets[b], jnp.asarray(batches[b][0]),
                          jnp.asarray(batches[b][2]), out.tokens, out.lengths, sampling)
    m = np.arange(out.tokens.shape[1])[None] < np.asarray(out.lengths)[:, None]
    entropy.append(float((np.asarray(sc.entropy) * m).sum() / m.sum()))
  results = {}
  for arm in a.arms:
    gen_kw, state = arm_setup(a, arm, heads, sampling)
    warm = rollout.generate(config, targets[0], batches[0][0], **gen_kw, **kw(0),
                            **({"adaptation": state} if state is not None else {}))
    jax.block_until_ready(warm.tokens)
    rec = []
    for b in progress_range(a.batches, f"arm {arm}"):
      extra = {"adaptation": state} if state is not None else {}
      t = time.perf_counter()
      out = rollout.generate(config, targets[b], batches[b][0], **gen_kw, **kw(b), **extra)
      jax.block_until_ready(out.tokens)
      sec = time.perf_counter() - t
      same = bool((np.asarray(out.tokens) == ref[b][0]).all()
                  and (np.asarray(out.lengths) == ref[b][1]).all())
      rep = out.adaptation_report or {}
      ad = float(rep.get("adaptation_seconds", 0.0))
      r = {"batch": b, "tau": out.stats.tokens_per_forward, "same": same,
           "acceptance": np.asarray(out.stats.head_acceptance).tolist(),
           "forwards": int(out.stats.target_forwards) + 1, "seconds": sec - ad,
           "adaptation_seconds": ad}
      if rep:
        r["reflex"] = rep.get("reflex")
        r["safety"] = rep.get("safety")
        slow = rep.get("slow") or {}
        r["slow"] = {k: slow.get(k) for k in ("decision", "heads", "kept", "rolled_back",
                                              "refresh_seconds")}
        state = out.adaptation
      rec.append(r)
    results[arm] = rec
  meta = {"command": "experiments/bench_adaptation.py " + " ".join(
      sys.argv[1:] if argv is None else argv), "cpu": _common.cpu_model(),
      "jax": jax.__version__,
      "model": str(path), "args": vars(a), "drift_seconds": drift_s,
      "drift": f"{a.drift_steps} AdamW SFT steps (lr {a.drift_lr}, batch 16) on GSM8K train "
               "before every batch"}
  summary = report(results, entropy, van_s, a)
  out_path = Path(a.out)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  out_path.write_text(json.dumps({"meta": meta, "summary": summary, "entropy": entropy,
                                  "vanilla_seconds": van_s, "arms": results}, indent=2))
  plot(results, entropy, out_path.with_suffix(".png"), a)
  print(f"wrote {out_path} and {out_path.with_suffix('.png')}")
  return summary


def report(results, entropy, van_s, a) -> dict:
  from rich.console import Console
  from rich.table import Table
  t = Table(title=f"adaptation under a drifting target: T={a.temperature}, {a.batches} batches of "
                  f"{a.prompts}x{a.group} GSM8K test prompts, {a.max_new_tokens} tokens")
  for c in ("arm", "mean tau", "tau first 5", "tau last 10", "acc. depth 1/2/3", "same tokens",
            "ms/fwd", "in-loop cost vs static", "slow-path share", "refreshes kept/rolled back",
            "speedup vs vanilla"):
    t.add_column(c)
  ms = lambda rec: 1e3 * sum(r["seconds"] for r in rec) / sum(r["forwards"] for r in rec)
  base_ms = ms(results["static"]) if "static" in results else None
  out = {}
  for arm, rec in results.items():
    tau = np.array([r["tau"] for r in rec])
    acc = np.nanmean(np.array([r["acceptance"] for r in rec], np.float64), axis=0)
    roll = sum(r["seconds"] for r in rec)
    ad = sum(r["adaptation_seconds"] for r in rec)
    kept = sum(len((r.get("slow") or {}).get("kept") or []) for r in rec)
    back = sum(len((r.get("slow") or {}).get("rolled_back") or []) for r in rec)
    s = {"mean_tau": float(tau.mean()), "tau_first5": float(tau[:5].mean()),
         "tau_last10": float(tau[-10:].mean()), "acceptance": acc.tolist(),
         "all_same": all(r["same"] for r in rec), "ms_per_forward": ms(rec),
         "in_loop_cost": (ms(rec) / base_ms - 1) if base_ms else None,
         "slow_share": ad / max(roll, 1e-9), "kept": kept, "rolled_back": back,
         "speedup_vs_vanilla": sum(van_s) / max(roll + ad, 1e-9)}
    out[arm] = s
    t.add_row(arm, f"{s['mean_tau']:.3f}", f"{s['tau_first5']:.3f}", f"{s['tau_last10']:.3f}",
              " ".join(f"{x:.3f}" for x in acc), str(s["all_same"]), f"{s['ms_per_forward']:.2f}",
              "-" if s["in_loop_cost"] is None else f"{100 * s['in_loop_cost']:+.1f}%",
              f"{100 * s['slow_share']:.1f}%", f"{kept}/{back}",
              f"{s['speedup_vs_vanilla']:.2f}x")
  Console(width=200).print(t)
  print(f"target entropy (nats/token), first / last batch: {entropy[0]:.3f} / {entropy[-1]:.3f}")
  return out


def plot(results, entropy, path, a) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 2, figsize=(13, 4.2))
  for arm, rec in results.items():
    ax[0].plot([r["batch"] for r in rec], [r["tau"] for r in rec], "o-", ms=3, label=arm)
  ax[0].set_xlabel("rollout batch (the target drifts between batches)")
  ax[0].set_ylabel("tau (tokens / target forward)")
  ax[0].set_title(f"T = {a.temperature}")
  ax[0].legend(fontsize=8)
  ax[1].plot(range(len(entropy)), entropy, "k.-")
  ax[1].set_xlabel("rollout batch")
  ax[1].set_ylabel("target mean next-token entropy (nats)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)


if __name__ == "__main__":
  main()
