"""Shared fixtures: a tiny trained GSM8K model (``tests/assets/test-model``) and a random tiny
model. ``experiments/`` is on ``sys.path`` for the whole session, as for the experiment scripts, so
tests import the app package beside the library as ``from app import pipeline``."""

import gc
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.join(ROOT, "experiments")
if EXPERIMENTS not in sys.path:
  sys.path.insert(0, EXPERIMENTS)
# a test subprocess's PYTHONPATH: the checkout (the library) and experiments/ (the app package)
PYTHONPATH = os.pathsep.join([ROOT, EXPERIMENTS, *filter(None, [os.environ.get("PYTHONPATH")])])

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# jax's persistent compilation cache (set before jax is imported, inherited by the subprocess
# tests): a program compiled once in this run, by this process or a child, is loaded from disk
# the next time (after the per-module cache release below, in the 4-device and job subprocesses,
# in the next local run). Keyed by the program, jax version, flags and device: never stale.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(ROOT, ".pytest_cache", "jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# `make test` (the fast suite) sets SPECROLL_TEST_FAST_COMPILE=1: XLA's CPU backend then compiles
# without LLVM's optimisation passes. The fast suite's time is mostly compilation of small
# programs; it checks properties (exact tokens, parity, references), which do not depend on how
# well the machine code is optimised, and runs about a quarter faster. Set before jax starts its
# backend; the subprocess tests pass it on (``xla_flags``). The slow set (long training runs, where
# run time dominates) compiles as users do.
FAST_COMPILE_FLAG = "--xla_backend_optimization_level=0"
FAST_COMPILE = os.environ.get("SPECROLL_TEST_FAST_COMPILE") == "1"
if FAST_COMPILE and FAST_COMPILE_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE_FLAG).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from specroll_jax import models  # noqa: E402
from specroll_jax.data import gsm8k  # noqa: E402
from specroll_jax.engines import executables  # noqa: E402
from specroll_jax.models.tokenizer import Tokenizer  # noqa: E402


def _mapped_regions() -> int:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return -1


@pytest.fixture(autouse=True, scope="module")
def _release_executables(request):
  """Drop jax's compiled executables after every test module.

  Each XLA:CPU executable keeps a few memory mappings alive; a whole-suite process compiles
  tens of thousands of them (hypothesis shapes, eager ops) and crossed Linux's
  ``vm.max_map_count`` (65530), which made LLVM segfault mid-compile. Session fixtures hold
  arrays, not executables, so the next module only recompiles what it uses. The library's own
  held programs (``engines.executables``: ``SpecRoll``'s and the engines') go too: kept, a
  worker's maps grew by each module's (test_readme alone adds about 34,000) until XLA crashed
  writing an executable to the compile cache.
  """
  yield
  before = _mapped_regions()
  executables.clear()
  jax.clear_caches()
  gc.collect()
  log = os.environ.get("SPECROLL_MAPS_LOG")
  if log:
    with open(log, "a") as f:
      f.write(f"{request.module.__name__} {before} -> {_mapped_regions()}\n")


TEST_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "test-model")


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test subprocess with ``devices`` CPU devices (and the fast suite's compile
  flag when it is on)."""
  flags = f"--xla_force_host_platform_device_count={devices}"
  return f"{flags} {FAST_COMPILE_FLAG}" if FAST_COMPILE else flags


@pytest.fixture(scope="session")
def trained_model():
  """(config, params, tokenizer) of the tiny SFT-trained GSM8K model: ``tests/assets/test-model``,
  what ``sft.build_test_model`` builds (35-45 s on 2 CPU cores; ``tests/test_sft.py``, marked
  slow, builds it again and checks it against this copy). ``SPECROLL_TEST_MODEL`` names another
  folder."""
  path = os.environ.get("SPECROLL_TEST_MODEL") or TEST_MODEL
  config, params = models.load_pretrained(path)
  return config, params, Tokenizer.from_pretrained(path)


@pytest.fixture(scope="session")
def gsm8k_prompts(trained_model):
  """Token ids of the first 16 GSM8K test prompts (ragged)."""
  tok = trained_model[2]
  return [tok.encode(gsm8k.format_prompt(e.question)) for e in gsm8k.load("test")[:16]]


@pytest.fixture(scope="session")
def random_model():
  config = models.ModelConfig.tiny(vocab_size=256, max_position_embeddings=256)
  return config, models.init_params(jax.random.key(0), config)


def run_on_cpu_devices(tmp_path, source: str, devices: int = 4, timeout: int = 600) -> dict:
  """Run ``source`` (a script that prints one line ``RESULT <json>``) in a fresh process with
  ``devices`` CPU devices (XLA_FLAGS set before jax is imported); returns the parsed JSON."""
  import json
  import subprocess
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices), PYTHONPATH=PYTHONPATH, JAX_PLATFORMS="cpu")
  script = tmp_path / "on_devices.py"
  script.write_text(source)
  proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
  return json.loads(line[len("RESULT "):])


# slow checks beyond CI's time (pyproject.toml's markers): only `make test-all` runs them
LONG = [pytest.mark.slow, pytest.mark.long]


def leaves_equal(a, b) -> bool:
  """Same structure and every leaf bit for bit (NaN included)."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  same = lambda x, y: (x.dtype == y.dtype and x.shape == y.shape
                       and np.asarray(x).tobytes() == np.asarray(y).tobytes())
  return (jax.tree.structure(a) == jax.tree.structure(b)
          and all(same(x, y) for x, y in zip(la, lb, strict=True)))


def head_slice(tree, k):
  """Head ``k``'s slice (the leading K axis) of every leaf."""
  return jax.tree.map(lambda x: x[k], tree)


def ancestor_closure(parent, valid):
  """The reflexive transitive closure of ``parent`` over valid nodes (numpy; diagonal for all):
  what a tree's attention mask must be."""
  n1 = len(parent)
  want = np.eye(n1, dtype=bool)
  for i in range(n1):
    if valid[i]:
      j = i
      while j >= 0:
        want[i, j] = True
        j = int(parent[j])
  return want


def load_script(name: str):
  """An experiment script (``experiments/<name>``) as a module (its folder is on sys.path, as when
  it runs as a script); tests call its ``main(argv)`` in-process."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(f"_exp_{name[:-3]}",
                                                os.path.join(EXPERIMENTS, name))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod
