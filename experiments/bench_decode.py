"""Vanilla decode throughput: our engine (``rollout.generate``) vs transformers' ``generate``.

Both engines run the same random tiny Qwen2 weights in one process, one after the other (never
concurrently): the weights are created with transformers (every tensor perturbed, so biases and
norms are not trivial), written with HF's ``save_pretrained`` and read back with our
``load_pretrained``. Prompts are random token ids of one length (HF needs no padding); decoding is
greedy with no EOS, so every row runs exactly ``--max-new`` tokens. Our engine also runs at T = 1.

Timing: wall-clock of the whole call (prefill + decode; ``jax.block_until_ready`` on ours), after
one warm-up call per engine and shape (our first call includes the JAX compile, reported
separately as first-call time minus the steady median). The ``--repeats`` timed calls are
interleaved across engines (order rotated each repeat, ``--gap`` seconds of sleep before each call
so one engine's spinning idle worker threads do not slow the next) so a load spike from other
processes hits all of them alike; the median is reported. tokens/s = batch * max_new / time;
ms/step = time / max_new. The load average is recorded before each batch.

HF threads: HF runs with ``torch.set_num_threads(nproc)`` and, by default, also with 1 thread; the
table reports the faster. On this 2-core machine, when other processes keep the cores busy, torch's
OpenMP with 2 threads collapses (every parallel region waits on a descheduled worker: measured
500 ms/step at batch 8 vs 4 ms/step with 1 thread), which would inflate our ratio unfairly.

Token agreement: the fraction of generated tokens where HF's greedy output equals ours. After a
row's first disagreement the two continuations differ, so the script also teacher-forces HF's
sequence through our model at each row's first disagreement and reports the logit margin between
the two candidates there: a near-tie (margin ~1e-5, f32 rounding) is benign, a large one a bug.

  .venv/bin/python experiments/bench_decode.py                  # full: batches 1 8 32 128, 64 new
  .venv/bin/python experiments/bench_decode.py --quick --out /tmp/bd.json   # smoke test
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from app import cli  # noqa: E402
from specroll_jax.models import forward, load_pretrained  # noqa: E402
from specroll_jax.rollout import SamplingConfig, generate  # noqa: E402

TARGETS = {1: 3.0, 32: 1.2}  # issue: ours / HF tokens/s at these batch sizes


def parse_args(argv=None):
  p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--out", type=Path, default=Path("runs/bench_decode.json"),
                 help="JSON results path (the PNG plot goes next to it, same stem)")
  p.add_argument("--quick", action="store_true", help="smoke test: batches 1 8, 16 new tokens")
  p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128])
  p.add_argument("--max-new", type=int, default=64, help="new tokens per row (no EOS)")
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3, help="timed calls per engine and batch (median)")
  p.add_argument("--gap", type=float, default=0.2,
                 help="seconds of sleep before every timed call, so one engine's idle worker\n"
                      "threads (OpenMP spin-wait) do not steal cores from the next call")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"],
                 help="transformers attention implementation")
  p.add_argument("--hf-threads", nargs="+", type=int, default=None,
                 help="torch intra-op thread counts to time HF with (default: nproc and 1); the\n"
                      "table's HF column is the fastest of them (see the module docstring)")
  p.add_argument("--skip-t1", action="store_true", help="skip our T=1 runs")
  # model (defaults: 4 layers, d=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--intermediate", type=int, default=768)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--vocab", type=int, default=2048)
  args = p.parse_args(argv)
  cli.require(args, batches=1, max_new=1, prompt_len=1, repeats=1, gap=0.0, seed=0, hf_threads=1,
              layers=1, hidden=1, intermediate=1, heads=1, kv_heads=1, head_dim=1, vocab=2)
  if args.hf_threads is None:
    args.hf_threads = list(dict.fromkeys([os.cpu_count(), 1]))
  if args.quick:
    args.batches, args.max_new = [1, 8], 16
  return args


# ---------------------------------------------------------------------------------------------
# Model: built once with transformers, loaded by both engines


def build_models(args, workdir: Path):
  """(hf_model, our_config, our_params) holding identical float32 weights."""
  hf_cfg = transformers.Qwen2Config(
      vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
      num_hidden_layers=args.layers, num_attention_heads=args.heads,
      num_key_value_heads=args.kv_heads, head_dim=args.head_dim, rope_theta=10000.0,
      rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=1024,
      bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation=args.hf_attn)
  torch.manual_seed(args.seed)
  model = transformers.Qwen2ForCausalLM(hf_cfg).to(torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():  # fresh HF init: zero biases, unit norms
      scale = 0.3 if name.endswith("bias") or "norm" in name else 0.1
      p.add_(scale * torch.randn_like(p))
  model.save_pretrained(workdir)
  config, params = load_pretrained(workdir)
  gc = model.generation_config
  gc.eos_token_id = gc.bos_token_id = gc.pad_token_id = None
  return model, config, params


# ---------------------------------------------------------------------------------------------
# Engines


def hf_generate(model, prompts: np.ndarray, max_new: int, threads: int) -> np.ndarray:
  torch.set_num_threads(threads)
  ids = torch.from_numpy(prompts.astype(np.int64))
  with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=0)
  return out[:, prompts.shape[1]:].numpy()


def ours_generate(config, params, prompts: np.ndarray, max_new: int, temperature: float, seed):
  r = generate(config, params, prompts, sampling=SamplingConfig(temperature=temperature),
               max_new_tokens=max_new, seed=seed, eos_ids=[])
  jax.block_until_ready((r.tokens, r.lengths, r.logprobs))
  return r


def timed(fn):
  t0 = time.perf_counter()
  out = fn()
  return time.perf_counter() - t0, out


_jit_forward = jax.jit(forward, static_argnums=0)


def agreement(config, params, prompts, hf_tok, our_tok):
  """Token identity stats and, at each disagreeing row's first difference, our logit margin
  between our token and HF's (teacher-forced on the shared prefix)."""
  same = hf_tok == our_tok
  b, m = same.shape
  first = np.where(same.all(1), m, np.argmin(same, axis=1))
  margins = []
  for i in np.flatnonzero(first < m):
    j = int(first[i])
    seq = np.concatenate([prompts[i], hf_tok[i, :j]])[None].astype(np.int32)
    logits = np.asarray(_jit_forward(config, params, jnp.asarray(seq)))[0, -1]
    margins.append(float(logits[our_tok[i, j]] - logits[hf_tok[i, j]]))
  return {
      "token_agreement": float(same.mean()),
      "rows_identical": int(same.all(1).sum()),
      "rows": int(b),
      "first_divergence": [int(x) for x in first if x < m],
      "divergence_margins": margins,  # our logit(our token) - our logit(HF token); ~0 = near-tie
  }


