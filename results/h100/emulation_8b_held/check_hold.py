"""The emulation's hold kernel on this GPU: it lasts the time asked, leaves the buffer's values as they were, moves
the bytes asked, and what it takes from GEMMs and a memory-bound op beside it (against the sleep it replaces)."""
import json
import torch
from fsdp2bench.processes.emulation import Wait, cycles_per_second
from fsdp2bench.processes.hold import hold_kernel


def timed(fn, reps=3):
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); s.record(); fn(); e.record(); e.synchronize()
        out.append(s.elapsed_time(e))
    return sorted(out)[len(out) // 2]


dev = torch.device("cuda")
kernel = hold_kernel()
held = Wait(cycles_per_second(dev), 16, kernel)
slept = Wait(cycles_per_second(dev), 0, None)
buf = torch.randn(128 * 2**20, device=dev, dtype=torch.bfloat16)  # 256 MiB: past the L2
before = buf.clone()
report = {}
for wire_gb in (0.0, 0.37, 1.0):
    report[f"hold 10 ms, {wire_gb} GB through 256 MiB"] = timed(lambda: held(0.010, buf, int(wire_gb * 1e9)))
report["values unchanged"] = bool(torch.equal(buf, before))
report["hold 10 ms, odd-sized byte buffer"] = timed(lambda: held(0.010, torch.zeros(1001, dtype=torch.uint8, device=dev), 4000))
a = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
b = torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16)
big = torch.randn(256 * 2**20, device=dev, dtype=torch.bfloat16)
side = torch.cuda.Stream()
work = {"gemm": lambda: [a @ b for _ in range(20)], "elementwise": lambda: [big.mul_(1.0) for _ in range(40)]}
for name, fn in work.items():
    fn(); alone = timed(fn)
    report[f"{name} alone ms"] = alone
    seconds = alone * 1.5e-3
    for label, wait, rate in (("sleep", slept, 0), ("hold, no bytes", held, 0), ("hold at 370 GB/s", held, 370e9)):
        def both():
            with torch.cuda.stream(side):
                wait(seconds, buf, int(rate * seconds))
            fn()
        both(); torch.cuda.synchronize()
        report[f"{name} beside {label} ms"] = timed(both)
print(json.dumps(report, indent=1))
