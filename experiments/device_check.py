"""One prepared device run (GPU/TPU) that cannot lose its results:

  python3 experiments/device_check.py --out $OUT              # < 9 minutes on an H200
  python3 experiments/device_check.py --interpret --out /tmp/dc   # CPU smoke run (CI), < 1 minute

Cases run one at a time, each in its own try/except: bf16 kernels, the engine, then f32 kernels
(every reference at "highest" matmul precision); ``<out>/device_check.json`` is rewritten after
every case, so a compile error or a cut-off lease keeps everything before it.
1. ``tree_attention`` compiled for the device (no interpret mode) vs its f32 reference on fresh
   random inputs: a verify tree (T = 8), a T = 13 step, a prefill (L = 0, T = 64, ragged prompts),
   decode (T = 1), a long step (T = 512); Qwen2.5 1.5B / 7B head layouts.
2. ``fused_sample`` vs its reference: token agreement and logprob error, the Qwen2.5-1.5B vocab in
   both unembedding layouts ([D, V] and the tied [V, D] table), T in {1.0, 0.7, 0}.
3. The engine with ``kernels="pallas"`` vs ``kernels="reference"`` (vanilla and speculative,
   T = 0 and 1) on a random tiny model in f32: token identity and the logprob gap.
4. ``bench_kernels.py`` in a subprocess (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, a hard timeout
   from the time left); it rewrites ``<out>/bench_kernels.json`` after every row.
Time guard: no case starts after ``--budget-s`` (default 480 s) and the benchmark is stopped by
then, so the script ends cleanly before 9 minutes; skipped cases are listed as skipped.
"""

from __future__ import annotations

import os

# Before jax is imported: this process must not take 75% of the GPU, the benchmark subprocess
# needs it (and on a TPU this is harmless).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import _common  # noqa: E402, F401
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from app import cli  # noqa: E402

DEFAULT_BUDGET_S = 480.0  # last case start / benchmark stop: the whole run ends before 9 minutes
BENCH_MIN_S = 60.0  # do not start the benchmark with less time than this left
F32, BF16 = jnp.float32, jnp.bfloat16
# Output tolerance vs the f32 reference: bf16 operands and a bf16 P for the PV matmul (see
# tests/test_kernels.py); f32 with full-precision dots is exact up to summation order.
ATTN_TOL = {"bfloat16": 3e-2, "float32": 1e-4}


class Report:
  """The JSON report: every case's result (or error, or skip) written as soon as it is known."""

  def __init__(self, path: Path, budget_s: float):
    self.path, self.t0, self.budget_s = path, time.perf_counter(), budget_s
    self.data = {"devices": [str(d) for d in jax.devices()], "backend": jax.default_backend(),
                 "jax": jax.__version__, "budget_s": budget_s, "cases": {}}
    self.write()

  def elapsed(self) -> float:
    return time.perf_counter() - self.t0

  def left(self) -> float:
    return self.budget_s - self.elapsed()

  def write(self):
    self.data["elapsed_s"] = round(self.elapsed(), 2)
    tmp = self.path.with_suffix(".tmp")
    tmp.write_text(json.dumps(self.data, indent=1, default=str))
    tmp.replace(self.path)  # atomic: a kill mid-write leaves the previous complete report

  def run(self, name: str, fn):
    """Run one case unless the time guard says stop; record result / error / skip, then write."""
    if self.left() <= 0:
      entry = {"skipped": f"time guard: {self.elapsed():.0f} s >= budget {self.budget_s:.0f} s"}
    else:
      t = time.perf_counter()
      try:
        entry = {"result": fn()}
      except Exception as e:  # a device lease is short: one failing case must not end the run
        entry = {"error": f"{type(e).__name__}: {e}"[:2000],
                 "traceback": traceback.format_exc()[-3000:]}
      entry["seconds"] = round(time.perf_counter() - t, 2)
    self.data["cases"][name] = entry
    self.write()
    status = "ok" if "result" in entry else "skipped" if "skipped" in entry else "ERROR"
    print(f"[{self.elapsed():6.1f}s] {name}: {status} {json.dumps(entry.get('result'))[:300]}"
          + (f"\n  {entry['error'][:500]}" if "error" in entry else ""), flush=True)
    return entry.get("result")


