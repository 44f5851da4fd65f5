"""Progress bars for long work (rich); silent when disabled or not on a terminal-like stream."""

from __future__ import annotations

from collections.abc import Iterator

from rich.progress import (
  BarColumn,
  MofNCompleteColumn,
  Progress,
  TextColumn,
  TimeElapsedColumn,
  TimeRemainingColumn,
)


def make_progress(enabled: bool = True) -> Progress:
  return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), disable=not enabled,
                  transient=False)


def progress_range(n: int, description: str, *, enabled: bool = True) -> Iterator[int]:
  with make_progress(enabled) as p:
    task = p.add_task(description, total=n)
    for i in range(n):
      yield i
      p.advance(task)
