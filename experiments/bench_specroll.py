"""SpecRoll's defaults against the compacting vanilla engine, its adaptation to a task shift, and
heads learned from nothing.

  .venv/bin/python experiments/bench_specroll.py                  # both parts, T = 1, 0.7, 0
  .venv/bin/python experiments/bench_specroll.py --quick          # CI-sized smoke run
  .venv/bin/python experiments/bench_specroll.py --parts defaults --tasks synthetic \
      --widen 0.5b --prompts 1 --group 2 --temperatures 1   # a batch's tail at a real shape

--widen SHAPE runs part 1 on the embedded model widened into a Qwen2.5 shape (``app.widen``,
f32 unless --dtype): the embedded model's tokens and acceptance at the real shape's cost per
forward; with few rows (--prompts 1 --group 2) it is the tail of a GRPO batch, where a verify
forward costs least over a plain step.

Part 1, per task (the main job's synthetic problems, GSM8K) and temperature: a GRPO-shaped batch
of --prompts *test* prompts x --group, rolled out by the compacting vanilla engine and by
``SpecRoll`` with its defaults (goodput budgets: the wall-clock row), and by the same object's tree
with --nodes nodes per row in every bucket (``budget="fixed"``: the proposal-quality row: tau,
depth-1 acceptance). Before the measured batch each object rolls out --warmup batches of other
prompts (its calibration, Reflex and slow path learn there) and the measured prompts once at
another seed (what a later epoch finds in its store of earlier responses). Compile seconds are the
first call's ``report.compile_seconds``; every timed call runs warm, median of --repeats. Every
row checks the vanilla tokens.

Part 2, the task shift: heads fitted for one task (the shipped root-conditioned heads: the
synthetic problems) propose on GSM8K prompts at T = 1, --shift-batches batches of --shift-prompts
prompts x G, --nodes nodes per row: tau per batch for the object (adaptation on), for the same
object with its slow path and Reflex off (static heads), and for heads fitted on the target's own
GSM8K rollouts (the ceiling; ``pipeline.fitted_cond_heads``, cached).

Part 3, the cold start: on the main job's task (synthetic train problems, T = 1, --cold-batches
batches of --cold-prompts prompts x G, --nodes nodes per row), tau per batch of heads learned from
nothing (``SpecRoll.init("learn")``) and of the shipped heads (adapting too), with each batch's
learning seconds. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import _common
import jax
import numpy as np

from app import cli, pipeline, tasks
from app.widen import QWEN25_SHAPES, widen
from specroll_jax import rollout
from specroll_jax.adaptation.slow_path import SlowPathConfig
from specroll_jax.data import gsm8k
from specroll_jax.specroll import SpecRoll

TASKS = ("synthetic", "gsm8k")


def prompts_of(tok, task: str, split: str, n: int, offset: int = 0):
  every = tasks.Task(name=task).examples(split)
  if offset + n > len(every):
    cli.fail("--prompts", n, f"{task} {split} has {len(every)} problems; this batch needs "
             f"{offset} + {n}")
  exs = every[offset:offset + n]
  return [tok.encode(gsm8k.format_prompt(e.question)) for e in exs]


def run_object(sr, params, state, tok, a, task, seed):
  """Warm the object (other prompts, then the measured ones at another seed), then time it on
  the measured batch. Returns (report row, state)."""
  compile_s = 0.0  # the object's compiles: its first batch compiles every program it can run
  for w in range(a.warmup):
    ids = prompts_of(tok, task, "train", a.prompts, offset=w * a.prompts)
    pids = 10_000 + w * a.prompts + np.arange(a.prompts)
    _, rep, state = sr.generate(params, sr.batch(ids, pids), state, seed=seed + 100 + w)
    compile_s += rep.compile_seconds
  batch = sr.batch(prompts_of(tok, task, "test", a.prompts), np.arange(a.prompts))
  _, rep, state = sr.generate(params, batch, state, seed=seed + 1000)  # an earlier epoch: the store
  compile_s += rep.compile_seconds
  times, reports = [], []
  for _ in range(a.repeats):  # the same state each time: the same plan, the same tokens
    out, rep, _ = sr.generate(params, batch, state, seed=seed)
    times.append(rep.rollout_seconds)
    reports.append(rep)
    compile_s += rep.compile_seconds if len(times) == 1 else 0.0
  r = reports[0]
  return out, batch, {"seconds": float(np.median(times)), "tau": r.tau, "probe_tau": r.probe_tau,
                      "depth1": r.depth_acceptance[0] if r.depth_acceptance else None,
                      "mode": r.mode, "nodes": list(r.nodes), "compile_s": compile_s,
                      "forwards": int(out.stats.forwards),
                      "reflex": r.reflex}


def part1(a, config, params, tok, heads, task, temperature):
  sampling = rollout.SamplingConfig(temperature=temperature)
  m = a.max_new_tokens if task == "gsm8k" else min(a.max_new_tokens, 48)
  more = {} if a.cost_nodes is None else {"cost_nodes": tuple(a.cost_nodes)}
  base = SpecRoll(config, sampling=sampling, group_size=a.group, max_new_tokens=m, **more)
  fixed = dataclasses.replace(base, budget="fixed", spec=dataclasses.replace(
      base.spec, nodes=(a.nodes,) * len(base.spec.bucket_fractions)))
  rows = []
  van_batch = base.batch(prompts_of(tok, task, "test", a.prompts), np.arange(a.prompts))
  van = lambda s: rollout.generate(config, params, van_batch.tokens, sampling=sampling,
                                   prompt_lengths=van_batch.lengths, max_new_tokens=m,
                                   sample_ids=van_batch.sample_ids, seed=s, eos_ids=base.eos_ids,
                                   options=rollout.DecodeOptions(
                                       cache_length=van_batch.cache_length))
  ref, t_van, c_van = _common.timed(lambda: van(a.seed), a.repeats)
  rows.append({"engine": "vanilla (compacting)", "seconds": t_van, "tau": 1.0,
               "compile_s": c_van, "forwards": int(ref.stats.forwards), "identical": True})
  for name, sr in (("SpecRoll defaults", base), (f"SpecRoll tree, {a.nodes} nodes/row", fixed)):
    out, _, row = run_object(sr, params, sr.init(heads), tok, a, task, a.seed)
    row.update(engine=name, identical=bool((np.asarray(out.tokens) == np.asarray(ref.tokens))
                                            .all()))
    rows.append(row)
    print(f"  {task} T={temperature} {name}: tau {row['tau']:.3f} (trees {row['probe_tau']}), "
          f"{t_van / row['seconds']:.2f}x, mode {row['mode']} {row['nodes']}", flush=True)
  for r in rows:
    r["vs_vanilla"] = t_van / r["seconds"]
    r["ms_per_forward"] = 1e3 * r["seconds"] / max(r["forwards"], 1)
  return {"task": task, "temperature": temperature, "max_new_tokens": m, "rows": rows}


def curves(a, params, tok, arms, task: str, offset: int, batches: int, prompts: int):
  """tau per batch of each arm (name -> (object, state)) on ``batches`` consecutive batches of
  ``prompts`` train problems of ``task`` from ``offset``, with each batch's learning seconds (the
  host work after the rollout: records and the slow path)."""
  out = {k: [] for k in arms}
  for b in range(batches):
    ids = prompts_of(tok, task, "train", prompts, offset=offset + b * prompts)
    pids = 50_000 + offset + b * prompts + np.arange(prompts)
    for name, (obj, st) in arms.items():
      _, rep, st = obj.generate(params, obj.batch(ids, pids), st, seed=a.seed + b,
                                step_seconds=a.step_seconds)
      arms[name] = (obj, st)
      out[name].append({"tau": rep.tau, "slow": None if rep.slow is None else rep.slow.decision,
                        "host_s": rep.host_seconds, "rollout_s": rep.rollout_seconds,
                        "refresh_s": 0.0 if rep.slow is None else rep.slow.refresh_seconds,
                        "events": list(rep.events)})
    print(f"  batch {b}: " + ", ".join(f"{k} {v[-1]['tau']:.3f}" for k, v in out.items()),
          flush=True)
  return out


def _fixed(sr, nodes: int):
  return dataclasses.replace(sr, budget="fixed", spec=dataclasses.replace(
      sr.spec, nodes=(nodes,) * len(sr.spec.bucket_fractions)))


def part2(a, config, params, tok, path, heads):
  sampling = rollout.SamplingConfig(temperature=1.0)
  m = a.max_new_tokens
  print("== task shift: fitting / loading the GSM8K ceiling heads ==", flush=True)
  ceiling = pipeline.fitted_cond_heads(config, params, tok, path, sampling=sampling,
                                       num_prompts=a.ceiling_prompts, steps=a.ceiling_steps,
                                       max_new_tokens=m)
  sr = _fixed(SpecRoll(config, sampling=sampling, group_size=a.group, max_new_tokens=m), a.nodes)
  static = dataclasses.replace(sr, reflex=None, slow=SlowPathConfig(mode="off"))
  arms = {"SpecRoll (adapting)": (sr, sr.init(heads)),
          "static heads": (static, static.init(heads)),
          "ceiling (heads fitted on GSM8K)": (static, static.init(ceiling))}
  # past the ceiling's prompts
  got = curves(a, params, tok, arms, "gsm8k", a.ceiling_prompts, a.shift_batches, a.shift_prompts)
  return {"curves": got, "batch_rows": a.shift_prompts * a.group}


def part3(a, config, params, tok, heads):
  """The cold start: heads learned from nothing (``init("learn")``) against the shipped heads
  (adapting too) on the same batches of the main job's task."""
  sampling = rollout.SamplingConfig(temperature=1.0)
  sr = _fixed(SpecRoll(config, sampling=sampling, group_size=a.group,
                       max_new_tokens=min(a.max_new_tokens, 48)), a.nodes)
  arms = {"learned from nothing": (sr, sr.init("learn")),
          "shipped heads": (sr, sr.init(heads))}
  got = curves(a, params, tok, arms, "synthetic", 0, a.cold_batches, a.cold_prompts)
  return {"curves": got, "batch_rows": a.cold_prompts * a.group}


