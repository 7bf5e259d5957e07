"""Progress on long work: a live line on a terminal, one line per milestone otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("scalelab.progress")
LOG_EVERY_S = 10.0
TICK_EVERY_S = 3.0  # tick()'s default: a step list that finishes sooner prints nothing


class Progress:
    """Rank 0 reports; other ranks stay quiet (enabled=False)."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.label = label
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self._last = 0.0
        self.what, self.done = "", 0  # the step just finished and its count (step())

    def update(self, done: int, **fields: float) -> None:
        """The live line on a terminal; in a log (not a terminal) a line every LOG_EVERY_S
        seconds, so a long epoch is not silent."""
        if not (self.enabled and log.isEnabledFor(logging.INFO)):
            return
        now = time.perf_counter()
        if not self.tty:
            if now - max(self.start, self._last) >= LOG_EVERY_S and done < self.total:
                self._last = now
                self.milestone(done, **fields)
            return
        if now - self._last < 0.2 and done < self.total:
            return
        self._last = now
        sys.stderr.write("\r" + self._line(done, fields) + "\033[K")
        sys.stderr.flush()

    def milestone(self, done: int, **fields: float) -> None:
        """Always printed (e.g. once per epoch), so logs of non-interactive runs show progress."""
        if not (self.enabled and log.isEnabledFor(logging.INFO)):  # -q: warnings only
            return
        line = self._line(done, fields)
        self._last = time.perf_counter()
        sys.stderr.write(f"\r{line}\033[K\n" if self.tty else f"{line}\n")
        sys.stderr.flush()

    def tick(self, done: int, every_s: float | None = None) -> None:
        """For loops that are usually fast: the live line on a terminal; in a log, a line
        only once `every_s` (default TICK_EVERY_S) seconds passed since the start or the last
        line (a slow run shows progress, a fast one prints nothing)."""
        every_s = TICK_EVERY_S if every_s is None else every_s
        if self.tty:
            self.update(done)
            return
        now = time.perf_counter()
        if now - max(self.start, self._last) >= every_s or (done == self.total and self._last):
            self._last = now
            self.milestone(done)

    def step(self, what: str) -> None:
        """tick() after the next named step of a list: '<label>: <what> done, i/n ...'."""
        self.what, self.done = what, self.done + 1
        if self.tty and self.done >= self.total:
            self.milestone(self.done)  # ends the live line, so stdout starts on its own line
        else:
            self.tick(self.done)

    def _line(self, done: int, fields: dict[str, float]) -> str:
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done) if done else float("nan")
        extra = " ".join(f"{k}={v:.4g}" for k, v in fields.items())
        label = f"{self.label}: {self.what} done," if self.what else self.label
        head = f"{label} {done}/{self.total}" + (f" {extra}" if extra else "")
        return f"{head} elapsed={elapsed:.1f}s eta={eta:.1f}s"
