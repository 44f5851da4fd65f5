"""Benchmark the Pallas kernels against their XLA (jitted jnp) counterparts.

  tree attention: ``tree_attention`` vs ``tree_attention_reference`` (jitted), Qwen2.5-1.5B and 7B
    layouts, achieved KV-read bandwidth against a measured device-to-device copy roofline; verify
    steps (T = N + 1 over a cache of L) and, with ``--prefill-lengths``, prefill (L = 0, causal);
    one row per ``--splits`` value (``num_splits``: "auto", the kernel's own choice, or a count;
    each row records the count that ran, ``splits_run``);
  fused sampler: ``fused_sample`` vs unembed (bf16 matmul, f32 out) + the same Gumbel-max in XLA,
    for each ``--layouts`` entry ("dv": unembed [D, V]; "vd": a tied [V, D] embedding table).

Timing is device-side: after warm-up, each repetition enqueues ``--inner`` calls back to back and
blocks once (so host dispatch overlaps device work); the median over ``--reps`` repetitions,
divided by ``--inner``, is reported. Results go to a table on stdout and to JSON (``--out``),
rewritten after every row so a run cut short keeps what it measured.

  python experiments/bench_kernels.py --out bench.json             # GPU (H200): full grid, bf16
  python experiments/bench_kernels.py --quick --out /tmp/q.json    # CPU smoke check, interpret mode
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from app import cli
from pallas_kernels import counter_hash as ch
from pallas_kernels import fused_sampler as fs
from pallas_kernels import tree_attention as ta

# name -> (H, Hkv, Dh, D): Qwen2.5 layouts
MODELS = {"qwen2.5-1.5b": (12, 2, 128, 1536), "qwen2.5-7b": (28, 4, 128, 3584)}
VOCAB = 151936


def parse_split(value: str) -> int | None:
  """'auto' -> None (the kernel's choice); otherwise a count in [1, ta.MAX_NUM_SPLITS]."""
  if value == "auto":
    return None
  try:
    n = int(value)
  except ValueError:
    n = 0
  if not 1 <= n <= ta.MAX_NUM_SPLITS:
    raise argparse.ArgumentTypeError(f"'auto' or an int in [1, {ta.MAX_NUM_SPLITS}], got "
                                     f"{value!r}")
  return n


def parse_args(argv=None):
  p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--out", type=Path, default=Path("bench_kernels.json"), help="JSON results path")
  p.add_argument("--quick", action="store_true",
                 help="tiny shapes, interpret mode on CPU (smoke check, < 60 s)")
  p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
  p.add_argument("--lengths", nargs="+", type=int, default=[512, 4096], help="cache lengths L")
  p.add_argument("--tree-sizes", nargs="+", type=int, default=[1, 4, 8, 16], help="T = N + 1")
  p.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 256], help="B")
  p.add_argument("--prefill-lengths", nargs="*", type=int, default=[],
                 help="prompt lengths T for prefill rows (L = 0, causal mask), B = --prefill-batch")
  p.add_argument("--prefill-batch", type=int, default=8)
  p.add_argument("--splits", nargs="+", type=parse_split, default=[None], metavar="auto|N",
                 help="tree attention num_splits, one row each: 'auto' (default) or a count")
  p.add_argument("--layouts", nargs="+", default=["dv", "vd"], choices=list(fs.LAYOUTS),
                 help="unembedding layouts for the sampler rows")
  p.add_argument("--rows", nargs="+", type=int, default=[16, 256], help="sampler rows R")
  p.add_argument("--temperatures", nargs="+", type=float, default=[1.0])
  p.add_argument("--skip-attention", action="store_true")
  p.add_argument("--skip-sampler", action="store_true")
  p.add_argument("--reps", type=int, default=30)
  p.add_argument("--inner", type=int, default=5)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--copy-mib", type=int, default=2048, help="array size for the copy roofline")
  p.add_argument("--mem-fraction", type=float, default=0.5,
                 help="skip configs whose estimated footprint exceeds this share of device memory")
  p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                 help="default: bfloat16 on GPU/TPU, float32 on CPU")
  args = p.parse_args(argv)
  cli.require(args, lengths=1, tree_sizes=1, batches=1, prefill_lengths=1, prefill_batch=1,
              rows=1, temperatures=0.0, reps=1, inner=1, warmup=0, copy_mib=1, mem_fraction=0.0)
  return args


