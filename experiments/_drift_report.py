"""The report of experiments/bench_adaptation.py: the per-arm summary (recovery of the gap
tau_ceiling - tau_static, in-loop and host cost), the goals for (d), the tables and the PNG."""

from __future__ import annotations

import warnings

import numpy as np

# the arms' letters in docs/benchmarks.md, "SpecRoll on real GRPO drift"
LABELS = {"static": "(a)", "reflex": "(b)", "slow": "(c)", "both": "(d)", "every_batch": "(e)",
          "scheduled": "(e')", "ceiling": "(f)"}


def nan_to_none(xs):
  """Floats, None where not finite (JSON)."""
  return [None if not np.isfinite(x) else float(x) for x in xs]


def gaps(results, a):
  """tau_ceiling - tau_static per batch and where it exceeds --min-gap (None, None without both)."""
  if "static" not in results or "ceiling" not in results:
    return None, None
  gap = _taus(results["ceiling"]) - _taus(results["static"])
  return gap, gap > a.min_gap


def _taus(rec):
  return np.array([r["tau"] for r in rec])


def _on(static, rs, ms) -> float:
  """Static's ms per forward on the batches of ``rs``."""
  return ms([static[r["batch"]] for r in rs])


def summarize(results, van_s, a) -> dict:
  ms = lambda rec: 1e3 * sum(r["seconds"] for r in rec) / sum(r["forwards"] for r in rec)
  static, (gap, qual), out = results.get("static"), gaps(results, a), {}
  for arm, rec in results.items():
    tau, roll = _taus(rec), sum(r["seconds"] for r in rec)
    host = sum(r["host_seconds"] for r in rec)
    acc = np.array([[np.nan if x is None else x for x in r["acceptance"]] for r in rec], float)
    # in-loop cost: ms per forward over static's on the same batches, charged where the arm's
    # program differs from static's (Reflex awake, or the anchor hidden states the slow path
    # draws its records from); a batch where Reflex slept and drew no records ran static's own
    # program: its difference is the noise, reported apart
    asleep = lambda r: bool((r.get("reflex") or {}).get("asleep"))
    slept = [r for r in rec if asleep(r) and not r.get("slow")]
    awake = [r for r in rec if not (asleep(r) and not r.get("slow"))]
    vs = lambda rs: ms(rs) / _on(static, rs, ms) - 1 if rs and static else None
    in_loop = max(ms(awake) - _on(static, awake, ms), 0.0) * sum(
        r["forwards"] for r in awake) / 1e3 if awake and static else 0.0
    with warnings.catch_warnings():  # depths no tree reached: NaN, not a warning
      warnings.simplefilter("ignore", RuntimeWarning)
      mean_acc = nan_to_none(np.nanmean(acc, axis=0)) if acc.size else []
    slow = [r.get("slow") or {} for r in rec]
    s = out[arm] = {
        "mean_tau": float(tau.mean()), "tau_first5": float(tau[:5].mean()),
        "tau_last10": float(tau[-10:].mean()), "acceptance": mean_acc,
        "all_same": all(r["same"] for r in rec), "ms_per_forward": ms(rec),
        "rollout_seconds": roll, "host_seconds": host,
        "compile_seconds": sum(r["compile_seconds"] for r in rec),
        "in_loop_cost": (vs(awake) or 0.0) if static else None,
        "in_loop_share": in_loop / max(roll, 1e-9), "in_loop_asleep_cost": vs(slept),
        "host_share": host / max(roll, 1e-9), "kept": sum(len(x.get("kept") or []) for x in slow),
        "rolled_back": sum(len(x.get("rolled_back") or []) for x in slow),
        "records": sum(sum(x.get("records") or []) for x in slow),
        "speedup_vs_vanilla": sum(van_s) / max(roll + host, 1e-9),
        "asleep_batches": sum(map(asleep, rec)), "recovery_batches": 0, "recovery": None,
        "recovery_per_batch": None}
    s["adaptation_share"] = s["in_loop_share"] + s["host_share"]
    if gap is not None and arm not in ("static", "ceiling"):
      share = (tau - _taus(static)) / np.where(qual, gap, 1.0)
      s["recovery_per_batch"] = [float(x) if q else None for x, q in zip(share, qual, strict=True)]
      s["recovery_batches"] = int(qual.sum())
      s["recovery"] = float(share[qual].mean()) if qual.any() else None
  return out