def main(argv=None):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  _common.add_shared_flags(ap, out="runs/bench_specroll.json")
  ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7, 0.0])
  ap.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
  ap.add_argument("--nodes", type=int, default=4, help="nodes per row of the quality rows")
  ap.add_argument("--warmup", type=int, default=2, help="batches of other prompts first")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--parts", nargs="+", choices=["defaults", "shift", "coldstart"],
                  default=["defaults", "shift", "coldstart"])
  ap.add_argument("--shift-batches", type=int, default=12)
  ap.add_argument("--shift-prompts", type=int, default=8)
  ap.add_argument("--step-seconds", type=float, default=None,
                  help="parts 2 and 3: the seconds of the GRPO step each batch stands for "
                       "(SpecRoll.generate's step_seconds: what the heads' learning may spend a "
                       "share of; default: the rollout's own seconds)")
  ap.add_argument("--cold-batches", type=int, default=12)
  ap.add_argument("--cold-prompts", type=int, default=8)
  ap.add_argument("--ceiling-prompts", type=int, default=2048)
  ap.add_argument("--ceiling-steps", type=int, default=4000)
  ap.add_argument("--cost-nodes", type=int, nargs="+", default=None,
                  help="node counts goodput prices and chooses from (default: SpecRoll's)")
  ap.add_argument("--widen", choices=sorted(QWEN25_SHAPES), default=None,
                  help="part 1 on the embedded model widened into this Qwen2.5 shape")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                  help="the widened model's dtype")
  ap.add_argument("--quick", action="store_true", help="CI-sized: 2 prompts x 4, 24 tokens, T=1")
  a = ap.parse_args(argv)
  _common.check_shared_flags(a, temperatures=0.0, nodes=1, cost_nodes=0, warmup=0, repeats=1,
                             shift_batches=1, shift_prompts=1, ceiling_prompts=1, ceiling_steps=1,
                             cold_batches=1, cold_prompts=1, step_seconds=0.0)
  if a.quick:
    a.temperatures, a.prompts, a.group, a.max_new_tokens = [1.0], 2, 4, 24
    a.repeats, a.warmup, a.shift_batches, a.shift_prompts = 1, 1, 2, 2
    a.cold_batches, a.cold_prompts = 2, 2
    a.ceiling_prompts, a.ceiling_steps = 8, 10
  config, params, tok, path = _common.load_model(a)
  heads = pipeline.default_heads(config, params, tok, path, conditioned=True)
  if a.widen:
    if set(a.parts) - {"defaults"}:
      cli.fail("--parts", " ".join(a.parts), "--widen runs part 1 only (--parts defaults)")
    config, params, heads = widen(config, params, QWEN25_SHAPES[a.widen],
                                  key=jax.random.key(0), heads=heads, dtype=a.dtype)
  meta = {"command": "experiments/bench_specroll.py " + " ".join(argv or sys.argv[1:]),
          "cpu": _common.cpu_model(), "jax": jax.__version__,
          "device": jax.devices()[0].device_kind, "model": str(path),
          "widened": None if a.widen is None else {"shape": a.widen, "dtype": a.dtype,
                                                   "layers": config.num_layers,
                                                   "hidden": config.hidden_size}}
  res = {"meta": meta, "defaults": [], "shift": None, "coldstart": None}
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  save = lambda: out.write_text(json.dumps(res, indent=1, default=str))
  if "defaults" in a.parts:
    for task in a.tasks:
      for t in a.temperatures:
        res["defaults"].append(part1(a, config, params, tok, heads, task, t))
        save()
  if "shift" in a.parts:
    res["shift"] = part2(a, config, params, tok, path, heads)
    save()
  if "coldstart" in a.parts:
    print("== cold start: heads learned from nothing vs the shipped heads ==", flush=True)
    res["coldstart"] = part3(a, config, params, tok, heads)
    save()
  _print(res, a)
  _plot(res, out.with_suffix(".png"))
  print(f"wrote {out} and {out.with_suffix('.png')}")
  return res


