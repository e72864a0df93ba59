"""The releases of accelerate and transformers the benchmark is tested with (requirements.txt says the
same), and why the range starts where it does. A release outside it is refused in one line: the
figures measure these libraries, and an untested release may measure something else without a word.
The release checked, and recorded, is the one imported (``import`` may find a copy earlier on the path
than the one whose metadata pip wrote)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re

from fsdp2bench.cli import UserError, one_line

# library: (lowest supported, newest tested, why nothing below the lowest)
TESTED = {
    "accelerate": ("1.11.0", "1.15.0", "1.10 reduce-scatters every microbatch under FSDP2 whatever sync_each_batch "
                                       "says: its accumulate() leaves gradient sync on"),
    "transformers": ("5.1.0", "5.24.0", "5.0.0 builds a model whose config ties lm_head to the embeddings with an "
                                        "lm_head of its own, so its state is not what the sharding rule counts"),
}
# What the benchmark takes from each (imported by the check: a copy that imports but cannot give them is broken)
USED = {"accelerate": ("Accelerator",), "transformers": ("AutoConfig", "AutoModelForCausalLM")}
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


def imported(library: str) -> tuple[str, str]:
    """(release, directory) of the copy of ``library`` that ``import`` finds, the release read from that module;
    one that is not there, fails to import or gives no release is one line naming it and where it is."""
    try:
        spec = importlib.util.find_spec(library)
    except (ImportError, ValueError) as exc:
        raise UserError(f"{library} cannot be found ({type(exc).__name__}: {one_line(exc)})") from None
    if spec is None:
        raise UserError(f"{library} is not installed: pip install -r requirements.txt")
    where = os.path.dirname(spec.origin) if spec.origin else ", ".join(spec.submodule_search_locations or [])
    try:
        module = importlib.import_module(library)
        for name in USED.get(library, ()):
            getattr(module, name)
    except Exception as exc:  # a copy that is broken: any error its import raises
        raise UserError(f"{library} at {where} cannot be imported ({type(exc).__name__}: {one_line(exc)}); "
                        "pip install -r requirements.txt, or take that copy off the path") from None
    release = getattr(module, "__version__", None)
    if not isinstance(release, str) or not _release(release):
        raise UserError(f"{library} at {where} gives no release (__version__ is {release!r}); pip install -r "
                        "requirements.txt, or take that copy off the path")
    return release, where


def check_releases() -> None:
    """Each library imported (a broken one is refused even with ``ANY_RELEASE``), and a release the benchmark
    was not tested with refused in one line naming the range, the reason and the copy imported."""
    for library, (lowest, newest, why) in TESTED.items():
        installed, where = imported(library)
        if os.environ.get(ANY_RELEASE) == "1":
            continue
        if _release(installed) < _release(lowest):
            reason = why
        elif _release(installed) > _release(newest):
            reason = f"{newest} is the newest the benchmark was tested with"
        else:
            continue
        raise UserError(f"{library} {installed} at {where} is outside the tested range {lowest} to {newest} "
                        f"({reason}); pip install -r requirements.txt, or set {ANY_RELEASE}=1 to run with it anyway")