# ------------------------------------------- kernels ----------------------------------------------

def _ragged_causal(rng, b, t):
  n = rng.integers(1, t + 1, size=b)
  n[0] = t
  valid = np.arange(t)[None, :] < n[:, None]
  return np.tril(np.ones((t, t), bool))[None] & valid[:, None, :] & valid[:, :, None]


def attention_case(b, t, h, hkv, dh, lc, dtype, kind, interpret, seed):
  from pallas_kernels import tree_attention as ta

  def case():
    rng = np.random.default_rng(seed)
    r = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)
    q, kc, vc, kn, vn = (r(b, t, h, dh), r(b, lc, hkv, dh), r(b, lc, hkv, dh), r(b, t, hkv, dh),
                         r(b, t, hkv, dh))
    if kind == "prefill":
      lens = jnp.zeros((b,), jnp.int32)
      mask = _ragged_causal(rng, b, t)
    else:
      lens = jnp.asarray([lc] + rng.integers(0, lc + 1, b - 1).tolist(), jnp.int32)
      mask = np.tril(rng.random((b, t, t)) < 0.6) | np.eye(t, dtype=bool)[None]
    mask = jnp.asarray(mask)
    got = jax.block_until_ready(ta.tree_attention(q, kc, vc, lens, kn, vn, mask,
                                                  interpret=interpret))
    f32 = lambda x: x.astype(F32)
    # The reference at full f32 precision: a GPU's default f32 matmul may run in TF32, which put
    # the reference ~1e-3 off on the first H200 run (f32 kernel "errors" 1.5e-4 - 1.9e-3).
    with jax.default_matmul_precision("highest"):
      ref = ta.tree_attention_reference_jit(f32(q), f32(kc), f32(vc), lens, f32(kn), f32(vn),
                                            mask)
    err = float(jnp.max(jnp.abs(got.astype(F32) - ref)))
    name = jnp.dtype(dtype).name
    return {"shape": dict(B=b, T=t, H=h, Hkv=hkv, Dh=dh, L=lc), "dtype": name, "kind": kind,
            "max_abs_err": err, "tol": ATTN_TOL[name], "ok": err <= ATTN_TOL[name],
            "finite": bool(jnp.isfinite(got).all())}

  return case


def sampler_case(rows, d, v, temp, dtype, layout, interpret, seed):
  from pallas_kernels import fused_sampler as fs

  def case():
    rng = np.random.default_rng(seed)
    hid = jnp.asarray(rng.standard_normal((rows, d), np.float32) / np.sqrt(d), dtype)
    w = jnp.asarray(rng.standard_normal((d, v) if layout == "dv" else (v, d), np.float32), dtype)
    sids = jnp.arange(rows, dtype=jnp.int32)
    pos = jnp.asarray(rng.integers(0, 4000, rows), jnp.int32)
    tok, lp = jax.block_until_ready(fs.fused_sample(hid, w, 123, sids, pos, temperature=temp,
                                                    interpret=interpret, unembed_layout=layout))
    with jax.default_matmul_precision("highest"):
      rtok, rlp = fs.fused_sample_reference(hid.astype(F32), w.astype(F32), np.uint32(123),
                                            sids, pos, temperature=temp, unembed_layout=layout)
    same = np.asarray(tok == rtok)
    gap = np.abs(np.asarray(lp - rlp))[same]
    return {"shape": dict(R=rows, D=d, V=v), "temperature": temp, "layout": layout,
            "dtype": jnp.dtype(dtype).name, "token_agreement": float(same.mean()),
            "max_abs_logprob_err_agreeing": float(gap.max(initial=0.0)),
            "finite": bool(np.isfinite(np.asarray(lp)).all())}

  return case


