"""How much slower this CPU's fp32 kernels get when oneDNN, MKL and ATen are capped at AVX2.

Why: the project's time budget is set on 2-core AMD EPYC machines with AVX2 only, and the
machine at hand may be an AVX-512 / AMX Xeon. Capping the instruction set is the nearest proxy for an
AVX2 machine one can run here; this bench says how far the cap moves the kernels generation spends
its time in (a decode step's linear layer and its attention over the cache, a prefill-sized matmul),
so a stage timed under the cap can be read with that in mind. It does not model the other machine's
clock, caches or memory bandwidth.

    python bench/isa_cap.py            # each kernel uncapped and capped, side by side, and the ratio
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CAP = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}

KERNELS = r"""
import json, time, torch
import torch.nn.functional as F
torch.manual_seed(0)
def ms(f, n):
    for _ in range(5): f()
    s = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - s) / n * 1e3
x = torch.randn(64, 576); w = torch.randn(1536, 576); xp = torch.randn(1024, 576)
q = torch.randn(64, 3, 3, 64); k = torch.randn(64, 3, 600, 64); v = torch.randn(64, 3, 600, 64)
print(json.dumps({"isa": torch.backends.cpu.get_cpu_capability(),
    "decode linear 64x576->1536": ms(lambda: F.linear(x, w), 200),
    "decode attention 64 rows x 600 cached": ms(lambda: F.scaled_dot_product_attention(q, k, v), 100),
    "prefill linear 1024x576->1536": ms(lambda: F.linear(xp, w), 50)}))
"""


def run(cap: bool) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in CAP}  # a cap in the caller's env must not leak into the baseline
    out = subprocess.run([sys.executable, "-c", KERNELS], env={**env, **(CAP if cap else {})}, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    base, capped, base2 = run(False), run(True), run(False)  # A-B-A: the machine drifts
    print(f"kernel ms, fp32, {base['isa']} vs {capped['isa']} (A-B-A)")
    for name in (k for k in base if k != "isa"):
        a = (base[name] + base2[name]) / 2
        print(f"  {name:40s} {base[name]:7.3f} / {base2[name]:7.3f}  vs {capped[name]:7.3f}   capped/uncapped {capped[name] / a:.2f}x")


if __name__ == "__main__":
    main()
