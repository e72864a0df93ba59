"""One live line per running variant on rank 0: where it is, its loss and memory, and the time left.

On a terminal it is a tqdm bar (one row per variant running at the same time). Elsewhere (CI, a
pipe, a cluster log) a plain line every 10% of the steps or every 30 s, and after the first step,
whose time gives the first estimate of the whole run: no carriage-return noise in a log.
"""

from __future__ import annotations

import statistics
import sys
import time

PLAIN_EVERY_S = 30.0


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """Fed once per step by the child of rank 0; silent everywhere else and under ``--quiet``."""

    def __init__(self, label: str, total: int, position: int, enabled: bool):
        self.label, self.total, self.enabled = label, total, enabled
        self.times: list[float] = []
        self.next_fraction, self.last_print = 0.1, time.monotonic()
        self.bar = None
        if enabled and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, position=position, leave=True, dynamic_ncols=True)

    def update(self, step: int, loss: float | None, peak_mib: float | None, step_time: float) -> None:
        if not self.enabled:
            return
        self.times.append(step_time)
        done = step + 1
        median = statistics.median(self.times)
        text = (f"loss {'n/a' if loss is None else f'{loss:.4f}'}, "
                f"peak {'n/a' if peak_mib is None else f'{peak_mib:.0f} MiB'}, {median:.3f} s/step, "
                f"{_duration(median * (self.total - done))} left")
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        elif done == 1 or done == self.total or done >= self.next_fraction * self.total or \
                time.monotonic() - self.last_print >= PLAIN_EVERY_S:
            print(f"[{self.label}] step {done}/{self.total}: {text}", flush=True)
            self.last_print = time.monotonic()
            while self.next_fraction * self.total <= done:
                self.next_fraction += 0.1

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