def device_time(fn, *args, warmup: int, reps: int, inner: int) -> float:
  """Median seconds per call (device-side: `inner` back-to-back calls per blocking sync)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / inner)
  return statistics.median(times)


def device_memory_bytes() -> int:
  stats = jax.devices()[0].memory_stats() or {}
  return int(stats.get("bytes_limit", 8 << 30))


def copy_roofline(mib: int, dtype, timing) -> float:
  """Achieved bytes/s (read + write) of an XLA elementwise copy of a `mib` MiB array."""
  n = (mib << 20) // jnp.dtype(dtype).itemsize
  x = jnp.ones((n,), dtype)
  f = jax.jit(lambda a: a + jnp.asarray(1, dtype))
  t = device_time(f, x, **timing)
  del x
  return 2 * n * jnp.dtype(dtype).itemsize / t


def attention_inputs(rng, b, t, h, hkv, dh, lc, dtype):
  normal = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)
  mask = np.tril(np.ones((t, t), bool))  # a chain / causal prompt; a verify step's cost does not
  # depend on the tree shape (a prefill's does: fully masked key blocks are skipped)
  return (normal(b, t, h, dh), normal(b, lc, hkv, dh), normal(b, lc, hkv, dh),
          jnp.full((b,), lc, jnp.int32), normal(b, t, hkv, dh), normal(b, t, hkv, dh),
          jnp.asarray(np.broadcast_to(mask, (b, t, t))))


def attention_grid(args):
  """(kind, B, L, T) rows: verify steps over the cache, then prefills (L = 0)."""
  rows = [("verify", b, lc, t) for lc in args.lengths for t in args.tree_sizes
          for b in args.batches]
  return rows + [("prefill", args.prefill_batch, 0, t) for t in args.prefill_lengths]


def attention_kernel(interpret, num_splits=None, block_l=None):
  """The jitted kernel call the benchmark times (``num_splits`` None: the kernel's choice)."""
  bs = ta.BlockSizes(block_l=block_l)
  return jax.jit(lambda *a: ta.tree_attention(*a, interpret=interpret, block_sizes=bs,
                                              num_splits=num_splits))


def time_kernel(kern, inp, ref_out, kv_bytes, copy_bw, timing) -> dict:
  """One kernel's figures: error vs ``ref_out``, device time, KV bandwidth, % of the roofline."""
  err = float(jnp.max(jnp.abs(kern(*inp).astype(jnp.float32) - ref_out.astype(jnp.float32))))
  tk = device_time(kern, *inp, **timing)
  return dict(max_abs_err=err, kernel_us=tk * 1e6, kv_gbps=kv_bytes / tk / 1e9,
              pct_copy_bw=100 * kv_bytes / tk / copy_bw)


def split_sweep(b, lc, tree_sizes, heads, configs, dtype, interpret, timing, copy_bw, seed=0):
  """Tree attention at B rows over a full cache of L, per T in ``tree_sizes`` and per
  (num_splits, block_l) in ``configs`` (None: the default), against the unsplit kernel
  (num_splits = 1, timed first): kernel time, % of the copy roofline, the split count that ran
  and the speedup over the unsplit call. ``heads`` = (H, Hkv, Dh)."""
  h, hkv, dh = heads
  ref = jax.jit(ta.tree_attention_reference)
  rng = np.random.default_rng(seed)
  kv_bytes = lambda t: 2 * b * (lc + t) * hkv * dh * jnp.dtype(dtype).itemsize
  rows = []
  for t in tree_sizes:
    inp = attention_inputs(rng, b, t, h, hkv, dh, lc, dtype)
    ref_out = ref(*inp)
    base = None
    for n, block_l in [(1, None)] + [c for c in configs if c != (1, None)]:
      row = dict(B=b, L=lc, T=t, H=h, Hkv=hkv, Dh=dh, num_splits="auto" if n is None else n,
                 block_l=block_l or "default")
      try:
        row["splits_run"] = ta.num_splits_for(inp[0].shape, inp[1].shape, dtype,
                                              block_sizes=ta.BlockSizes(block_l=block_l),
                                              num_splits=n)
        row.update(time_kernel(attention_kernel(interpret, n, block_l), inp, ref_out,
                               kv_bytes(t), copy_bw, timing))
        if (n, block_l) == (1, None):
          base = row["kernel_us"]
        if base is not None:
          row["speedup_vs_unsplit"] = base / row["kernel_us"]
      except Exception as e:  # one config failing (e.g. compile) must not end the sweep
        row["error"] = f"{type(e).__name__}: {e}"[:500]
      rows.append(row)
    del inp, ref_out
  return rows


def bench_attention(args, dtype, interpret, timing, copy_bw, mem_limit, emit):
  ref = jax.jit(ta.tree_attention_reference)
  item = jnp.dtype(dtype).itemsize
  rng = np.random.default_rng(0)
  for model in args.models:
    h, hkv, dh, _ = MODELS[model]
    if args.quick:
      h, hkv, dh = 4, 2, 64
    for kind, b, lc, t in attention_grid(args):
      base = dict(bench="tree_attention", kind=kind, model=model, B=b, L=lc, T=t, H=h, Hkv=hkv,
                  Dh=dh, dtype=jnp.dtype(dtype).name)
      kv_bytes = 2 * b * (lc + t) * hkv * dh * item
      # inputs + the reference's f32 scores / probabilities [B, H, T, L + T] (x3 live)
      foot = kv_bytes + 3 * 4 * b * h * t * (lc + t) + 4 * b * t * h * dh * item
      if foot > args.mem_fraction * mem_limit:
        emit(dict(base, skipped=f"footprint {foot / 2**30:.1f} GiB"))
        continue
      inp = out_r = tr = None
      for n in args.splits:
        row = dict(base, splits="auto" if n is None else n)
        try:
          if inp is None:
            inp = attention_inputs(rng, b, t, h, hkv, dh, lc, dtype)
            out_r = ref(*inp)
            tr = device_time(ref, *inp, **timing)
          row["splits_run"] = ta.num_splits_for(inp[0].shape, inp[1].shape, dtype,
                                                num_splits=n)
          row.update(time_kernel(attention_kernel(interpret, n), inp, out_r, kv_bytes,
                                 copy_bw, timing))
          row.update(xla_us=tr * 1e6, speedup=tr * 1e6 / row["kernel_us"],
                     xla_kv_gbps=kv_bytes / tr / 1e9)
        except Exception as e:  # one config failing (e.g. compile) must not end the sweep
          row["error"] = f"{type(e).__name__}: {e}"[:500]
          traceback.print_exc(file=sys.stderr)
        emit(row)
      del inp, out_r


def xla_sample(hidden, unembed, seed, sids, pos, *, temperature, layout):
  """The unfused XLA path: bf16 unembed matmul with f32 logits out, then Gumbel-max with the same
  counter-based noise and tempering (``counter_hash``) as the kernel and the engine's sampler."""
  dims = (((1,), (0,) if layout == "dv" else (1,)), ((), ()))
  x = lax.dot_general(hidden, unembed, dims, preferred_element_type=jnp.float32)
  z = x
  if temperature > 0:
    x = x * ch.inverse_temperature(temperature)
    key = ch.row_key(seed, sids, pos)[:, None]
    z = x + ch.gumbel_from_bits(ch.token_bits(key, jnp.arange(x.shape[-1], dtype=jnp.uint32)))
  tok = jnp.argmax(z, axis=-1).astype(jnp.int32)
  lp = jnp.take_along_axis(x, tok[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(x, axis=-1)
  return tok, lp


def bench_sampler(args, dtype, interpret, timing, copy_bw, mem_limit, emit):
  item = jnp.dtype(dtype).itemsize
  rng = np.random.default_rng(1)
  d_models = sorted({MODELS[m][3] for m in args.models})
  vocab = VOCAB
  if args.quick:
    d_models, vocab = [64], 1000
  for d in d_models:
    for r in args.rows:
      for temp in args.temperatures:
        for layout in args.layouts:
          row = dict(bench="fused_sampler", D=d, V=vocab, R=r, temperature=temp, layout=layout,
                     dtype=jnp.dtype(dtype).name)
          w_bytes = d * vocab * item
          foot = w_bytes + 3 * 4 * r * vocab
          if foot > args.mem_fraction * mem_limit:
            row["skipped"] = f"footprint {foot / 2**30:.1f} GiB"
            emit(row)
            continue
          try:
            hidden = jnp.asarray(rng.standard_normal((r, d), np.float32), dtype)
            shape = (d, vocab) if layout == "dv" else (vocab, d)
            unembed = jnp.asarray(rng.standard_normal(shape, np.float32) * d ** -0.5, dtype)
            sids = jnp.arange(r, dtype=jnp.int32)
            pos = jnp.full((r,), 100, jnp.int32)
            seed = jnp.uint32(1234)
            kern = jax.jit(lambda *a, t=temp, lay=layout: fs.fused_sample(
                *a, temperature=t, interpret=interpret, unembed_layout=lay))
            xla = jax.jit(lambda *a, t=temp, lay=layout: xla_sample(*a, temperature=t,
                                                                    layout=lay))
            inp = (hidden, unembed, seed, sids, pos)
            tok_k, lp_k = kern(*inp)
            tok_x, lp_x = xla(*inp)
            same = np.asarray(tok_k) == np.asarray(tok_x)
            row["token_agreement"] = float(same.mean())  # bf16 logits: near-ties may flip a few
            row["max_logprob_diff_agreeing"] = float(
                np.max(np.abs(np.asarray(lp_k) - np.asarray(lp_x))[same], initial=0.0))
            tk = device_time(kern, *inp, **timing)
            tx = device_time(xla, *inp, **timing)
            row.update(kernel_us=tk * 1e6, xla_us=tx * 1e6, speedup=tx / tk,
                       unembed_gbps=w_bytes / tk / 1e9, pct_copy_bw=100 * w_bytes / tk / copy_bw)
            del hidden, unembed, inp
          except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc(file=sys.stderr)
          emit(row)


def print_table(rows, meta):
  cols = {
      "tree_attention": ["kind", "model", "B", "L", "T", "splits", "splits_run", "kernel_us",
                         "xla_us", "speedup", "kv_gbps", "pct_copy_bw", "max_abs_err"],
      "fused_sampler": ["D", "V", "R", "temperature", "layout", "kernel_us", "xla_us", "speedup",
                        "unembed_gbps", "pct_copy_bw", "token_agreement"],
  }
  fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
  try:
    from rich.console import Console
    from rich.table import Table
  except ImportError:  # plain fallback
    Console = None
  for bench, names in cols.items():
    sel = [r for r in rows if r["bench"] == bench]
    if not sel:
      continue
    title = (f"{bench} on {meta['device']} ({meta['dtype']}); copy roofline "
             f"{meta['copy_gbps']:.0f} GB/s")
    cells = [[fmt(r[n]) if n in r else r.get("skipped") or r.get("error", "")[:40] if
              n == "kernel_us" else "" for n in names] for r in sel]
    if Console is not None:
      table = Table(title=title)
      for n in names:
        table.add_column(n, justify="right")
      for c in cells:
        table.add_row(*c)
      Console(width=200).print(table)
    else:
      print(title)
      print(" | ".join(names))
      for c in cells:
        print(" | ".join(c))


def main(argv=None):
  args = parse_args(argv)
  backend = jax.default_backend()
  interpret = backend == "cpu"
  if args.quick:
    args.models, args.lengths, args.tree_sizes, args.batches = args.models[:1], [40], [1, 4], [1, 2]
    args.prefill_lengths, args.prefill_batch = [24], 2
    args.rows, args.temperatures = [8], [0.0, 1.0]
    args.reps, args.inner, args.warmup = 3, 1, 1
    args.copy_mib = min(args.copy_mib, 16)
  elif interpret:
    print("warning: no GPU/TPU; running the kernels in interpret mode (slow, not a benchmark)",
          file=sys.stderr)
  dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
  timing = dict(warmup=args.warmup, reps=args.reps, inner=args.inner)
  mem_limit = device_memory_bytes()
  copy_bw = copy_roofline(args.copy_mib, dtype, timing)
  meta = dict(device=str(jax.devices()[0].device_kind), backend=backend, jax=jax.__version__,
              dtype=dtype.name, interpret=interpret, copy_gbps=copy_bw / 1e9,
              mem_limit_gib=mem_limit / 2**30, timing=timing, quick=args.quick)
  print(f"{meta['device']}: copy roofline {copy_bw / 1e9:.0f} GB/s", file=sys.stderr)
  rows = []
  args.out.parent.mkdir(parents=True, exist_ok=True)

  def emit(row):
    rows.append(row)
    print(json.dumps(row), file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))

  if not args.skip_attention:
    bench_attention(args, dtype, interpret, timing, copy_bw, mem_limit, emit)
  if not args.skip_sampler:
    bench_sampler(args, dtype, interpret, timing, copy_bw, mem_limit, emit)
  args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
  print_table(rows, meta)
  print(f"wrote {args.out}")
  return rows


if __name__ == "__main__":
  main()
