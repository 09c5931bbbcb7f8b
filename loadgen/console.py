"""A one-line progress bar on stderr (the CLI decides whether to show it)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    def __init__(self, label: str, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.label = label
        self.stream = stream
        self.width = width
        self._started = time.monotonic()

    def __call__(self, done: int, failed: int, total: int) -> None:
        filled = self.width * done // max(total, 1)
        elapsed = time.monotonic() - self._started
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total} failed={failed} {elapsed:6.1f}s")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()
