"""Rollout traces: exact round trip, readers (same and other process) see only complete steps,
reopen after a crash continues, shape and value validation."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorstore as ts
from conftest import PYTHONPATH

from app.traces import TraceReader, TraceSpec, TraceWriter, read_traces

B, P, M = 3, 5, 7


def _step(i: int, batch: int = B) -> dict:
  """A deterministic step i: ragged prompts and responses padded with -1."""
  rng = np.random.default_rng(i)
  prompt_lens = rng.integers(1, P + 1, batch)
  prompt = np.where(np.arange(P) < prompt_lens[:, None], rng.integers(0, 100, (batch, P)), -1)
  lengths = rng.integers(0, M + 1, batch)
  live = np.arange(M) < lengths[:, None]
  return {
      "prompt_ids": prompt.astype(np.int32),
      "tokens": np.where(live, rng.integers(0, 100, (batch, M)), -1).astype(np.int32),
      "lengths": lengths.astype(np.int32),
      "rewards": rng.integers(0, 2, batch).astype(np.float32),
      "logprobs": np.where(live, -rng.exponential(size=(batch, M)), 0).astype(np.float32),
      "advantages": rng.normal(size=batch).astype(np.float32),
      "step": 10 * i,
      "tau": np.float32(0.5 + i / 64),
  }


def _stacked(steps) -> dict:
  steps = [_step(i) if isinstance(i, int) else i for i in steps]
  return {k: np.stack([np.asarray(s[k]) for s in steps]) for k in steps[0]}


def _assert_equal(got: dict, want: dict):
  assert sorted(got) == sorted(want)
  for k in want:
    assert got[k].dtype == TraceSpec(batch=B, prompt_len=P, max_new=M).fields[k][1], k
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _write_partial_step(path, index: int, fields=("tokens", "rewards")):
  """What a writer killed mid-append leaves: some fields of step ``index`` written, no commit."""
  for name in fields:
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                  "path": os.path.join(path, name) + "/"}}).result()
    arr[index].write(np.full(arr.shape[1:], 99, arr.dtype.numpy_dtype)).result()


def test_round_trip_and_layout(tmp_path):
  path = tmp_path / "trace"
  with TraceWriter(path, batch=B, prompt_len=P, max_new=M) as w:
    assert [w.append(_step(i)) for i in range(20)] == list(range(20))  # grows past capacity 16
  want = _stacked(range(20))
  _assert_equal(read_traces(path), want)
  _assert_equal(read_traces(path, [3, 1, -1]), {k: v[[3, 1, 19]] for k, v in want.items()})
  _assert_equal(read_traces(path, slice(2, 9, 3)), {k: v[2:9:3] for k, v in want.items()})
  _assert_equal(read_traces(path, 7), {k: v[7] for k, v in want.items()})
  assert read_traces(path, [])["tokens"].shape == (0, B, M)
  group = json.loads((path / "zarr.json").read_text())
  assert group["node_type"] == "group" and group["attributes"]["specroll_trace"]["num_steps"] == 20
  meta = json.loads((path / "tokens" / "zarr.json").read_text())
  assert meta["shape"] == [20, B, M]  # close() trimmed the capacity
  assert meta["chunk_grid"] == {"name": "regular", "configuration": {"chunk_shape": [1, B, M]}}
  assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd"]


def test_reader_in_same_process_sees_complete_steps(tmp_path):
  w = TraceWriter(tmp_path, batch=B, prompt_len=P, max_new=M)
  for i in range(2):
    w.append(_step(i))
  reader = TraceReader(tmp_path)
  _write_partial_step(tmp_path, 2)  # step 2 half-written, not committed
  assert reader.refresh() == 2
  _assert_equal(reader.read(), _stacked(range(2)))
  w.append(_step(2))
  assert reader.num_steps == 2  # a snapshot until refresh()
  _assert_equal(reader.read(), _stacked(range(2)))
  assert reader.refresh() == 3
  _assert_equal(reader.read(), _stacked(range(3)))
  w.close()


_READER = textwrap.dedent("""
  import sys
  import numpy as np
  from app.traces import TraceReader

  reader = None
  for line in sys.stdin:
    if reader is None:
      reader = TraceReader(sys.argv[1])
    else:
      reader.refresh()
    np.savez(line.strip(), **reader.read())
    print(reader.num_steps, flush=True)
