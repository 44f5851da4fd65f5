"""The engine before and after a change, side by side in one run; and the proposers vs vanilla.

  .venv/bin/python experiments/bench_engine.py --compare-to cf445f5     # GSM8K batch, CPU
  .venv/bin/python experiments/bench_engine.py --quick                  # smoke test, no compare

A worker process per code version (the current tree and, with --compare-to REF, a git worktree of
REF) runs the same cases on the same model, heads, prompts, sample ids and seed, through the public
``rollout.generate`` call both versions share. Workers alternate over --rounds rounds (old, new,
old, new, ...) so both see the same machine state; per case the median over rounds of each round's
median time is reported. Cases:

* vanilla and static heads at budgets 32 and 64 (4 buckets), T = 0 and 1: tau, ms per target
  forward (seconds / forwards), and their ratio new / old;
* one bucket with every row at N nodes (N = 0, 1, 2, 4, 8), T = 1: ms per forward relative to
  vanilla's, before and after;
* compile time of the 4-bucket budget-64 rollout (first call minus the warm median);
* new version only: prompt lookup and ``Merged`` (the heads and the row's own-text lookup in one
  ranked tree) vs vanilla at T = 0, 0.7, 1.

The shared cases pass ``speculation=Speculation(HeadsProposer(...), heads, spec)`` (the static
Medusa proposer every version has); a REF from before ``Speculation``
(52ae761) took ``spec=`` and ``heads=`` instead, which the worker passes when the library it runs
has no ``rollout.Speculation``.

Compile time never enters the speed figures. Writes JSON and a PNG next to --out.
"""

from __future__ import annotations

import sys

if "--worker" not in sys.argv:  # a worker imports the library of the tree on its PYTHONPATH
  import _common

import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
N_SWEEP = (0, 1, 2, 4, 8)


def cases(quick: bool) -> list[dict]:
  temps = (1.0,) if quick else (0.0, 1.0)
  out = []
  for t in temps:
    out.append(dict(name=f"vanilla T={t}", kind="vanilla", temperature=t, shared=True))
    for b in ((32,) if quick else (32, 64)):
      out.append(dict(name=f"heads b={b} T={t}", kind="heads", temperature=t, budget=b,
                      max_nodes=16, buckets=(1.0, 0.5, 0.25, 0.125), shared=True))
  for n in ((0, 2) if quick else N_SWEEP):
    out.append(dict(name=f"one bucket N={n} T=1.0", kind="heads", temperature=1.0, budget=None,
                    n=n, buckets=(1.0,), shared=True))
  for t in ((1.0,) if quick else (0.0, 0.7, 1.0)):
    if t == 0.7:
      out.append(dict(name=f"vanilla T={t}", kind="vanilla", temperature=t, shared=False))
    for kind in ("lookup", "merged"):
      out.append(dict(name=f"{kind} b=64 T={t}", kind=kind, temperature=t, budget=64,
                      max_nodes=16, buckets=(1.0, 0.5, 0.25, 0.125), shared=False))
  return out


# ------------------------------------------------------------------------------------- worker


