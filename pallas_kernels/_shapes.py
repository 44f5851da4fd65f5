"""Integer shape helpers shared by the kernels' wrappers (static Python ints, not traced)."""


def is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def cdiv(n: int, m: int) -> int:
  return -(-n // m)