# ---------------------------------------------------------------------------------------------
# Reporting


def print_table(rows, args):
  cols = ["batch", "HF tok/s", "HF threads", "ours greedy tok/s", "ratio", "ours T=1 tok/s",
          "HF ms/step", "ours ms/step", "token agreement"]
  cells = []
  for r in rows:
    t1 = r.get("ours_t1_tok_s")
    cells.append([
        str(r["batch"]), f"{r['hf_tok_s']:.0f}", str(r["hf_best_threads"]),
        f"{r['ours_tok_s']:.0f}", f"{r['ratio']:.2f}x",
        "-" if t1 is None else f"{t1:.0f}", f"{r['hf_ms_step']:.2f}", f"{r['ours_ms_step']:.2f}",
        f"{r['token_agreement']:.4f} ({r['rows_identical']}/{r['rows']} rows)"])
  title = (f"Vanilla decode vs transformers generate: prompt {args.prompt_len}, "
           f"{args.max_new} new tokens, median of {args.repeats}; HF = fastest of torch threads "
           f"{args.hf_threads}")
  try:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title)
    for c in cols:
      t.add_column(c, justify="right")
    for c in cells:
      t.add_row(*c)
    Console(width=160).print(t)
  except ImportError:
    print(title)
    w = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print(" | ".join(c.rjust(w[i]) for i, c in enumerate(cols)))
    for x in cells:
      print(" | ".join(v.rjust(w[i]) for i, v in enumerate(x)))
  sys.stdout.flush()