def _print(res, a):
  from rich.console import Console
  from rich.table import Table
  con = Console(width=200)
  t = Table(title=f"SpecRoll's defaults vs the compacting vanilla engine: {a.prompts} test prompts "
                  f"x G = {a.group} ({res['meta']['cpu']}; compile apart)")
  for c in ("task", "T", "engine", "mode / nodes", "tau", "tau of verified trees", "depth-1",
            "seconds", "ms/forward", "vs vanilla", "compile s", "identical"):
    t.add_column(c)
  for block in res["defaults"]:
    for r in block["rows"]:
      fmt = lambda k, f="{:.3f}", r=r: "-" if r.get(k) is None else f.format(r[k])
      t.add_row(block["task"], str(block["temperature"]), r["engine"],
                f"{r.get('mode', '-')} {r.get('nodes', '')}", fmt("tau"), fmt("probe_tau"),
                fmt("depth1"), fmt("seconds"), fmt("ms_per_forward", "{:.1f}"),
                fmt("vs_vanilla", "{:.2f}x"),
                fmt("compile_s", "{:.1f}"), str(r["identical"]))
  con.print(t)
  for key, title in (("shift", "Task shift (heads for the synthetic task, GSM8K prompts"),
                     ("coldstart", "Cold start (the main job's task")):
    if not res[key]:
      continue
    s = Table(title=f"{title}, T = 1, {res[key]['batch_rows']}-row batches): tau per batch "
                    "(learning seconds: the host work after the rollout)")
    s.add_column("batch")
    got = res[key]["curves"]
    for k in got:
      s.add_column(k)
    for b in range(len(next(iter(got.values())))):
      s.add_row(str(b), *(f"{got[k][b]['tau']:.3f} ({got[k][b]['host_s']:.2f} s)" for k in got))
    con.print(s)


def _plot(res, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
  labels, ratio, tau = [], [], []
  for block in res["defaults"]:
    for r in block["rows"][1:]:
      labels.append(f"{block['task']} T={block['temperature']}\n{r['engine']}")
      ratio.append(r["vs_vanilla"])
      tau.append(r["probe_tau"] or r["tau"])
  y = np.arange(len(labels))
  ax[0].barh(y - 0.2, ratio, 0.4, label="wall-clock vs compacting vanilla")
  ax[0].barh(y + 0.2, tau, 0.4, label="tau of verified trees")
  ax[0].axvline(1.0, color="grey", lw=0.8)
  ax[0].set_yticks(y, labels, fontsize=6)
  ax[0].legend(fontsize=7)
  for key, style, what in (("shift", "o-", "task shift to GSM8K"),
                           ("coldstart", "s--", "cold start")):
    if res[key]:
      for k, v in res[key]["curves"].items():
        ax[1].plot([x["tau"] for x in v], style, label=f"{what}: {k}")
  if res["shift"] or res["coldstart"]:
    ax[1].set_xlabel("batch")
    ax[1].set_ylabel("tau")
    ax[1].set_title("adaptation: tau per batch")
    ax[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  main()