def worker(job: dict) -> dict:
  """Run ``job["cases"]`` with the library on sys.path; returns timings per case."""
  import jax

  from specroll_jax import models, rollout
  from specroll_jax.heads import medusa as H
  from specroll_jax.models.tokenizer import Tokenizer
  config, params = models.load_pretrained(job["model"])
  tok = Tokenizer.from_pretrained(job["model"])
  hd = H.load(job["heads"])
  batch = [list(p) for p in job["prompts"]]
  results = {}
  for case in job["cases"]:
    cfg = rollout.SamplingConfig(temperature=case["temperature"])
    kw = dict(sampling=cfg, max_new_tokens=job["max_new_tokens"], seed=job["seed"],
              sample_ids=np.asarray(job["sample_ids"]), eos_ids=tok.eos_ids)
    if case["kind"] != "vanilla":
      n_rows = len(batch)
      if case.get("n") is not None:
        spec = rollout.SpecConfig(node_budget=case["n"] * n_rows, max_nodes=case["n"],
                                  bucket_fractions=tuple(case["buckets"]))
      else:
        spec = rollout.SpecConfig(node_budget=case["budget"], max_nodes=case["max_nodes"],
                                  bucket_fractions=tuple(case["buckets"]))
      if case["kind"] == "heads" and not hasattr(rollout, "Speculation"):  # a REF before it
        kw.update(spec=spec, heads=hd)
      elif case["kind"] == "heads":
        from specroll_jax.proposers import HeadsProposer
        kw.update(speculation=rollout.Speculation(HeadsProposer(num_heads=hd.num_heads), hd, spec))
      else:  # new version only
        from specroll_jax.proposers import Merged, PromptLookup
        prop = PromptLookup() if case["kind"] == "lookup" else Merged()
        pp = () if case["kind"] == "lookup" else prop.params(hd)
        kw.update(speculation=rollout.Speculation(prop, pp, spec))
    run = lambda kw=kw: rollout.generate(config, params, batch, **kw)
    t0 = time.perf_counter()
    out = run()
    jax.block_until_ready(out.tokens)
    first = time.perf_counter() - t0
    times = []
    for _ in range(job["repeats"]):
      t0 = time.perf_counter()
      out = run()
      jax.block_until_ready(out.tokens)
      times.append(time.perf_counter() - t0)
    st = out.stats
    sec = float(np.median(times))
    res = {"seconds": sec, "compile_seconds": first - sec,
           "forwards": st.forwards, "tau": st.tokens_per_forward,
           "tokens": int(st.tokens), "head_acceptance": np.asarray(st.head_acceptance).tolist(),
           "token_hash": int(np.asarray(out.tokens, np.int64).sum() * 7919
                             + np.asarray(out.lengths, np.int64).sum())}
    spec_stats = getattr(st, "spec", None)
    if spec_stats is not None and jax.tree.leaves(spec_stats.proposer):
      from specroll_jax.proposers.base import stats_dict
      res["proposer"] = {k: np.asarray(v).tolist() for k, v in
                         stats_dict(spec_stats.proposer).items()}
    results[case["name"]] = res
  return results


# ------------------------------------------------------------------------------------- parent


def _run_worker(tree: Path, job: dict, tmp: Path, tag: str) -> dict:
  jf, rf = tmp / f"job-{tag}.json", tmp / f"res-{tag}.json"
  jf.write_text(json.dumps(job))
  env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(jf),
                         str(rf)], env=env, cwd=str(tree), capture_output=True, text=True)
  if proc.returncode != 0:
    raise RuntimeError(f"worker for {tree} failed:\n{proc.stderr[-3000:]}")
  return json.loads(rf.read_text())


def main(argv=None):
  from app import cli, pipeline
  from specroll_jax.heads import medusa as H
  ap = cli.ArgumentParser(description=__doc__)
  _common.add_shared_flags(ap, out="runs/bench_engine.json")
  ap.add_argument("--compare-to", default=None, help="git ref of the 'before' version")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                  help="run only the cases whose name contains one of these (e.g. 'one bucket')")
  ap.add_argument("--quick", action="store_true", help="2 prompts x 4, 48 tokens, few cases")
  a = ap.parse_args(argv)
  _common.check_shared_flags(a, rounds=1, repeats=1)
  if a.quick:
    a.prompts, a.group, a.max_new_tokens, a.rounds, a.repeats = 2, 4, 48, 1, 1
  if a.compare_to is not None:
    ok = subprocess.run(["git", "rev-parse", "--verify", a.compare_to + "^{commit}"], cwd=ROOT,
                        capture_output=True)
    if ok.returncode != 0:
      cli.fail("--compare-to", a.compare_to, "is not a commit of this repository")
  try:
    config, params, tok, path = pipeline.load_model(a.model)
  except ValueError as e:
    cli.fail("--model", a.model, str(e))
  hd = pipeline.default_heads(config, params, tok, path)
  ids, _ = pipeline.prompts(tok, "test", a.prompts)
  batch, sids = pipeline.grpo_batch(ids, a.group)
  out_path = Path(a.out)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  all_cases = [c for c in cases(a.quick)
               if a.only is None or any(t in c["name"] for t in a.only)]
  if not all_cases:
    cli.fail("--only", a.only, "matches no case")
  with tempfile.TemporaryDirectory() as td:
    tmp = Path(td)
    heads_file = tmp / "heads.safetensors"
    H.save(heads_file, hd)
    job = dict(model=str(path), heads=str(heads_file), prompts=batch, sample_ids=sids.tolist(),
               max_new_tokens=a.max_new_tokens, seed=a.seed, repeats=a.repeats)
    trees = {"new": ROOT}
    if a.compare_to:
      old = tmp / "old"
      subprocess.run(["git", "worktree", "add", "--detach", str(old), a.compare_to], cwd=ROOT,
                     check=True, capture_output=True)
      trees = {"old": old, "new": ROOT}
    try:
      rounds = {k: [] for k in trees}
      for i in range(a.rounds):
        for name in (list(trees) if i % 2 == 0 else list(trees)[::-1]):
          cs = [c for c in all_cases if name == "new" or c["shared"]]
          print(f"round {i + 1}/{a.rounds}: {name} ({len(cs)} cases)", flush=True)
          rounds[name].append(_run_worker(trees[name], {**job, "cases": cs}, tmp, f"{name}{i}"))
    finally:
      if a.compare_to:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT,
                       capture_output=True)
  merged = {name: _median_over_rounds(rs) for name, rs in rounds.items()}
  meta = {"command": "experiments/bench_engine.py " + " ".join(argv or sys.argv[1:]),
          "cpu": _common.cpu_model(), "machine": platform.machine(), "model": str(path),
          "rows": len(batch), "max_new_tokens": a.max_new_tokens, "rounds": a.rounds,
          "repeats": a.repeats, "compare_to": a.compare_to}
  out_path.write_text(json.dumps({"meta": meta, "results": merged}, indent=2))
  _report(merged, meta)
  _plot(merged, out_path.with_suffix(".png"))
  print(f"wrote {out_path} and {out_path.with_suffix('.png')}")
  return merged


