"""Drafts coupled to the target's noise against drafts ranked by the heads alone.

  .venv/bin/python experiments/bench_coupling.py                    # every part (about 25 min)
  .venv/bin/python experiments/bench_coupling.py --parts hits       # one part
  .venv/bin/python experiments/bench_coupling.py --quick            # CI-sized smoke run

Part "hits" (teacher-forced, ``draft_quality.depth_hits``): on the target's own rollouts of
prompts no fit used (GSM8K train prompts from --offset, the synthetic task's test problems;
--prompts x --group, seed --seed), per depth the share of sampled tokens among a head's first 1
and 4 candidates, and the tau of a chain with 4 candidates per depth, ranked deterministically
(the head's probabilities) and coupled (``sampling.draft_keys``), at T = 1, 0.7 and 0, for the
shipped root-conditioned heads and for heads fitted on each task's own rollouts (--fit-prompts
train prompts at T = 1, --fit-steps steps from the shipped heads, cached).

Part "loss": heads fitted from the shipped ones on the same GSM8K rollouts with
``cond_heads.fit``'s loss as it is and with its total-variation term (--tv-weights), then the
coupled hits of each on the held-out rollouts: the loss kept is the one with the higher coupled
acceptance.

Part "object": ``SpecRoll`` with the shipped heads, a fresh state, a fixed --nodes nodes per row
in every bucket, coupled and not (``RankedHeads(coupled=...)``): tau of its first batch on GSM8K
train prompts from --offset (T = 1, 0.7, 0) and on the synthetic test problems (T = 1), and with
the heads fitted on GSM8K (--object-tv-weight) at T = 1; every row checks the vanilla engine's
tokens. Writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import _common
import jax
import numpy as np

from app import cli, pipeline, tasks
from app import draft_quality as DQ
from specroll_jax import rollout
from specroll_jax.data import gsm8k
from specroll_jax.engines import executables
from specroll_jax.engines.config import SpecConfig
from specroll_jax.heads import conditioned as CH
from specroll_jax.proposers import RankedHeads
from specroll_jax.sampling import SamplingConfig, group_sample_ids
from specroll_jax.specroll import SpecRoll

PARTS = ("hits", "loss", "object")
TASK_TOKENS = {"gsm8k": 128, "synthetic": 48}


def task_prompts(tok, task: str, n: int, offset: int):
  """(prompts, split) no fit used: GSM8K train prompts from ``offset``, synthetic test problems."""
  if task == "gsm8k":
    return pipeline.prompts(tok, "train", n, offset)[0]
  exs = tasks.Task(name="synthetic").examples("test")[:n]
  return [tok.encode(gsm8k.format_prompt(e.question)) for e in exs]


def held_out(a, config, params, tok, task: str, temperature: float):
  """The target's rollouts of the held-out prompts, with what the noise needs."""
  rows = [p for p in task_prompts(tok, task, a.prompts, a.offset) for _ in range(a.group)]
  padded, plens = rollout.pad_prompts(rows)
  sids = group_sample_ids(np.arange(a.prompts), a.group)
  m = min(TASK_TOKENS[task], a.max_new_tokens)
  r = rollout.generate(config, params, padded, prompt_lengths=plens,
                       sampling=SamplingConfig(temperature=temperature), max_new_tokens=m,
                       seed=a.seed, sample_ids=sids, eos_ids=tok.eos_ids,
                       options=rollout.DecodeOptions(cache_length=padded.shape[1] + m,
                                                     return_hidden=True))
  return (np.asarray(r.tokens), np.asarray(r.lengths), np.asarray(r.hidden), plens, sids)