def kernel_cases(interpret, dtypes=(BF16, F32)):
  """(name, case) in run order, per dtype in ``dtypes``."""
  if interpret:  # tiny shapes, same kinds
    attn = [("verify_T8", (2, 8, 4, 2, 64, 40, "tree")),
            ("step_T13", (1, 13, 4, 2, 64, 20, "tree")),
            ("prefill_L0_T64", (2, 64, 4, 2, 64, 0, "prefill")),
            ("decode_T1", (2, 1, 4, 2, 64, 50, "tree"))]
    samp = [("V300_T1.0_dv", (8, 64, 300, 1.0, "dv")), ("V300_T0.7_vd", (8, 64, 300, 0.7, "vd"))]
  else:
    attn = [("verify_T8_1.5b", (3, 8, 12, 2, 128, 700, "tree")),
            ("step_T13_7b", (2, 13, 28, 4, 128, 1000, "tree")),
            ("prefill_L0_T64_1.5b", (4, 64, 12, 2, 128, 0, "prefill")),
            ("decode_T1_1.5b", (8, 1, 12, 2, 128, 4096, "tree")),
            ("long_T512_7b", (1, 512, 28, 4, 128, 2048, "prefill"))]
    samp = [("V151936_T1.0_dv", (16, 1536, 151936, 1.0, "dv")),
            ("V151936_T0.7_vd", (16, 1536, 151936, 0.7, "vd")),
            ("V32003_T0.7_dv", (37, 896, 32003, 0.7, "dv")),
            ("V5000_T0_dv", (8, 512, 5000, 0.0, "dv"))]
  out = []
  for dtype in dtypes:
    tag = jnp.dtype(dtype).name
    if interpret and dtype == F32:  # the smoke run needs each code path once, not each dtype
      attn, samp = attn[:1], samp[:1]
    for i, (name, (b, t, h, hkv, dh, lc, kind)) in enumerate(attn):
      out.append((f"attention/{tag}/{name}",
                  attention_case(b, t, h, hkv, dh, lc, dtype, kind, interpret, seed=i)))
    for i, (name, (rows, d, v, temp, layout)) in enumerate(samp):
      out.append((f"sampler/{tag}/{name}",
                  sampler_case(rows, d, v, temp, dtype, layout, interpret, seed=100 + i)))
  return out


# ------------------------------------------- engine -----------------------------------------------

def engine_cases(interpret):
  """Reference rollouts once per temperature, then the Pallas engine (vanilla, speculative)."""
  from specroll_jax import models, rollout
  from specroll_jax.heads import medusa as heads
  from specroll_jax.proposers import HeadsProposer

  state = {}

  def setup():
    config = models.ModelConfig.tiny(vocab_size=512, head_dim=64, num_heads=4, num_kv_heads=2,
                                     hidden_size=256, intermediate_size=512)
    params = models.init_params(jax.random.key(0), config)
    hd = heads.init(jax.random.key(1), config, 3, scale=0.05)
    rng = np.random.default_rng(1)
    n = 3 if interpret else 16
    prompts = [rng.integers(0, 512, rng.integers(3, 40)).tolist() for _ in range(n)]
    state.update(config=config, params=params, heads=hd, prompts=prompts)
    return {"prompts": n, "prompt_lengths": [len(p) for p in prompts]}

  def kw(temp):
    return dict(sampling=rollout.SamplingConfig(temperature=temp), seed=5, eos_ids=[],
                max_new_tokens=4 if interpret else 64)

  def reference(temp):
    def case():
      with jax.default_matmul_precision("highest"):
        state[f"ref{temp}"] = rollout.generate(
            state["config"], state["params"], state["prompts"],
            options=rollout.DecodeOptions(kernels="reference"), **kw(temp))
      return {"tokens": int(np.asarray(state[f"ref{temp}"].tokens).size)}
    return case

  def pallas(temp, speculative):
    def case():
      spec = (rollout.SpecConfig(node_budget=16, bucket_fractions=(1.0,)) if interpret
              else rollout.SpecConfig.for_h200())
      hd = state["heads"]  # Medusa heads through the static proposer the kernels' table measured
      speculation = (rollout.Speculation(HeadsProposer(num_heads=hd.num_heads), hd, spec)
                     if speculative else None)
      kernels = "pallas_interpret" if interpret else "pallas"
      with jax.default_matmul_precision("highest"):
        got = rollout.generate(state["config"], state["params"], state["prompts"],
                               speculation=speculation,
                               options=rollout.DecodeOptions(kernels=kernels), **kw(temp))
      ref = state[f"ref{temp}"]
      return {"token_identity": float((np.asarray(got.tokens) == np.asarray(ref.tokens)).mean()),
              "max_logprob_gap": float(np.abs(np.asarray(got.logprobs)
                                              - np.asarray(ref.logprobs)).max())}
    return case

  temps = (1.0,) if interpret else (0.0, 1.0)
  out = [("engine/setup", setup)]
  for temp in temps:
    out.append((f"engine/reference_T{temp}", reference(temp)))
    for spec in (True,) if interpret else (False, True):
      out.append((f"engine/{'speculative' if spec else 'vanilla'}_T{temp}", pallas(temp, spec)))
  return out


