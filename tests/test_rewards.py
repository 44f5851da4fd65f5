"""GSM8K answer extraction and rewards on hand-written completions."""

import numpy as np
import pytest

from specroll_jax.data import gsm8k
from specroll_jax.rewards import batch_rewards, gsm8k_reward


@pytest.mark.parametrize(
  "completion, gold",
  [
    ("3 - 6 = -3\n#### -3", "-3"),
    ("#### 2.50", "2.5"),
    ("#### 5.0", "5"),
    ("#### 1,234", "1234"),
    ("#### $5", "5"),
    ("####   42  ", "42"),
    ("#### 42.", "42"),
    ("So the total is 7.\n#### 7\n", "7"),
    ("#### 1\nwait, recount.\n#### 2", "2"),  # the last marker counts
  ],
)
def test_correct_answers_score_one(completion, gold):
  assert gsm8k_reward(completion, gold) == 1.0


@pytest.mark.parametrize(
  "completion, gold",
  [
    ("#### 3", "-3"),
    ("#### 2.51", "2.5"),
    ("#### 1,235", "1234"),
    ("#### 2\n#### 1", "2"),
  ],
)
def test_wrong_answers_score_zero(completion, gold):
  assert gsm8k_reward(completion, gold) == 0.0


def test_strict_vs_flexible():
  text = "She has 3 apples and 4 pears, so 7 fruits."
  assert gsm8k.extract_answer(text, "strict") is None
  assert gsm8k.extract_answer(text, "flexible") == "7"
  assert gsm8k_reward(text, "7") == 0.0
  assert gsm8k_reward(text, "7", mode="flexible") == 1.0
  # With a marker, flexible takes the marked number, not the last number.
  marked = "#### 12\nThat is 12 plus 3 = 15."
  assert gsm8k.extract_answer(marked, "strict") == "12"
  assert gsm8k.extract_answer(marked, "flexible") == "12"
  assert gsm8k_reward(marked, "15", mode="flexible") == 0.0
  # Flexible number parsing: signs, "$", commas, subtraction is not a sign.
  assert gsm8k.extract_answer("costs $1,250.00 in total", "flexible") == "1250"
  assert gsm8k.extract_answer("went to -4 degrees", "flexible") == "-4"
  assert gsm8k.extract_answer("10-2", "flexible") == "2"


def test_no_answer():
  for text in ["", "I don't know.", "#### ", "#### forty-two"]:
    assert gsm8k.extract_answer(text, "strict") is None
    assert gsm8k_reward(text, "42") == 0.0
  assert gsm8k.extract_answer("I don't know.", "flexible") is None
  assert gsm8k_reward("I don't know.", "42", mode="flexible") == 0.0


def test_format_reward_only_when_well_formed():
  # Correct and well formed: 1 + w.
  assert gsm8k_reward("2 + 3 = 5\n#### 5", "5", format_weight=0.25) == 1.25
  # Wrong but well formed: w.
  assert gsm8k_reward("#### 6", "5", format_weight=0.25) == 0.25
  # Marker not on its own line, or followed by words: strict finds 5, no format bonus.
  assert gsm8k_reward("so #### 5", "5", format_weight=0.25) == 1.0
  assert gsm8k_reward("#### 5 apples", "5", format_weight=0.25) == 1.0
  # No marker at all.
  assert gsm8k_reward("5", "5", format_weight=0.25, mode="flexible") == 1.0
  # Default weight 0 adds nothing.
  assert gsm8k_reward("#### 5", "5") == 1.0


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match=r"format_weight must be a finite number >= 0, got -0\.1"):
    gsm8k_reward("#### 1", "1", format_weight=-0.1)
  with pytest.raises(ValueError, match="format_weight must be a finite number >= 0, got nan"):
    gsm8k_reward("#### 1", "1", format_weight=float("nan"))
  with pytest.raises(ValueError, match=r"mode must be one of .*'loose'"):
    gsm8k_reward("#### 1", "1", mode="loose")
  with pytest.raises(ValueError, match=r"mode must be one of .*'loose'"):
    gsm8k.extract_answer("#### 1", mode="loose")
  with pytest.raises(ValueError, match="gold must be a number"):
    gsm8k_reward("#### 1", "one")


def test_batch_rewards():
  r = batch_rewards(["#### 1", "#### 2", "no", "#### 4"], ["1", "3", "0", "4"], format_weight=0.5)
  assert r.dtype == np.float32
  np.testing.assert_array_equal(r, np.array([1.5, 0.5, 0.0, 1.5], np.float32))
  with pytest.raises(ValueError, match="equal lengths, got 2 and 1"):
    batch_rewards(["a", "b"], ["1"])


def test_real_solutions_score_one():
  for ex in gsm8k.load("test")[:200]:
    assert gsm8k_reward(ex.answer, ex.gold, format_weight=0.1) == pytest.approx(1.1)