def fitted(a, config, params, tok, shipped, task: str, tv_weight: float):
  """Heads fitted from the shipped ones on the target's own T = 1 rollouts of ``task``'s train
  prompts (cached by settings)."""
  from specroll_jax import cache as _cache
  key = f"{task}-{a.fit_prompts}-{a.fit_steps}-{tv_weight}-{a.max_new_tokens}"
  file = _cache.cache_dir() / "heads" / f"coupling-{key}.safetensors"
  if file.exists():
    return CH.load(file)
  m = min(TASK_TOKENS[task], a.max_new_tokens)
  t = tasks.Task(name=task)
  print(f"  fitting heads on {task} (tv_weight {tv_weight})", flush=True)
  toks, lens, hid = pipeline.self_rollouts(config, params, tok, num_prompts=a.fit_prompts,
                                           max_new_tokens=m, sampling=SamplingConfig(), seed=7,
                                           chunk=64, task=None if task == "gsm8k" else t)
  hd, _ = CH.fit(config, params, shipped, toks, lens, hid, sampling=SamplingConfig(),
                 steps=a.fit_steps, learning_rate=1e-3, tv_weight=tv_weight,
                 progress=sys.stdout.isatty())
  file.parent.mkdir(parents=True, exist_ok=True)
  CH.save(file, hd)
  return hd


def _hits_row(config, params, heads, data, temperature, seed, coupled):
  h = DQ.depth_hits(config, params, heads, *data, seed, sampling=SamplingConfig(
      temperature=temperature), coupled=coupled)
  return {"coupled": coupled, "anchors": h.anchors,
          "top1": [x[0] for x in h.hit], "top4": [x[3] for x in h.hit],
          "chain_tau4": h.chain_tau[3], "chain_tau1": h.chain_tau[0]}


def part_hits(a, config, params, tok, shipped):
  rows = []
  for task in a.tasks:
    heads = {"shipped": shipped,
             f"fitted on {task}": fitted(a, config, params, tok, shipped, task, 0.0)}
    for t in a.temperatures:
      data = held_out(a, config, params, tok, task, t)
      for name, hd in heads.items():
        for coupled in (False, True):
          rows.append(_logged(f"{task} T={t} {name}", {
              "task": task, "T": t, "heads": name,
              **_hits_row(config, params, hd, data, t, a.seed, coupled)}))
  return rows


def _logged(label: str, row: dict) -> dict:
  """``row`` (a ``_hits_row``), after one line of it on stdout."""
  print(f"  {label} {'coupled' if row['coupled'] else 'deterministic'}: depth-1 top-1 "
        f"{row['top1'][0]:.3f}, top-4 {row['top4'][0]:.3f}, chain tau {row['chain_tau4']:.3f}",
        flush=True)
  return row


def part_loss(a, config, params, tok, shipped):
  rows = []
  data = held_out(a, config, params, tok, "gsm8k", 1.0)
  for w in a.tv_weights:
    hd = fitted(a, config, params, tok, shipped, "gsm8k", w)
    for coupled in (False, True):
      rows.append(_logged(f"tv_weight {w}", {
          "tv_weight": w, **_hits_row(config, params, hd, data, 1.0, a.seed, coupled)}))
  return rows