def goals_of(summary, results, pol, a) -> list[dict]:
  """(goal, PASS / MISS / SKIP, detail) for (d), the arm ``SpecRoll`` runs by default."""
  g, (gap, qual), arm = [], gaps(results, a), "both"
  lab, x = LABELS[arm], summary.get(arm)

  def goal(name, ok, detail):
    g.append({"goal": f"{lab} {name}", "detail": detail,
              "status": ok if isinstance(ok, str) else "PASS" if ok else "MISS"})

  if x is None or gap is None:
    goal("recovers >= 50% of the gap", "SKIP", f"needs arms static, ceiling and {arm}")
  elif not qual.any():
    goal("recovers >= 50% of the gap", "SKIP", f"the gap never exceeds {a.min_gap} tau: the "
         f"drift did not stale the heads (max gap {gap.max():+.3f} at batch {gap.argmax()}; "
         f"KL to step 0 at the last policy {pol[-1]['kl_to_step0']:.4f} nats/token)")
  else:
    goal("recovers >= 50% of the gap", x["recovery"] >= 0.5, f"mean share "
         f"{100 * x['recovery']:.1f}% over the {x['recovery_batches']} batches where the gap "
         f"exceeds {a.min_gap}")
  best = max((o for o in ("reflex", "slow") if o in summary), default=None,
             key=lambda o: summary[o]["mean_tau"])
  if x is None or best is None:
    goal(">= max((b), (c))", "SKIP", f"needs arm {arm} and reflex or slow")
  else:
    goal(">= max((b), (c))", x["mean_tau"] >= summary[best]["mean_tau"],
         f"mean tau {arm} {x['mean_tau']:.4f} vs {best} {summary[best]['mean_tau']:.4f}")
  if x is None or "static" not in summary:
    goal("adaptation <= 5% of rollout time", "SKIP", f"needs arms static and {arm}")
    return g
  extra = f" (Reflex slept in {x['asleep_batches']} of {len(results[arm])} batches" + (
      "" if x["in_loop_asleep_cost"] is None else ", which ran "
      f"{100 * x['in_loop_asleep_cost']:+.1f}% per forward vs static: the noise") + ")"
  goal("adaptation <= 5% of rollout time", x["adaptation_share"] <= 0.05,
       f"{lab}: in-loop {100 * x['in_loop_share']:.1f}% + host {100 * x['host_share']:.1f}% = "
       f"{100 * x['adaptation_share']:.1f}%{extra}")
  return g


def report(results, pol, van_s, a) -> tuple[dict, list]:
  from rich.console import Console
  from rich.table import Table
  con, summary, (gap, qual) = Console(width=220), summarize(results, van_s, a), gaps(results, a)
  t = Table("batch", "GRPO step", "KL to 0", "entropy", *results, *["gap"][:gap is not None],
            title=f"tau per batch: policy b of a GRPO run (lr {a.grpo_lr}, {a.grpo_prompts}x"
                  f"{a.grpo_group}), {a.prompts}x{a.group} synthetic test prompts, T="
                  f"{a.temperature}, {a.max_new_tokens} tokens")
  for b, p in enumerate(pol):
    t.add_row(str(b), str(p["step"]), f"{p['kl_to_step0']:.4f}", f"{p['entropy']:.3f}",
              *[f"{results[x][b]['tau']:.3f}" for x in results],
              *([] if gap is None else [f"{gap[b]:+.3f}" + "*" * bool(qual[b])]))
  con.print(t)
  s = Table("arm", "mean tau", "tau first 5", "tau last 10", "acc. depth 1/2/3", "same", "ms/fwd",
            "in-loop vs static", "in-loop share", "host share",
            f"recovery (batches gap > {a.min_gap})", "refreshes kept/back", "vs vanilla",
            title="per arm (seconds exclude compile; in-loop cost: ms per target forward vs "
                  "static; shares of the arm's rollout time)")
  pct = lambda v, sign="": "-" if v is None else f"{100 * v:{sign}.1f}%"
  for arm, x in summary.items():
    rec = "-" if x["recovery_per_batch"] is None else "n/a (0 batches)" if x["recovery"] is None \
        else f"{pct(x['recovery'])} ({x['recovery_batches']})"
    s.add_row(f"{LABELS.get(arm, '')} {arm}".strip(), f"{x['mean_tau']:.3f}",
              f"{x['tau_first5']:.3f}", f"{x['tau_last10']:.3f}",
              " ".join("-" if v is None else f"{v:.3f}" for v in x["acceptance"][:3]),
              str(x["all_same"]), f"{x['ms_per_forward']:.2f}", pct(x["in_loop_cost"], "+"),
              pct(x["in_loop_share"]), pct(x["host_share"]), rec,
              f"{x['kept']}/{x['rolled_back']}", f"{x['speedup_vs_vanilla']:.2f}x")
  con.print(s)
  print(f"policies: KL to step 0 (nats/token) {pol[0]['kl_to_step0']:.4f} -> "
        f"{pol[-1]['kl_to_step0']:.4f}, entropy {pol[0]['entropy']:.3f} -> "
        f"{pol[-1]['entropy']:.3f}, parameter change {pol[-1]['param_change']:.2e}")
  if gap is not None:
    print(f"gap tau_ceiling - tau_static: batch 0 {gap[0]:+.3f} (before any drift), mean "
          f"{gap.mean():+.3f}, {int(qual.sum())}/{len(gap)} batches above {a.min_gap}")
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
    ax[0].plot(steps, _taus(rec), "o-", ms=3, label=arm)
  for arm, s in summary.items():
    if s["recovery_per_batch"] is not None:
      ax[2].plot(steps, [np.nan if y is None else y for y in s["recovery_per_batch"]], "o-",
                 ms=3, label=arm)
  ax[1].plot(steps, [p["kl_to_step0"] for p in pol], "k.-")
  ax[1].twinx().plot(steps, [p["entropy"] for p in pol], "r.--")
  ax[2].axhline(0.5, color="grey", ls=":", lw=1)
  ax[0].set(xlabel="GRPO step of the policy (batch b replays policy b)", ylabel="tau",
            title=f"tau (tokens / target forward) per batch, T = {a.temperature}")
  ax[1].set(xlabel="GRPO step", ylabel="KL(policy || step 0), nats / token (black); entropy (red)",
            title="drift of the policies (on the vanilla rollouts)")
  ax[2].set(xlabel="GRPO step", ylabel="(tau - tau_static) / (tau_ceiling - tau_static)",
            title=f"recovered share of the gap (batches with gap > {a.min_gap})")
  for x in (ax[0], ax[2]):
    if x.lines[1:]:
      x.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)

