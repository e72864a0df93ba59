"""torchrun for the launches this project starts itself (matrix.py, speed.py above one rank).

The same launcher, but where a rank failed or a signal reached it, its own report (a Python traceback and a
block of failures) becomes one line, and its exit code is the first failed rank's: the ranks have already
said why, in their own one line (a refusal keeps its exit code 2, an interrupt 130).
``python3 -m fsdp2bench.processes.torchrun <torchrun's arguments>``.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"torchrun: rank {rank} ended with exit code {failure.exitcode}", file=sys.stderr)
        return failure.exitcode if 0 < failure.exitcode < 256 else 128 - failure.exitcode if failure.exitcode < 0 \
            else 1
    except SignalException as exc:
        print(f"torchrun: stopped by {exc.sigval.name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # Ctrl-C before torchrun takes its signals over (while torch is imported)
        print("torchrun: stopped by SIGINT", file=sys.stderr)
        sys.exit(130)