def _median_over_rounds(rs: list[dict]) -> dict:
  out = {}
  for name in rs[0]:
    vals = [r[name] for r in rs]
    m = dict(vals[-1])
    for key in ("seconds", "compile_seconds"):
      m[key] = float(np.median([v[key] for v in vals]))
    m["identical_across_rounds"] = len({v["token_hash"] for v in vals}) == 1
    out[name] = m
  return out


def _report(res: dict, meta: dict) -> None:
  from rich.console import Console
  from rich.table import Table
  new, old = res["new"], res.get("old")
  con = Console(width=180)
  t = Table(title=f"engine cases ({meta['rows']} rows, {meta['max_new_tokens']} new tokens; "
                  f"{meta['cpu']})")
  for c in ("case", "tau", "ms/fwd new", "ms/fwd old", "new/old", "tau old", "same tokens",
            "vs vanilla", "compile new s", "compile old s"):
    t.add_column(c)
  for name, r in new.items():
    temp = name.rsplit("T=", 1)[1]
    van = new.get(f"vanilla T={temp}")
    ms = 1e3 * r["seconds"] / r["forwards"]
    row = [name, f"{r['tau']:.3f}", f"{ms:.2f}"]
    o = old.get(name) if old else None
    if o:
      ms_o = 1e3 * o["seconds"] / o["forwards"]
      row += [f"{ms_o:.2f}", f"{ms / ms_o:.3f}", f"{o['tau']:.3f}",
              str(o["token_hash"] == r["token_hash"])]
    else:
      row += ["-", "-", "-", "-"]
    row.append(f"{van['seconds'] / r['seconds']:.2f}x" if van else "-")
    row += [f"{r['compile_seconds']:.1f}", f"{o['compile_seconds']:.1f}" if o else "-"]
    t.add_row(*row)
  con.print(t)
  t2 = Table(title="cost of a verify forward at N nodes per row, relative to a vanilla forward "
                   "(T = 1, one bucket)")
  for c in ("N", "new", "old"):
    t2.add_column(c)
  for n in N_SWEEP:
    key = f"one bucket N={n} T=1.0"
    if key not in new:
      continue
    rel = lambda d, key=key: (d[key]["seconds"] / d[key]["forwards"]) / (
        d["vanilla T=1.0"]["seconds"] / d["vanilla T=1.0"]["forwards"])
    t2.add_row(str(n), f"{rel(new):.3f}", f"{rel(old):.3f}" if old and key in old else "-")
  con.print(t2)


def _plot(res: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, d in res.items():
    ns = [n for n in N_SWEEP if f"one bucket N={n} T=1.0" in d]
    if not ns or "vanilla T=1.0" not in d:
      continue
    van = d["vanilla T=1.0"]["seconds"] / d["vanilla T=1.0"]["forwards"]
    rel = [d[f"one bucket N={n} T=1.0"]["seconds"] / d[f"one bucket N={n} T=1.0"]["forwards"]
           / van for n in ns]
    ax.plot(ns, rel, "o-", label=name)
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.set_xlabel("tree nodes per row (N)")
  ax.set_ylabel("verify forward / vanilla forward")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  if "--worker" in sys.argv:
    job_file, res_file = sys.argv[sys.argv.index("--worker") + 1:][:2]
    Path(res_file).write_text(json.dumps(worker(json.loads(Path(job_file).read_text()))))
  else:
    main()
