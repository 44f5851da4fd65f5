"""Progress for long work that reads well on a terminal and in a log file: a rich progress bar when
stdout is a terminal, otherwise a plain line every ``every`` items (and at the end)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

from rich.progress import (
  BarColumn,
  MofNCompleteColumn,
  Progress,
  TextColumn,
  TimeElapsedColumn,
  TimeRemainingColumn,
)


def is_terminal(stream=None) -> bool:
  stream = sys.stdout if stream is None else stream
  return bool(getattr(stream, "isatty", lambda: False)())


def progress_range(n: int, description: str, *, enabled: bool = True,
                   every: int | None = None) -> Iterator[int]:
  """range(n) with progress: a bar on a terminal, else a line ``description: i/n (s)`` every
  ``every`` items (default: about 10 lines in all). Silent when not enabled."""
  if not enabled:
    yield from range(n)
    return
  if is_terminal():
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), transient=False) as p:
      task = p.add_task(description, total=n)
      for i in range(n):
        yield i
        p.advance(task)
    return
  every = every or max(1, n // 10)
  t0 = time.perf_counter()
  for i in range(n):
    yield i
    if (i + 1) % every == 0 or i + 1 == n:
      print(f"{description}: {i + 1}/{n} ({time.perf_counter() - t0:.1f} s)", flush=True)


def progress_iter(items, description: str, *, enabled: bool = True):
  """Iterate ``items`` (a sequence) with ``progress_range``'s progress display."""
  items = list(items)
  for i in progress_range(len(items), description, enabled=enabled):
    yield items[i]
