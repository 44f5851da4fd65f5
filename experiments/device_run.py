"""One prepared end-to-end device run: SpecRoll where speculation pays (a GPU/TPU, a model whose
decode step reads gigabytes of weights), in one call that cannot lose its results:

  python3 experiments/device_run.py --out $OUT                  # one H100/H200, < 8 minutes
  python3 experiments/device_run.py --quick --out /tmp/dr       # CPU smoke run (CI): tiny widening

The model is the embedded one's exact function inside a Qwen2.5-shaped network (``app.widen``,
--shape, bf16 by default): acceptance is the small model's, cost is the real shape's (docs/
widening.md). Cases, one at a time, each in its own try/except, ``<out>/device_run.json``
rewritten after every case (``device_check.Report``); no case starts after --budget-s:
1. the engine with the Pallas kernels against the jnp references (``device_check.engine_cases``);
   then the tree-attention kernel in the tail of a batch (``bench_kernels.split_sweep``): B = 16
   rows, Qwen2.5-1.5B heads (12 / 2, Dh 128), a full L = 4096 cache, T = 1 and 8, the unsplit
   kernel (num_splits = 1) against splits of L (the automatic count, 4, 16, 32, and 16 with
   64-key blocks): microseconds per call, % of the measured copy roofline, speedup over unsplit;
2. per task (the synthetic problems, GSM8K) and temperature: a batch of --prompts test prompts x
   G, --max-new-tokens tokens, by the compacting vanilla engine and by ``SpecRoll`` with its
   defaults (one warm-up batch of other prompts first, its programs compiled there): tau, the
   wall-clock ratio, ms per forward, peak device memory, identical tokens, compile seconds. The
   cost model is measured once (T = 1) and shared by the other temperatures' objects;
3. on a machine with several devices, per model axis size m of --mesh-models that divides the
   device count (``specroll_jax.mesh``; --mesh-shape widened, Qwen2.5-7B by default: its 4 KV heads
   allow m = 2 and 4, m = 8 is refused and recorded so): the weights and KV cache split over m
   devices, a batch by the vanilla engine on the mesh and by ``SpecRoll(mesh=...)`` after a
   warm-up batch: identical tokens to one device's vanilla run (where the model fits one device),
   seconds against one device, tau, weight bytes and peak memory per device;
4. the main job itself on the widened model (``experiments/gsm8k.py --widen``, a few GRPO steps
   with SpecRoll, then with the vanilla engine): the end-to-end step ratio, in a subprocess with
   a hard timeout from the time left.
A persistent compilation cache under ``<out>/jax-cache`` lets the subprocess reuse what this
process compiled.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import _common  # noqa: E402
import bench_kernels  # noqa: E402
import device_check  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from app import cli, pipeline, tasks  # noqa: E402
from app.widen import QWEN25_SHAPES, WideShape, byte_count, widen  # noqa: E402
from specroll_jax import rollout  # noqa: E402
from specroll_jax.data import gsm8k  # noqa: E402
from specroll_jax.engines.config import SpecConfig  # noqa: E402
from specroll_jax.specroll import SpecRoll  # noqa: E402

# The tail-of-batch split sweep: (num_splits, block_l) per config, None = the kernel's default.
SPLIT_CONFIGS = [(1, None), (None, None), (4, None), (16, None), (32, None), (16, 64)]
QUICK_SPLIT_CONFIGS = [(1, None), (3, None)]


def _peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def widened(a):
  config, params, tok, path = pipeline.load_model(None, progress=False)
  heads = pipeline.default_heads(config, params, tok, path, conditioned=True)
  shape = _common.quick_shape() if a.quick else QWEN25_SHAPES[a.shape]
  config, params, heads = widen(config, params, shape, key=jax.random.key(0), heads=heads,
                                dtype=a.dtype)
  return config, params, heads, tok


def rollout_case(a, state, task, temperature):
  def case():
    config, params, heads, tok = state["model"]
    exs = tasks.Task(name=task).examples("test")[: a.prompts]
    warm = tasks.Task(name=task).examples("train")[: a.prompts]
    enc = lambda es: [tok.encode(gsm8k.format_prompt(e.question)) for e in es]
    sampling = rollout.SamplingConfig(temperature=temperature)
    sr = SpecRoll(config, sampling=sampling, group_size=a.group, max_new_tokens=a.max_new_tokens)
    if a.quick:  # the CPU smoke run: a fixed budget in one bucket (few, small programs)
      sr = dataclasses.replace(sr, budget="fixed", spec=SpecConfig(bucket_fractions=(1.0,)))
    st = sr.init(heads)
    if state.get("cost") is not None:  # one cost model for all temperatures (a step costs the same)
      sr.use_cost(state["cost"])
    ids = np.arange(a.prompts)
    _, _, st = sr.generate(params, sr.batch(enc(warm), 10_000 + ids), st, seed=1)  # compiles
    state.setdefault("cost", sr.cost)
    batch = sr.batch(enc(exs), ids)
    opts = rollout.DecodeOptions(cache_length=batch.cache_length)
    van = lambda: rollout.generate(config, params, batch.tokens, prompt_lengths=batch.lengths,
                                   sample_ids=batch.sample_ids, sampling=sampling,
                                   max_new_tokens=a.max_new_tokens, seed=0, eos_ids=sr.eos_ids,
                                   options=opts)
    ref, t_van, c_van = _common.timed(van, 1)
    out, r, _ = sr.generate(params, batch, st, seed=0)
    fwd = int(out.stats.forwards)
    return {"tau": r.tau, "probe_tau": r.probe_tau, "mode": r.mode, "nodes": list(r.nodes),
            "depth_acceptance": list(r.depth_acceptance), "seconds": r.rollout_seconds,
            "vanilla_seconds": t_van, "speedup": t_van / max(r.rollout_seconds, 1e-9),
            "ms_per_forward": 1e3 * r.rollout_seconds / fwd,
            "vanilla_ms_per_forward": 1e3 * t_van / int(ref.stats.forwards),
            "speedup_over_tau": t_van / max(r.rollout_seconds, 1e-9) / max(r.tau, 1e-9),
            "identical": bool((np.asarray(out.tokens) == np.asarray(ref.tokens)).all()),
            "compile_s": r.compile_seconds, "vanilla_compile_s": c_van,
            "peak_bytes": _peak_bytes()}
  return case


def split_case(a, interpret):
  """The tree-attention kernel at the tail of a batch, unsplit vs splits of L (module docstring);
  --quick: interpret mode, B = 2, 4 / 2 heads of 64, L = 80, T = 8, one repetition."""
  def case():
    dtype = jax.numpy.dtype(a.dtype)  # float32 with --quick
    if a.quick:
      b, lc, ts, heads, configs = 2, 80, (8,), (4, 2, 64), QUICK_SPLIT_CONFIGS
      timing, copy_mib = dict(warmup=0, reps=1, inner=1), 16
    else:
      b, lc, ts, heads, configs = 16, 4096, (1, 8), (12, 2, 128), SPLIT_CONFIGS
      timing, copy_mib = dict(warmup=3, reps=10, inner=3), 1024
    copy_bw = bench_kernels.copy_roofline(copy_mib, dtype, timing)
    rows = bench_kernels.split_sweep(b, lc, ts, heads, configs, dtype, interpret, timing,
                                     copy_bw)
    return {"copy_gbps": copy_bw / 1e9, "dtype": dtype.name, "rows": rows}
  return case


def mesh_shape(a):
  if a.quick:  # two KV heads (the quick widening has one): model axis 2
    return WideShape(hidden_size=256, num_layers=6, num_heads=6, num_kv_heads=2,
                     head_dim=64, intermediate_size=768)
  return QWEN25_SHAPES[a.mesh_shape]


def mesh_case(a, state, m: int):
  """Rollouts with the weights and KV cache over ``m`` devices (module docstring, case 3)."""
  from specroll_jax.mesh import ModelMesh, make_mesh

  def case():
    if "mesh_model" not in state:
      config, params, tok, path = pipeline.load_model(None, progress=False)
      heads = pipeline.default_heads(config, params, tok, path, conditioned=True)
      config, params, heads = widen(config, params, mesh_shape(a), key=jax.random.key(0),
                                    heads=heads, dtype=a.dtype)
      state["mesh_model"] = config, params, heads, tok
    config, params, heads, tok = state["mesh_model"]
    mm = ModelMesh(make_mesh(1, m))
    mm.check_config(config)  # a refusal is this case's recorded error
    exs = tasks.Task(name="gsm8k").examples("test")[: a.prompts]
    warm = tasks.Task(name="gsm8k").examples("train")[: a.prompts]
    enc = lambda es: [tok.encode(gsm8k.format_prompt(e.question)) for e in es]
    sampling = rollout.SamplingConfig(temperature=1.0)
    sharded = mm.shard_params(config, params)
    sr = SpecRoll(config, sampling=sampling, group_size=a.group, max_new_tokens=a.max_new_tokens,
                  mesh=mm)
    if a.quick:
      sr = dataclasses.replace(sr, budget="fixed", spec=SpecConfig(bucket_fractions=(1.0,)))
    ids = np.arange(a.prompts)
    st = sr.init(heads)
    _, _, st = sr.generate(sharded, sr.batch(enc(warm), 10_000 + ids), st, seed=1)  # compiles
    batch = sr.batch(enc(exs), ids)

    def van(p, mesh):
      return rollout.generate(config, p, batch.tokens, prompt_lengths=batch.lengths,
                              sample_ids=batch.sample_ids, sampling=sampling,
                              max_new_tokens=a.max_new_tokens, seed=0, eos_ids=sr.eos_ids,
                              options=rollout.DecodeOptions(cache_length=batch.cache_length,
                                                            mesh=mesh))
    one, t_one, _ = _common.timed(lambda: van(params, None), 1)
    ref, t_van, c_van = _common.timed(lambda: van(sharded, mm), 1)
    out, r, _ = sr.generate(sharded, batch, st, seed=0)
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in mm.mesh.devices.flat]
    same = lambda x: bool((np.asarray(x.tokens) == np.asarray(one.tokens)).all())
    return {"model_axis": m, "vanilla_identical": same(ref), "specroll_identical": same(out),
            "one_device_seconds": t_one, "vanilla_seconds": t_van,
            "vanilla_vs_one_device": t_one / max(t_van, 1e-9), "specroll_seconds":
            r.rollout_seconds, "speedup": t_van / max(r.rollout_seconds, 1e-9), "tau": r.tau,
            "mode": r.mode, "weight_bytes_per_device": mm.per_device_bytes(sharded),
            "peak_bytes_per_device": peaks, "compile_s": r.compile_seconds,
            "vanilla_compile_s": c_van}
  return case


def main_job(report, a, out: Path):
  left = report.left()
  if left < 60:
    report.data["main_job"] = {"skipped": f"time guard: {left:.0f} s left"}
    report.write()
    return
  cmd = [sys.executable, str(Path(__file__).with_name("gsm8k.py")), "--widen", a.shape,
         "--steps", str(a.job_steps), "--prompts", str(a.job_prompts), "--group", str(a.group),
         "--max-new-tokens", str(a.max_new_tokens), "--eval-prompts", "8", "--out",
         str(out / "gsm8k"), "--dtype", a.dtype]
  t = time.perf_counter()
  try:
    rc = subprocess.run(cmd, timeout=left).returncode
    entry = {"rc": rc}
    summary = out / "gsm8k" / "summary.json"
    if summary.exists():
      entry["table"] = json.loads(summary.read_text())["table"]
  except subprocess.TimeoutExpired:
    entry = {"rc": None, "timed_out_after_s": round(left, 1)}
  entry.update(cmd=" ".join(cmd[1:]), seconds=round(time.perf_counter() - t, 1))
  report.data["main_job"] = entry
  report.write()


def main(argv=None):
  ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--out", default="runs/device_run")
  ap.add_argument("--shape", default="1.5b", choices=sorted(QWEN25_SHAPES))
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  ap.add_argument("--prompts", type=int, default=32, help="test prompts per task")
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--max-new-tokens", type=int, default=512)
  ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7, 0.0])
  ap.add_argument("--job-steps", type=int, default=3)
  ap.add_argument("--job-prompts", type=int, default=16)
  ap.add_argument("--budget-s", type=float, default=420.0,
                  help="no case starts, and the main job is stopped, after this many seconds")
  ap.add_argument("--skip-job", action="store_true")
  ap.add_argument("--mesh-shape", default="7b", choices=sorted(QWEN25_SHAPES),
                  help="the shape widened for the model-parallel cases (several devices only)")
  ap.add_argument("--mesh-models", type=int, nargs="+", default=[2, 4, 8],
                  help="model axis sizes of the model-parallel cases (those <= the device count)")
  ap.add_argument("--quick", action="store_true",
                  help="CPU smoke run: a tiny widening, 2 prompts x 2, 16 tokens, T = 1")
  a = ap.parse_args(argv)
  cli.require(a, prompts=1, group=1, max_new_tokens=1, job_steps=1, job_prompts=1,
              budget_s=0.0, temperatures=0.0)
  if a.quick:  # (the main job on a real widening takes minutes to compile on a CPU: skipped)
    a.prompts, a.group, a.max_new_tokens, a.temperatures = 2, 2, 16, [1.0]
    a.dtype, a.skip_job = "float32", True
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(out / "jax-cache"))
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(out / "jax-cache")  # the subprocess too
  report = device_check.Report(out / "device_run.json", a.budget_s)
  report.data["args"] = vars(a)
  interpret = jax.default_backend() == "cpu"
  cases = device_check.engine_cases(interpret)
  cases.append(("kernels/split_tail", split_case(a, interpret)))
  state = {}

  def load():
    state["model"] = widened(a)
    c = state["model"][0]
    return {"shape": dataclasses.asdict(c), "bytes": dataclasses.asdict(byte_count(c))}

  cases.append(("widened/load", load))
  for task in ("synthetic", "gsm8k"):
    for t in a.temperatures:
      cases.append((f"rollout/{task}_T{t}", rollout_case(a, state, task, t)))
  if jax.device_count() > 1:
    for m in a.mesh_models:
      if m <= jax.device_count():
        cases.append((f"mesh/model{m}", mesh_case(a, state, m)))
  for name, fn in cases:
    report.run(name, fn)
  if not a.skip_job:
    main_job(report, a, out)
  cases = report.data["cases"].values()
  report.data["summary"] = {k: sum(k in c for c in cases) for k in ("result", "error", "skipped")}
  report.write()
  print(json.dumps(report.data["summary"]), f"-> {report.path}")
  return report.data


if __name__ == "__main__":
  main()
