"""Synthetic GSM8K-style problems: determinism, disjoint splits, correct golds, difficulty knob."""

import dataclasses
import re

import pytest

from app import synthetic
from app.synthetic import Difficulty
from specroll_jax import rewards
from specroll_jax.data import gsm8k

LEVELS = [Difficulty.from_level(lv) for lv in range(synthetic.NUM_LEVELS)]
PRESETS = [Difficulty.easy(), Difficulty.medium(), Difficulty.hard()]
_STEP_RE = re.compile(r"\$?(\d+) ([-+*/]) \$?(\d+) = \$?(\d+)")


@pytest.fixture(scope="module")
def samples():
  """(difficulty, split) -> 3000 problems, for every preset and level."""
  return {(d, split): synthetic.generate(3000, seed=7, split=split, difficulty=d)
          for d in dict.fromkeys(PRESETS + LEVELS) for split in synthetic.SPLITS}


def _fold(operands, ops):
  """The chain's values, evaluated here (not with the module's evaluator)."""
  values = [operands[0]]
  for op, b in zip(ops, operands[1:], strict=True):
    a = values[-1]
    if op == "+":
      values.append(a + b)
    elif op == "-":
      values.append(a - b)
    elif op == "*":
      values.append(a * b)
    else:
      assert op == "/" and b != 0 and a % b == 0, (a, op, b)
      values.append(a // b)
  return values


def test_deterministic_per_seed():
  for d in PRESETS:
    a = synthetic.generate(200, seed=3, difficulty=d)
    assert a == synthetic.generate(200, seed=3, difficulty=d)
    assert a != synthetic.generate(200, seed=4, difficulty=d)
    assert [p.question for p in a] != [p.question for p in synthetic.generate(200, seed=4,
                                                                                difficulty=d)]
    assert synthetic.generate(50, seed=3, difficulty=d) == a[:50]  # problem i ignores n
  assert synthetic.generate(100, seed=3) == synthetic.generate(100, seed=3,
                                                               difficulty=Difficulty.easy())
  assert synthetic.generate(0, seed=0) == []


def test_problems_are_gsm8k_examples():
  p = synthetic.generate(1, seed=0, difficulty=Difficulty.hard())[0]
  assert isinstance(p, gsm8k.Example)
  assert p.example == gsm8k.Example(p.question, p.answer, p.gold)
  assert gsm8k.extract_gold(p.answer) == p.gold == gsm8k.normalize_number(p.gold)
  assert gsm8k.format_prompt(p.question).startswith("Question: " + p.question)
  assert "<<" not in p.answer and ">>" not in p.answer
  with pytest.raises(dataclasses.FrozenInstanceError):
    p.gold = "0"


def test_train_and_test_are_disjoint(samples):
  for d in dict.fromkeys(PRESETS + LEVELS):
    train, test = samples[(d, "train")], samples[(d, "test")]
    assert {p.question for p in train}.isdisjoint(p.question for p in test)
    assert {p.key for p in train}.isdisjoint(p.key for p in test)
    assert all(synthetic.split_of(*p.key) == "train" for p in train)
    assert all(synthetic.split_of(*p.key) == "test" for p in test)
  # Across difficulties too: a key's split does not depend on the difficulty.
  all_train = {p.key for (_, split), ps in samples.items() if split == "train" for p in ps}
  all_test = {p.key for (_, split), ps in samples.items() if split == "test" for p in ps}
  assert all_train.isdisjoint(all_test)
  assert len(all_test) > 1000  # the test split is not degenerate


def test_gold_recomputed_from_structure_and_each_line_checked(samples):
  for ps in samples.values():
    for p in ps:
      assert len(p.operands) == len(p.ops) + 1 == p.steps + 1
      values = _fold(p.operands, p.ops)
      assert p.gold == str(values[-1]) and synthetic.answer_value(p) == values[-1]
      *lines, last = p.answer.split("\n")
      assert last == f"#### {values[-1]}"
      assert len(lines) == p.steps
      for i, line in enumerate(lines):
        found = _STEP_RE.findall(line)
        assert len(found) == 1, line
        a, op, b, c = found[0]
        assert _fold([int(a), int(b)], [op])[-1] == int(c), line
        assert (int(a), op, int(b), int(c)) == (values[i], p.ops[i], p.operands[i + 1],
                                                values[i + 1]), (p.question, line)
      for x in p.operands:  # every operand is stated in the question
        assert re.search(rf"(?<!\d){x}(?!\d)", p.question), (x, p.question)


def test_gold_solutions_get_full_reward_and_a_wrong_final_number_none(samples):
  ps = samples[(Difficulty.hard(), "test")][:500] + samples[(Difficulty.easy(), "train")][:500]
  for p in ps:
    assert rewards.gsm8k_reward(p.answer, p.gold) == 1.0
    assert rewards.gsm8k_reward(p.answer, p.gold, mode="flexible") == 1.0
    assert rewards.gsm8k_reward(gsm8k.format_target(p.answer), p.gold) == 1.0
    assert rewards.gsm8k_reward(p.answer, p.gold, format_weight=0.5) == 1.5
    wrong = p.answer.rsplit("####", 1)[0] + f"#### {int(p.gold) + 1}"
    assert rewards.gsm8k_reward(wrong, p.gold) == 0.0
    # The format bonus still pays for a well-formed "#### N" line; correctness pays nothing.
    assert rewards.gsm8k_reward(wrong, p.gold, format_weight=0.5) == 0.5


def test_difficulty_bounds_steps_values_and_ops(samples):
  for (d, _), ps in samples.items():
    for p in ps:
      assert 1 <= p.steps <= d.max_steps
      assert set(p.ops) <= set(d.ops)
      values = _fold(p.operands, p.ops)
      assert all(synthetic.MIN_VALUE <= v <= d.max_value for v in list(p.operands) + values)
      numbers = [int(x) for x in re.findall(r"\d+", p.question + "\n" + p.answer)]
      assert max(numbers) <= d.max_value
    # The knob is used, not just respected: every allowed step count and op occurs.
    assert {p.steps for p in ps} == set(range(1, d.max_steps + 1))
    assert {op for p in ps for op in p.ops} == set(d.ops)


def test_from_level_is_monotone():
  assert Difficulty.from_level(1) == Difficulty.easy()
  assert Difficulty.from_level(2) == Difficulty.medium()
  assert Difficulty.from_level(synthetic.NUM_LEVELS - 1) == Difficulty.hard()
  for lo, hi in zip(LEVELS, LEVELS[1:], strict=False):
    assert lo.max_steps <= hi.max_steps and lo.max_value <= hi.max_value
    assert set(lo.ops) <= set(hi.ops)
    assert lo != hi


def test_variety(samples):
  ps = samples[(Difficulty.hard(), "train")]
  assert len({p.template for p in ps}) == len(synthetic.TEMPLATE_NAMES) >= 36
  assert len({p.question for p in ps}) > 0.95 * len(ps)
  easy = samples[(Difficulty.easy(), "train")]
  assert len({p.template for p in easy}) >= 12 and len({p.question for p in easy}) > 2000
  for p in ps + easy:  # short: 1-3 question sentences, one line per step
    assert 1 <= len(re.findall(r"[.?](?:\s|$)", p.question)) <= 3, p.question
    assert p.question.endswith("?") and len(p.question) < 260


def test_difficulty_ops_are_canonical():
  assert Difficulty(2, 50, ("-", "+", "-")).ops == ("+", "-")
  assert Difficulty(2, 50, ["*"]) == Difficulty(2, 50, ("*",))


@pytest.mark.parametrize("kwargs, field", [
  (dict(max_steps=0, max_value=20, ops=("+",)), "Difficulty.max_steps"),
  (dict(max_steps=4, max_value=20, ops=("+",)), "Difficulty.max_steps"),
  (dict(max_steps=2.0, max_value=20, ops=("+",)), "Difficulty.max_steps"),
  (dict(max_steps=2, max_value=5, ops=("+",)), "Difficulty.max_value"),
  (dict(max_steps=2, max_value=10**6, ops=("+",)), "Difficulty.max_value"),
  (dict(max_steps=2, max_value=20, ops=()), "Difficulty.ops"),
  (dict(max_steps=2, max_value=20, ops=("%",)), "Difficulty.ops"),
  (dict(max_steps=2, max_value=20, ops="+-"), "Difficulty.ops"),
])
def test_bad_difficulty(kwargs, field):
  with pytest.raises(ValueError, match=re.escape(field)):
    Difficulty(**kwargs)


def test_bad_arguments():
  with pytest.raises(ValueError, match=r"level must be an int in \[0, 4\], got 5"):
    Difficulty.from_level(synthetic.NUM_LEVELS)
  with pytest.raises(ValueError, match="level"):
    Difficulty.from_level(-1)
  with pytest.raises(ValueError, match=r"n must be an int >= 0, got -1"):
    synthetic.generate(-1, seed=0)
  with pytest.raises(ValueError, match="n must be"):
    synthetic.generate(2.0, seed=0)
  for seed in (1.5, "0", None, True, -1):
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
      synthetic.generate(1, seed=seed)
  with pytest.raises(ValueError, match=r"split must be one of \('train', 'test'\), got 'dev'"):
    synthetic.generate(1, seed=0, split="dev")
  with pytest.raises(ValueError, match="difficulty must be a Difficulty"):
    synthetic.generate(1, seed=0, difficulty=2)


def test_tasks_give_gsm8k_synthetic_or_both():
  from app import tasks
  syn = tasks.Task(name="synthetic", level=1, train_size=50, test_size=20)
  tr, te = syn.examples("train"), syn.examples("test")
  assert len(tr) == 50 and len(te) == 20
  assert {e.question for e in tr}.isdisjoint(e.question for e in te)
  assert tasks.Task(name="gsm8k").examples("test") == gsm8k.load("test")
  mix = tasks.Task(name="mix", train_size=10, test_size=5).examples("test")
  real = set(e.question for e in gsm8k.load("test"))
  assert len(mix) == 5 + len(real) and sum(e.question in real for e in mix[:10]) == 5
  with pytest.raises(ValueError, match="Task.name must be one of"):
    tasks.Task(name="math")
  with pytest.raises(ValueError, match="level must be an int in"):
    tasks.Task(name="synthetic", level=9)
  with pytest.raises(ValueError, match="split must be one of"):
    syn.examples("dev")
