"""Shared by the experiment scripts: make the repo importable when run as a plain script (the app
package ``app`` beside this file is importable then too: ``experiments/`` is ``sys.path[0]``), the
flags every script shares (``--model``, ``--prompts``, ``--group``, ``--max-new-tokens``,
``--seed``, ``--out``) with their checks, model loading, the timing loop, and the machine a
measurement was taken on."""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))


def cpu_model() -> str:
  """The CPU model from ``lscpu`` with the core count (ratios on CPU depend on it)."""
  from specroll_jax._machine import cpu_model as _cpu_model
  return _cpu_model()


def add_shared_flags(ap, *, out: str, prompts: int | None = 8, group: int = 8,
                     max_new_tokens: int | None = 256, model: bool = True, batch: bool = True,
                     prompts_help: str = "prompts per batch",
                     max_new_tokens_help: str = "response length limit") -> None:
  """The flags every script shares, with the script's defaults (None: decided by the script);
  ``batch=False`` leaves out --prompts and --group (a script that shapes its batches itself)."""
  if model:
    ap.add_argument("--model", default=None,
                    help="local HF model folder (default: the embedded tiny model)")
  if batch:
    ap.add_argument("--prompts", type=int, default=prompts, help=prompts_help)
    ap.add_argument("--group", type=int, default=group, help="responses per prompt (G)")
  ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help=max_new_tokens_help)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=out, help=f"results path (default: {out})")


def check_shared_flags(a, **more_lower_bounds) -> None:
  """One line and exit 2 unless the shared flags (and ``more_lower_bounds``, as in
  ``cli.require``) are in range."""
  from app import cli
  shared = {k: lo for k, lo in (("prompts", 1), ("group", 1), ("max_new_tokens", 1), ("seed", 0))
            if hasattr(a, k)}
  cli.require(a, **shared, **more_lower_bounds)


def quick_shape():
  """The small widening of the embedded model that the CPU smoke runs use (``--quick``)."""
  from app.widen import WideShape
  return WideShape(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=1, head_dim=64,
                   intermediate_size=768)


def load_model(a):
  """(config, params, tokenizer, path) of ``--model`` (the embedded model when unset); a folder
  that is not a model ends in one line and exit 2."""
  from app import cli, pipeline
  try:
    return pipeline.load_model(a.model, progress=sys.stdout.isatty())
  except ValueError as e:
    cli.fail("--model", a.model, str(e))


def timed(fn, repeats: int):
  """(last output, median seconds over ``repeats`` calls, compile seconds): one call first (compile
  + run), then ``repeats`` timed calls; the compile figure is the first call minus the median."""
  import jax
  import numpy as np
  t0 = time.perf_counter()
  out = fn()
  jax.block_until_ready(out.tokens)
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out.tokens)
    times.append(time.perf_counter() - t0)
  t = float(np.median(times))
  return out, t, max(first - t, 0.0)