def part_object(a, config, params, tok, shipped):
  rows = []
  cases = [("gsm8k", t, "shipped") for t in a.temperatures] + [("synthetic", 1.0, "shipped")]
  cases += [("gsm8k", 1.0, "fitted on gsm8k")]
  for task, t, heads_name in cases:
    if task not in a.tasks:
      continue
    heads = shipped if heads_name == "shipped" else fitted(a, config, params, tok, shipped,
                                                           task, a.object_tv_weight)
    m = 256 if task == "gsm8k" else 48
    m = min(m, a.object_tokens)
    ids = task_prompts(tok, task, a.prompts, a.offset)
    sampling = SamplingConfig(temperature=t)
    ref = None
    for nodes in a.nodes:
      for coupled in (False, True):
        # one row bucket: a row's trees and tau do not depend on compaction, one loop compiles
        sr = SpecRoll(config, sampling=sampling, group_size=a.group, max_new_tokens=m,
                      budget="fixed", heads_tree=RankedHeads(coupled=coupled),
                      spec=SpecConfig(bucket_fractions=(1.0,), nodes=(nodes,)))
        batch = sr.batch(ids, a.offset + np.arange(a.prompts))
        if ref is None:
          ref = rollout.generate(config, params, batch.tokens, prompt_lengths=batch.lengths,
                                 sampling=sampling, max_new_tokens=m,
                                 sample_ids=batch.sample_ids, seed=a.seed, eos_ids=sr.eos_ids,
                                 options=rollout.DecodeOptions(
                                     cache_length=batch.cache_length))
        out, rep, _ = sr.generate(params, batch, sr.init(heads), seed=a.seed)
        same = bool((np.asarray(out.tokens) == np.asarray(ref.tokens)).all())
        executables.clear()  # each object compiles its own programs: free their code mappings
        jax.clear_caches()
        row = {"task": task, "T": t, "heads": heads_name, "nodes": nodes, "coupled": coupled,
               "tau": rep.tau, "depth_acceptance": list(rep.depth_acceptance),
               "identical": same}
        rows.append(row)
        print(f"  {task} T={t} {heads_name} {nodes} nodes "
              f"{'coupled' if coupled else 'deterministic'}: tau {row['tau']:.3f} identical "
              f"{same}", flush=True)
  return rows