""")


def test_reader_in_other_process_while_writer_open(tmp_path):
  path = tmp_path / "trace"
  w = TraceWriter(path, batch=B, prompt_len=P, max_new=M)
  env = dict(os.environ, PYTHONPATH=PYTHONPATH)
  child = subprocess.Popen([sys.executable, "-c", _READER, str(path)], env=env, text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)

  def child_reads(name):
    child.stdin.write(f"{tmp_path / name}\n")
    child.stdin.flush()
    n = int(child.stdout.readline())
    with np.load(tmp_path / name) as f:
      return n, dict(f)

  try:
    for i in range(3):
      w.append(_step(i))
    _write_partial_step(path, 3)
    n, got = child_reads("a.npz")
    assert n == 3
    _assert_equal(got, _stacked(range(3)))
    for i in range(3, 20):  # overwrites the partial step 3, grows the arrays past 16 steps
      w.append(_step(i))
    n, got = child_reads("b.npz")
    assert n == 20
    _assert_equal(got, _stacked(range(20)))
  finally:
    child.stdin.close()
    assert child.wait(timeout=30) == 0
    w.close()


def test_reopen_after_crash_continues_after_last_complete_step(tmp_path):
  w = TraceWriter(tmp_path, batch=B, prompt_len=P, max_new=M)
  for i in range(3):
    w.append(_step(i))
  # crash: step 3 half-written, one array already resized (a crash mid-grow), no close()
  _write_partial_step(tmp_path, 3)
  tokens = ts.open({"driver": "zarr3",
                    "kvstore": {"driver": "file", "path": f"{tmp_path}/tokens/"}}).result()
  tokens.resize(exclusive_max=[32, None, None]).result()
  del w
  w = TraceWriter(tmp_path, batch=B, prompt_len=P, max_new=M)
  assert w.num_steps == 3
  new = [_step(100 + i) for i in range(2)]
  assert [w.append(s) for s in new] == [3, 4]
  w.close()
  _assert_equal(read_traces(tmp_path), _stacked([0, 1, 2, *new]))
  # reopen after a clean close (capacity trimmed to 5), roll back to a checkpoint, continue
  with TraceWriter(tmp_path, batch=B, prompt_len=P, max_new=M) as w:
    assert w.num_steps == 5
    w.truncate(2)
    assert w.append(_step(7)) == 2
  _assert_equal(read_traces(tmp_path), _stacked([0, 1, 7]))


def test_validation(tmp_path):
  with pytest.raises(ValueError, match="batch must be an int >= 1, got 0"):
    TraceWriter(tmp_path / "t", batch=0, prompt_len=P, max_new=M)
  with pytest.raises(ValueError, match="scalar name 'tokens' must be an identifier"):
    TraceWriter(tmp_path / "t", batch=B, prompt_len=P, max_new=M, scalars={"tokens": "int32"})
  with pytest.raises(ValueError, match="path=.* holds no trace"):
    TraceReader(tmp_path)
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="path=.*file' exists and is not a directory"):
    TraceWriter(tmp_path / "file", batch=B, prompt_len=P, max_new=M)

  w = TraceWriter(tmp_path / "t", batch=B, prompt_len=P, max_new=M)
  bad = [
      ({"tokens": np.zeros((B, M + 1), np.int32)},
       r"tokens has shape \(3, 8\), expected \(3, 7\) \(batch=3, prompt_len=5, max_new=7\)"),
      ({"prompt_ids": np.zeros((B + 1, P), np.int32)}, r"prompt_ids has shape \(4, 5\), expected"),
      ({"rewards": np.zeros((B, 1))}, r"rewards has shape \(3, 1\), expected \(3,\)"),
      ({"tau": np.zeros(1)}, r"tau has shape \(1,\), expected \(\)"),
      ({"tokens": np.zeros((B, M))}, "tokens has dtype float64, expected integers"),
      ({"tokens": np.full((B, M), 2**40)}, "tokens holds values in .* outside the int32 range"),
      ({"lengths": np.full(B, M + 1)}, r"lengths must lie in \[0, max_new=7\], got values in"),
      ({"extra": 1}, r"unknown fields \['extra'\]"),
  ]
  for change, match in bad:
    with pytest.raises(ValueError, match=match):
      w.append({**_step(0), **change})
  step = _step(0)
  del step["advantages"]
  with pytest.raises(ValueError, match=r"missing fields \['advantages'\]"):
    w.append(step)
  assert TraceReader(tmp_path / "t").num_steps == 0  # nothing was committed
  w.append(_step(0))
  with pytest.raises(ValueError, match=r"num_steps must be an int in \[0, 1\], got 2"):
    w.truncate(2)
  w.close()
  with pytest.raises(ValueError, match="is closed"):
    w.append(_step(1))
  with pytest.raises(ValueError, match=r"batch=4 does not match the existing trace .*\(batch=3\)"):
    TraceWriter(tmp_path / "t", batch=4, prompt_len=P, max_new=M)
  with pytest.raises(ValueError, match="scalars=.* does not match the existing trace"):
    TraceWriter(tmp_path / "t", batch=B, prompt_len=P, max_new=M, scalars={"step": "int64"})
  with pytest.raises(ValueError, match=r"steps=\[1\] is out of range for a trace of 1 complete"):
    read_traces(tmp_path / "t", [1])
