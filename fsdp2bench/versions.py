"""The releases of accelerate and transformers the benchmark is tested with (requirements.txt says the
same), and why the range starts where it does. A release outside it is refused in one line: the
figures measure these libraries, and an untested release may measure something else without a word."""

from __future__ import annotations

import os
import re
from importlib.metadata import PackageNotFoundError, version

from fsdp2bench.cli import UserError

# library: (lowest supported, newest tested, why nothing below the lowest)
TESTED = {
    "accelerate": ("1.11.0", "1.15.0", "1.10 reduce-scatters every microbatch under FSDP2 whatever sync_each_batch "
                                       "says: its accumulate() leaves gradient sync on"),
    "transformers": ("5.1.0", "5.24.0", "5.0.0 builds a model whose config ties lm_head to the embeddings with an "
                                        "lm_head of its own, so its state is not what the sharding rule counts"),
}
ANY_RELEASE = "FSDP2_BENCH_ANY_RELEASE"  # =1: run outside the range anyway (its figures are then untested)


def _release(text: str) -> tuple[int, ...]:
    """"5.17.0" as (5, 17, 0); a suffix ("5.18.0.dev0", "1.15.0rc1") counts as the release it precedes."""
    numbers = []
    for part in text.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.group() != part:  # "0rc1": the pre-release ends the release's numbers
            break
    return tuple(numbers)


def check_releases() -> None:
    """Refuse, in one line naming the range and the reason, a release the benchmark was not tested with."""
    if os.environ.get(ANY_RELEASE) == "1":
        return
    for library, (lowest, newest, why) in TESTED.items():
        try:
            installed = version(library)
        except PackageNotFoundError:
            raise UserError(f"{library} is not installed: pip install -r requirements.txt") from None
        if _release(installed) < _release(lowest):
            reason = why
        elif _release(installed) > _release(newest):
            reason = f"{newest} is the newest the benchmark was tested with"
        else:
            continue
        raise UserError(f"{library} {installed} is outside the tested range {lowest} to {newest} ({reason}); "
                        f"pip install -r requirements.txt, or set {ANY_RELEASE}=1 to run with it anyway")
