"""How much a kernel that holds k CTAs for a set time slows the compute beside it (GEMMs, a memory-bound op)."""
import sys, json, time
import torch, triton, triton.language as tl

@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

@triton.jit
def spin(duration_ns):
    start = _now()
    now = start
    while now - start < duration_ns:
        now = _now()

@triton.jit
def paced_copy(buf, n_per_prog, duration_ns, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = _now()
    chunks = n_per_prog // BLOCK
    base = pid.to(tl.int64) * n_per_prog
    i = 0
    while i < chunks:
        target = start + (i * duration_ns) // chunks
        now = _now()
        while now < target:
            now = _now()
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(buf + offs)
        tl.store(buf + offs, x + 1)
        i += 1
    now = _now()
    while now - start < duration_ns:
        now = _now()

def timed(fn, reps=3):
    best = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); s.record(); fn(); e.record(); e.synchronize()
        best.append(s.elapsed_time(e))
    return sorted(best)[len(best) // 2]

dev = torch.device("cuda")
a = torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16)
b = torch.randn(4096, 14336, device=dev, dtype=torch.bfloat16)
big = torch.randn(512 * 2**20 // 2, device=dev, dtype=torch.bfloat16)
buf = torch.zeros(256 * 2**20 // 2, device=dev, dtype=torch.bfloat16)
side = torch.cuda.Stream()
def gemms(): 
    for _ in range(20): a @ b
def elementwise():
    for _ in range(40): big.mul_(1.0001)
out = {}
for name, work in (("gemm", gemms), ("elementwise", elementwise)):
    work(); t0 = timed(work)
    out[name] = {"alone_ms": t0}
    dur_ns = int(t0 * 1e6 * 1.5)  # the side kernel outlasts the work
    for warps in (4, 16):
        for k in (1, 8, 16, 24, 32):
            def both():
                with torch.cuda.stream(side):
                    spin[(k,)](dur_ns, num_warps=warps)
                work()
            both(); torch.cuda.synchronize()
            out[name][f"spin k={k} warps={warps}"] = timed(both) / 1  # includes the spinner's tail? no: measured on main stream
    # the current emulation: one sleeping thread
    clock_s = torch.cuda.Event(enable_timing=True)
    for k in (16, 24, 32):
        n = buf.numel()
        # 400 GB/s read+write: bytes moved in the duration
        per = int(400e9 * dur_ns * 1e-9 / 2 / 2 / k) // 1024 * 1024
        per = min(per, n // k // 1024 * 1024)
        def both():
            with torch.cuda.stream(side):
                paced_copy[(k,)](buf, per, dur_ns, BLOCK=1024, num_warps=16)
            work()
        both(); torch.cuda.synchronize()
        out[name][f"paced copy k={k} {per*k*2*2/dur_ns:.0f} GB/s"] = timed(both)
    def both():
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(2e9 * dur_ns * 1e-9))
        work()
    out[name]["torch.cuda._sleep"] = timed(both)
print(json.dumps(out, indent=1))
# the spin kernel's own duration alone, to check it waits as asked
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record(); spin[(24,)](10_000_000, num_warps=16); e.record(); e.synchronize()
print("spin 10 ms alone:", s.elapsed_time(e), "ms")