# ------------------------------------------- bench ------------------------------------------------

def run_bench(report: Report, out: Path):
  """bench_kernels.py in a subprocess with a hard timeout from the time left; the bench rewrites
  its JSON after every row, so a timeout keeps the rows measured so far."""
  left = report.left()
  if left < BENCH_MIN_S:
    report.data["bench"] = {"skipped": f"time guard: {left:.0f} s left < {BENCH_MIN_S:.0f} s"}
    report.write()
    return
  cmd = [sys.executable, str(Path(__file__).with_name("bench_kernels.py")), "--out",
         str(out / "bench_kernels.json"), "--lengths", "512", "4096", "--tree-sizes", "1", "8",
         "16", "--batches", "1", "64", "256", "--prefill-lengths", "512", "2048", "--rows", "16",
         "256", "--reps", "10", "--inner", "3"]
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  t = time.perf_counter()
  try:
    rc = subprocess.run(cmd, env=env, timeout=left).returncode
    entry = {"rc": rc}
  except subprocess.TimeoutExpired:  # the bench's JSON holds every row finished before this
    entry = {"rc": None, "timed_out_after_s": round(left, 1)}
  entry.update(cmd=" ".join(cmd[1:]), seconds=round(time.perf_counter() - t, 1))
  report.data["bench"] = entry
  report.write()


def main(argv=None):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--out", default="runs/device")
  ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                  help="no case starts, and the benchmark is stopped, after this many seconds")
  ap.add_argument("--skip-bench", action="store_true")
  ap.add_argument("--skip-engine", action="store_true")
  ap.add_argument("--interpret", action="store_true",
                  help="CPU smoke run of this script: interpret mode, tiny shapes, no bench")
  a = ap.parse_args(argv)
  cli.require(a, budget_s=0.0)
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  report = Report(out / "device_check.json", a.budget_s)
  # bf16 kernels, then the engine (the first H200 run's 150 s budget ran out before it), then f32
  cases = kernel_cases(a.interpret, (BF16,))
  if not a.skip_engine:
    try:
      cases += engine_cases(a.interpret)
    except Exception as e:  # the engine failing to import must not cost the kernel results
      report.data["cases"]["engine/import"] = {"error": f"{type(e).__name__}: {e}"}
  cases += kernel_cases(a.interpret, (F32,))
  for name, fn in cases:
    report.run(name, fn)
  if not (a.skip_bench or a.interpret):
    run_bench(report, out)
  cases = report.data["cases"].values()
  report.data["summary"] = {k: sum(k in c for c in cases) for k in ("result", "error", "skipped")}
  report.write()
  print(json.dumps(report.data["summary"]), f"-> {report.path}")
  return report.data


if __name__ == "__main__":
  main()
