"""experiments/bench_coupling.py in-process: the --quick run writes the teacher-forced hits, the
loss comparison and the object's first batches, coupled and not (greedy: the same hits either
way; the object's tokens the vanilla engine's), and bad flags fail in one line with exit code 2."""

import json

import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def bench():
  return load_script("bench_coupling.py")


@pytest.mark.slow  # the quick benchmark: about 90 s (tiny fits, 2 prompts x 4)
def test_quick_run_writes_every_part(bench, tmp_path):
  out = tmp_path / "coupling.json"
  bench.main(["--quick", "--out", str(out)])
  data = json.loads(out.read_text())
  assert data["meta"]["cpu"]
  hits = data["hits"]
  assert {(r["task"], r["T"], r["coupled"]) for r in hits} == {
      (t, temp, c) for t in ("gsm8k", "synthetic") for temp in (1.0, 0.0) for c in (False, True)}
  for r in hits:
    assert len(r["top1"]) == 3 and all(a <= b for a, b in zip(r["top1"], r["top4"], strict=True))
    assert 1.0 <= r["chain_tau4"] <= 4.0
  greedy = {(r["task"], r["heads"], r["coupled"]): r for r in hits if r["T"] == 0.0}
  for (task, heads, coupled), r in greedy.items():  # T = 0: coupling changes nothing
    if coupled:
      assert r["top1"] == greedy[(task, heads, False)]["top1"]
  assert {r["tv_weight"] for r in data["loss"]} == {0.0, 1.0}
  assert data["object"] and all(r["identical"] for r in data["object"])
  assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("flag", [["--nodes", "0"], ["--fit-steps", "0"],
                                  ["--offset", "10", "--fit-prompts", "20"]])
def test_bad_flags_fail_in_one_line(bench, flag, capsys):
  with pytest.raises(SystemExit) as e:
    bench.main(flag)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ")