def main(argv=None):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  _common.add_shared_flags(ap, out="runs/bench_coupling.json", prompts=16, group=8,
                           max_new_tokens=128)
  ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
  ap.add_argument("--tasks", nargs="+", choices=("gsm8k", "synthetic"),
                  default=["gsm8k", "synthetic"])
  ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7, 0.0])
  ap.add_argument("--offset", type=int, default=5200,
                  help="first GSM8K train prompt of the held-out batch (no fit reads past "
                       "--fit-prompts)")
  ap.add_argument("--fit-prompts", type=int, default=2048)
  ap.add_argument("--fit-steps", type=int, default=2000)
  ap.add_argument("--tv-weights", type=float, nargs="+", default=[0.0, 1.0])
  ap.add_argument("--nodes", type=int, nargs="+", default=[4, 1])
  ap.add_argument("--object-tokens", type=int, default=256,
                  help="new tokens of the object's GSM8K batch")
  ap.add_argument("--object-tv-weight", type=float, default=0.0,
                  help="the TV weight of the GSM8K-fitted heads the object row runs")
  ap.add_argument("--quick", action="store_true",
                  help="CI-sized: 2 prompts x 4, 16 tokens, tiny fits, T = 1 and 0")
  a = ap.parse_args(argv)
  _common.check_shared_flags(a, temperatures=0.0, offset=0, fit_prompts=1, fit_steps=1,
                             tv_weights=0.0, nodes=1, object_tokens=1, object_tv_weight=0.0)
  if a.quick:
    a.prompts, a.group, a.max_new_tokens, a.object_tokens = 2, 4, 16, 16
    a.fit_prompts, a.fit_steps, a.temperatures, a.nodes = 8, 5, [1.0, 0.0], [4]
  if a.offset < a.fit_prompts and "gsm8k" in a.tasks:
    cli.fail("--offset", a.offset, f"the held-out prompts start before the fit's last one "
             f"(--fit-prompts {a.fit_prompts})")
  config, params, tok, path = _common.load_model(a)
  shipped = pipeline.default_heads(config, params, tok, path, conditioned=True)
  res = {"meta": {"command": "experiments/bench_coupling.py " + " ".join(argv or sys.argv[1:]),
                  "cpu": _common.cpu_model(), "jax": jax.__version__, "model": str(path),
                  "prompts": a.prompts, "group": a.group, "seed": a.seed}}
  out = Path(a.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  for part, fn in (("hits", part_hits), ("loss", part_loss), ("object", part_object)):
    if part in a.parts:
      print(f"== {part} ==", flush=True)
      res[part] = fn(a, config, params, tok, shipped)
      out.write_text(json.dumps(res, indent=1))
  _print(res)
  _plot(res, out.with_suffix(".png"))
  print(f"wrote {out} and {out.with_suffix('.png')}")
  return res


def _print(res):
  from rich.console import Console
  from rich.table import Table
  con = Console(width=200)
  f3 = lambda x: f"{x:.3f}"
  if "hits" in res:
    t = Table(title=f"Teacher-forced draft quality ({res['meta']['cpu']}): share of sampled "
                    "tokens among the first 1 / 4 candidates per depth, chain tau at 4 per depth")
    for c in ("task", "T", "heads", "ranking", "top-1 d1/d2/d3", "top-4 d1/d2/d3",
              "chain tau (4)"):
      t.add_column(c)
    for r in res["hits"]:
      t.add_row(r["task"], str(r["T"]), r["heads"], "coupled" if r["coupled"] else "deterministic",
                " / ".join(map(f3, r["top1"])), " / ".join(map(f3, r["top4"])),
                f3(r["chain_tau4"]))
    con.print(t)
  if "loss" in res:
    t = Table(title="Heads fitted with and without the TV term: GSM8K, T = 1, held-out")
    for c in ("tv_weight", "ranking", "top-1 d1/d2/d3", "top-4 d1/d2/d3", "chain tau (4)"):
      t.add_column(c)
    for r in res["loss"]:
      t.add_row(str(r["tv_weight"]), "coupled" if r["coupled"] else "deterministic",
                " / ".join(map(f3, r["top1"])), " / ".join(map(f3, r["top4"])),
                f3(r["chain_tau4"]))
    con.print(t)
  if "object" in res:
    t = Table(title="SpecRoll, fresh state, fixed nodes per row: its first batch")
    for c in ("task", "T", "heads", "nodes", "ranking", "tau", "depth acceptance", "tokens"):
      t.add_column(c)
    for r in res["object"]:
      t.add_row(r["task"], str(r["T"]), r["heads"], str(r["nodes"]),
                "coupled" if r["coupled"] else "deterministic", f3(r["tau"]),
                " / ".join(map(f3, r["depth_acceptance"][:3])),
                "identical" if r["identical"] else "DIFFER")
    con.print(t)


def _plot(res, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
  if "hits" in res:
    labels, det, cpl = [], [], []
    for r in res["hits"]:
      if r["coupled"]:
        cpl.append(r["chain_tau4"])
      else:
        labels.append(f"{r['task']} T={r['T']}\n{r['heads']}")
        det.append(r["chain_tau4"])
    y = np.arange(len(labels))
    ax[0].barh(y - 0.2, det, 0.4, label="deterministic")
    ax[0].barh(y + 0.2, cpl, 0.4, label="coupled")
    ax[0].set_yticks(y, labels, fontsize=6)
    ax[0].set_xlabel("teacher-forced chain tau, 4 candidates per depth")
    ax[0].legend(fontsize=7)
  if "object" in res:
    labels = sorted({(r["task"], r["T"], r["heads"], r["nodes"]) for r in res["object"]},
                    key=lambda x: (x[0], -x[1], x[2], -x[3]))
    tau = {(r["task"], r["T"], r["heads"], r["nodes"], r["coupled"]): r["tau"]
           for r in res["object"]}
    y = np.arange(len(labels))
    for c in (False, True):
      ax[1].barh(y + (0.2 if c else -0.2), [tau[k + (c,)] for k in labels], 0.4,
                 label="coupled" if c else "deterministic")
    ax[1].set_yticks(y, [f"{k[0]} T={k[1]} {k[2]}, {k[3]} nodes" for k in labels], fontsize=7)
    ax[1].set_xlabel("tau, SpecRoll's first batch (fresh state)")
    ax[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  main()