def markdown_table(rows) -> str:
  lines = ["| batch | HF tok/s (threads) | ours greedy tok/s | ratio | ours T=1 tok/s | "
           "HF ms/step | ours ms/step | token agreement |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    t1 = r.get("ours_t1_tok_s")
    lines.append(
        f"| {r['batch']} | {r['hf_tok_s']:.0f} ({r['hf_best_threads']}) | "
        f"{r['ours_tok_s']:.0f} | {r['ratio']:.2f}x | "
        f"{'-' if t1 is None else f'{t1:.0f}'} | {r['hf_ms_step']:.2f} | {r['ours_ms_step']:.2f} | "
        f"{r['token_agreement']:.4f} |")
  return "\n".join(lines)


def plot(rows, path: Path, title: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  b = [r["batch"] for r in rows]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  ax.plot(b, [r["hf_tok_s"] for r in rows], "o-", label="transformers generate (greedy)")
  ax.plot(b, [r["ours_tok_s"] for r in rows], "s-", label="ours (greedy)")
  if all(r.get("ours_t1_tok_s") for r in rows):
    ax.plot(b, [r["ours_t1_tok_s"] for r in rows], "^--", label="ours (T=1)")
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xticks(b, [str(x) for x in b])
  ax.set_xlabel("batch")
  ax.set_ylabel("tokens / s")
  ax.set_title(title, fontsize=9)
  for r in rows:
    ax.annotate(f"{r['ratio']:.2f}x", (r["batch"], r["ours_tok_s"]), textcoords="offset points",
                xytext=(0, 6), ha="center", fontsize=8)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _git(*cmd) -> str | None:
  import subprocess
  try:
    return subprocess.run(["git", *cmd], cwd=Path(__file__).resolve().parents[1], text=True,
                          capture_output=True, timeout=10, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None


def environment(args):
  dirty = _git("status", "--porcelain", "--untracked-files=no")
  return {
      "git_commit": _git("rev-parse", "--short", "HEAD"),
      "git_modified": dirty.splitlines() if dirty else [],
      "python": platform.python_version(), "jax": jax.__version__, "torch": torch.__version__,
      "transformers": transformers.__version__, "nproc": os.cpu_count(),
      "cpu": platform.processor() or platform.machine(), "jax_backend": jax.default_backend(),
      "torch_threads": torch.get_num_threads(), "hf_attn": args.hf_attn,
      "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
      "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
  }


# ---------------------------------------------------------------------------------------------


def main(argv=None):
  args = parse_args(argv)
  torch.set_num_threads(os.cpu_count())
  args.out.parent.mkdir(parents=True, exist_ok=True)
  png = args.out.with_suffix(".png")
  env = environment(args)
  print(f"env: {env}")
  print(f"load average (1/5/15 min) at start: {os.getloadavg()}")

  with tempfile.TemporaryDirectory() as d:
    hf_model, config, params = build_models(args, Path(d))
  n_params = sum(p.numel() for p in hf_model.parameters())
  print(f"model: {config}\n  {n_params / 1e6:.2f} M parameters")

  rng = np.random.default_rng(args.seed)
  result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "env": env, "model": {"params": n_params, **config.to_hf_dict()}, "rows": []}
  rows = result["rows"]
  for b in args.batches:
    prompts = rng.integers(0, args.vocab, size=(b, args.prompt_len)).astype(np.int32)
    m = args.max_new
    load = os.getloadavg()
    print(f"\n[batch {b}] load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)

    engines = {f"hf@{n}": functools.partial(hf_generate, hf_model, prompts, m, n)
               for n in args.hf_threads}
    engines["ours"] = functools.partial(ours_generate, config, params, prompts, m, 0.0, args.seed)
    if not args.skip_t1:
      engines["ours_t1"] = functools.partial(ours_generate, config, params, prompts, m, 1.0,
                                             args.seed)
    first, outs = {}, {}
    for name, fn in engines.items():  # warm-up (our first call compiles)
      first[name], outs[name] = timed(fn)
      print(f"  warm-up {name}: {first[name]:.3f} s", flush=True)
    hf_names = [f"hf@{n}" for n in args.hf_threads]
    hf_tok = np.asarray(outs[hf_names[0]])
    hf_same = all(np.array_equal(hf_tok, outs[k]) for k in hf_names)
    ours = outs["ours"]
    our_tok = np.asarray(ours.tokens)
    assert hf_tok.shape == (b, m), f"HF returned {hf_tok.shape}, expected {(b, m)}"
    assert (np.asarray(ours.lengths) == m).all(), "our engine stopped a row early"
    times = {name: [] for name in engines}
    names = list(engines)
    for rep in range(args.repeats):  # interleaved, order rotated each repeat
      for name in names[rep % len(names):] + names[: rep % len(names)]:
        time.sleep(args.gap)
        times[name].append(timed(engines[name])[0])
    torch.set_num_threads(os.cpu_count())
    med = {name: statistics.median(ts) for name, ts in times.items()}
    best = min(hf_names, key=med.get)
    med["hf"] = med[best]
    agree = agreement(config, params, prompts, hf_tok, our_tok)
    row = {
        "batch": b, "load_avg": list(load),
        "hf_s": med["hf"], "ours_s": med["ours"], "times": times, "first_call_s": first,
        "ours_compile_s": first["ours"] - med["ours"],
        "hf_tok_s": b * m / med["hf"], "ours_tok_s": b * m / med["ours"],
        "ratio": med["hf"] / med["ours"], "hf_best_threads": int(best.split("@")[1]),
        "hf_tok_s_by_threads": {k.split("@")[1]: b * m / med[k] for k in hf_names},
        "hf_outputs_equal_across_threads": hf_same,
        "hf_ms_step": 1e3 * med["hf"] / m, "ours_ms_step": 1e3 * med["ours"] / m,
        **agree,
    }
    if "ours_t1" in med:
      row.update(ours_t1_s=med["ours_t1"], ours_t1_tok_s=b * m / med["ours_t1"],
                 ours_t1_ms_step=1e3 * med["ours_t1"] / m,
                 ours_t1_compile_s=first["ours_t1"] - med["ours_t1"])
    if b in TARGETS:
      row["target_ratio"] = TARGETS[b]
      row["target_met"] = row["ratio"] >= TARGETS[b]
    rows.append(row)
    mg = agree["divergence_margins"]
    by = ", ".join(f"{k} thr {v:.0f}" for k, v in row["hf_tok_s_by_threads"].items())
    print(f"  HF {row['hf_tok_s']:.0f} tok/s ({by}), ours {row['ours_tok_s']:.0f} tok/s "
          f"({row['ratio']:.2f}x), our compile ~{row['ours_compile_s']:.2f} s; agreement "
          f"{agree['token_agreement']:.4f}, {agree['rows_identical']}/{b} rows identical"
          + (f", max divergence margin {max(mg):.2e}" if mg else ""), flush=True)
    result["load_avg_end"] = list(os.getloadavg())
    args.out.write_text(json.dumps(result, indent=2))  # rewritten per batch: partial runs keep rows

  print()
  print_table(rows, args)
  for r in rows:
    if "target_ratio" in r:
      print(f"target at batch {r['batch']}: >= {r['target_ratio']}x, got {r['ratio']:.2f}x "
            f"({'met' if r['target_met'] else 'NOT met'})")
  print(f"load average at end: {os.getloadavg()}")
  result["markdown_table"] = markdown_table(rows)
  args.out.write_text(json.dumps(result, indent=2))
  plot(rows, png, f"tiny Qwen2 ({args.layers}L d={args.hidden}), prompt {args.prompt_len}, "
       f"{args.max_new} new, {os.cpu_count()} CPU cores")
  print(f"wrote {args.out} and {png}")
  return result


if __name__ == "__main__":
  main()
