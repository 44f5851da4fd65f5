"""One prepared device run (GPU/TPU): kernel correctness compiled on the device, the engine with
kernels on vs off, then a trimmed kernel benchmark. Designed for a short device lease:

  python3 experiments/device_check.py --out $OUT            # ~5 minutes on an H200

1. ``tree_attention`` and ``fused_sample`` compiled for the device (no interpret mode) vs their
   references on fresh random inputs, f32 and bf16, ragged cache lengths, GQA 1/2/7.
2. Speculative rollout with ``kernels="pallas"`` vs ``kernels="reference"`` on a random tiny model
   (f32, matmul precision "highest"): token identity and the logprob gap; vanilla too.
3. ``bench_kernels.py`` on a trimmed grid (1.5B/7B layouts, L in {512, 4096}, N+1 in {1, 8, 16},
   B in {1, 64, 256}); results in ``<out>/bench_kernels.json``.
Everything printed is also written to ``<out>/device_check.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import _common  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np


def kernel_checks(interpret=False):
  from pallas_kernels import fused_sampler as fs
  from pallas_kernels import tree_attention as ta
  rng = np.random.default_rng(0)
  out = []
  for dtype in (jnp.float32, jnp.bfloat16):
    shapes = [(3, 8, 14, 2, 128, 700), (2, 1, 7, 7, 64, 300), (4, 16, 12, 2, 128, 4096)]
    for (b, t, h, hkv, dh, L) in shapes[:1] if interpret else shapes:
      r = lambda *s, dt=dtype: jnp.asarray(rng.standard_normal(s), dt)
      q, kc, vc, kn, vn = r(b, t, h, dh), r(b, L, hkv, dh), r(b, L, hkv, dh), r(b, t, hkv, dh), \
          r(b, t, hkv, dh)
      lens = jnp.asarray(rng.integers(0, L + 1, b).tolist()[:-1] + [L], jnp.int32)
      mask = jnp.asarray(np.tril(rng.random((b, t, t)) < 0.6) | np.eye(t, dtype=bool)[None])
      got = ta.tree_attention(q, kc, vc, lens, kn, vn, mask, interpret=interpret)
      f32 = lambda x: x.astype(jnp.float32)
      ref = ta.tree_attention_reference(f32(q), f32(kc), f32(vc), lens, f32(kn), f32(vn), mask)
      err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)))
      out.append({"kernel": "tree_attention", "dtype": jnp.dtype(dtype).name,
                  "shape": [b, t, h, hkv, dh, L], "max_abs_err": err,
                  "finite": bool(jnp.isfinite(got).all())})
    sampler_shapes = [(16, 1536, 151936, 1.0), (37, 896, 32003, 0.7), (8, 512, 5000, 0.0)]
    for (rows, d, v, temp) in sampler_shapes[2:] if interpret else sampler_shapes:
      hid = jnp.asarray(rng.standard_normal((rows, d)) / np.sqrt(d), dtype)
      w = jnp.asarray(rng.standard_normal((d, v)), dtype)
      sids = jnp.arange(rows, dtype=jnp.int32)
      pos = jnp.asarray(rng.integers(0, 4000, rows), jnp.int32)
      tok, lp = fs.fused_sample(hid, w, 123, sids, pos, temperature=temp, interpret=interpret)
      rtok, rlp = fs.fused_sample_reference(hid.astype(jnp.float32), w.astype(jnp.float32),
                                            np.uint32(123), sids, pos, temperature=temp)
      out.append({"kernel": "fused_sample", "dtype": jnp.dtype(dtype).name,
                  "shape": [rows, d, v], "temperature": temp,
                  "token_agreement": float(jnp.mean(tok == rtok)),
                  "max_abs_logprob_err": float(jnp.max(jnp.abs(lp - rlp)))})
  return out


def engine_check(interpret=False):
  from specroll_jax import heads, models, rollout
  jax.config.update("jax_default_matmul_precision", "highest")
  config = models.ModelConfig.tiny(vocab_size=512, head_dim=64, num_heads=4, num_kv_heads=2,
                                   hidden_size=256, intermediate_size=512)
  params = models.init_params(jax.random.key(0), config)
  hd = heads.init(jax.random.key(1), config, 3, scale=0.05)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, 512, rng.integers(3, 40)).tolist() for _ in range(4 if interpret
                                                                              else 16)]
  kernels = "pallas_interpret" if interpret else "pallas"
  res = {}
  for temp in (0.0, 1.0):
    kw = dict(sampling=rollout.SamplingConfig(temperature=temp), max_new_tokens=8 if interpret
              else 64, seed=5,
              eos_ids=[])
    ref = rollout.generate(config, params, prompts, kernels="reference", **kw)
    for name, extra in (("vanilla", {}), ("speculative", {"spec": rollout.SpecConfig.for_h200(),
                                                           "heads": hd})):
      got = rollout.generate(config, params, prompts, kernels=kernels, **extra, **kw)
      res[f"{name}_T{temp}"] = {
          "token_identity": float((np.asarray(got.tokens) == np.asarray(ref.tokens)).mean()),
          "max_logprob_gap": float(np.abs(np.asarray(got.logprobs) - np.asarray(ref.logprobs))
                                   .max())}
  jax.config.update("jax_default_matmul_precision", None)
  return res


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--out", default="runs/device")
  ap.add_argument("--skip-bench", action="store_true")
  ap.add_argument("--interpret", action="store_true",
                  help="CPU smoke check of this script: interpret mode, small shapes, no bench")
  a = ap.parse_args(argv)
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  report = {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__}
  for name, fn in (("kernels", kernel_checks), ("engine", engine_check)):
    t0 = time.perf_counter()
    try:
      report[name] = fn(a.interpret)
    except Exception as e:  # keep going: a device lease is short, report every stage
      report[name] = {"error": f"{type(e).__name__}: {e}"}
    report[f"{name}_seconds"] = time.perf_counter() - t0
    print(json.dumps({name: report[name]}, indent=1), flush=True)
    (out / "device_check.json").write_text(json.dumps(report, indent=2))
  if not (a.skip_bench or a.interpret):
    cmd = [sys.executable, str(Path(__file__).with_name("bench_kernels.py")), "--out",
           str(out / "bench_kernels.json"), "--lengths", "512", "4096", "--tree-sizes", "1", "8",
           "16", "--batches", "1", "64", "256"]
    report["bench_kernels_rc"] = subprocess.call(cmd)
    (out / "device_check.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
