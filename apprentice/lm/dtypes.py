"""What ``model.dtype: auto`` means on a CPU: bf16 autocast only where a measurement says it pays.

Why a measurement and not the CPU flags alone: ``amx_bf16`` / ``avx512_bf16`` say the instructions
exist, not that torch's kernels use them for this model's shapes (a VM may hide AMX tiles, an old
oneDNN may not dispatch to them), and bf16 autocast also runs on AVX2-only CPUs, emulated and slower.
So ``auto`` times the 135M model's own matmul shapes (a SmolLM2 MLP block: 576 -> 1536 -> 576, a
training-sized batch and a decode-sized one) in fp32 and under bf16 autocast, and picks bf16 when

* it is at least :data:`MIN_SPEEDUP` x faster (a wide margin: native bf16 kernels win by far more,
  emulated ones lose), timed on one thread by that thread's CPU time, so other jobs on the machine
  cannot flip the decision (:func:`measure` says why), and
* its outputs stay within :data:`MAX_REL_ERROR` of fp32's (relative Frobenius error; bf16 rounding
  gives ~4e-3, a broken kernel gives O(1)).

The end-to-end tolerance (bf16 vs fp32 on a real model: SFT loss, next-token log-probs, greedy
actions) is checked by ``tests/integration/test_dtypes.py`` and printed by ``bench/dtype.py``.

The decision is cached per machine (CPU model, flags, torch version, threads) in
``<cache>/dtype-auto.json``, so every stage of a run, and every later run, resolves ``auto`` the same
way: a seeded run reproduces in its own dtype. ``APPRENTICE_AUTO_DTYPE=bf16|fp32`` overrides it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

#: bf16 must be at least this much faster than fp32 on the probe
MIN_SPEEDUP = 1.25
#: and its outputs within this relative error of fp32's
MAX_REL_ERROR = 2e-2
#: bumped when the probe changes, so a decision cached by an older probe is measured again (2: one
#: thread, CPU time; 1: all threads, wall clock, which a loaded machine could flip)
PROBE_VERSION = 2
#: SmolLM2-135M's MLP: hidden 576, intermediate 1536
_HIDDEN, _INTER = 576, 1536
_SHAPES = ((4, 64), (32, 1))  # (batch, tokens): a training/prefill batch, a decode step at batch 32


@dataclass(frozen=True)
class Probe:
    dtype: str  # "bf16" or "fp32": what auto resolves to
    speedup: float  # fp32 time / bf16 time on the probe
    rel_error: float
    machine: str
    source: str = "measured"  # "measured", "cache" or "env"

    def line(self) -> str:
        return (f"dtype auto -> {self.dtype} (bf16 autocast {self.speedup:.2f}x fp32 on this CPU, rel. error "
                f"{self.rel_error:.1e}; bf16 needs >= {MIN_SPEEDUP}x and <= {MAX_REL_ERROR:.0e}; {self.source})")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    line = next((ln for ln in text.splitlines() if ln.startswith("model name")), "")
    return line.partition(":")[2].strip() or platform.machine()


def machine_key() -> str:
    """What the decision depends on: the CPU, its flags, torch's build and the thread count."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    return f"{cpu_model()}|flags:{flags}|torch:{torch.__version__}|threads:{torch.get_num_threads()}|probe:{PROBE_VERSION}"


def measure(reps: int = 5) -> tuple[float, float]:
    """(fp32 time / bf16 time, relative error of bf16) on the probe shapes.

    Robust to other processes on the cores: timed on all threads by the wall clock, a loaded
    machine makes bf16 look slower than fp32 even where it is faster (one thread descheduled stalls
    the others at every barrier), and the wrong decision would be cached for the machine. So the
    probe runs on **one thread** and reads **that thread's CPU time** (the kernels' speed, not the
    machine's load); after a warm-up round it times ``_UNIT`` blocks per dtype in A-B-B-A order for
    each of ``reps`` rounds and takes the *median* per-round ratio. Under ``no_grad``, as generation
    runs (:func:`apprentice.lm.modeling.generation`)."""
    g = torch.Generator().manual_seed(0)
    up = torch.nn.Linear(_HIDDEN, _INTER, bias=False)
    down = torch.nn.Linear(_INTER, _HIDDEN, bias=False)
    with torch.no_grad():
        for lin in (up, down):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * lin.in_features ** -0.5)

    def block(x: torch.Tensor) -> torch.Tensor:
        return down(torch.nn.functional.silu(up(x)))

    xs = [torch.randn(b, t, _HIDDEN, generator=g) for b, t in _SHAPES]
    outs: dict[str, list[torch.Tensor]] = {}

    def timed(name: str) -> float:
        t0 = time.thread_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=name == "bf16"):
            for _ in range(_UNIT):
                outs[name] = [block(x) for x in xs]
        return time.thread_time() - t0

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ratios = _rounds(timed, reps)
    finally:
        torch.set_num_threads(threads)
    err = max(float((o.float() - r).norm() / r.norm()) for o, r in zip(outs["bf16"], outs["fp32"], strict=True))
    return float(statistics.median(ratios)), err


def _rounds(timed: Callable[[str], float], reps: int) -> list[float]:
    ratios = []
    with torch.no_grad():
        timed("fp32"), timed("bf16")  # warm-up: kernel selection, first-touch pages
        for _ in range(max(reps, 1)):
            a1, b1, b2, a2 = timed("fp32"), timed("bf16"), timed("bf16"), timed("fp32")
            ratios.append((a1 + a2) / (b1 + b2))
    return ratios


#: probe blocks per timing (long enough for a scheduler tick to average out)
_UNIT = 8


def _cache_file() -> Path:
    from apprentice.lm.modeling import default_cache_dir

    return default_cache_dir() / "dtype-auto.json"


@functools.cache
def cpu_auto() -> Probe:
    """The measured (or cached) meaning of ``auto`` on this CPU; says it once per process (stderr)."""
    probe = _decide()
    print(probe.line(), file=sys.stderr)
    return probe


def _decide() -> Probe:
    key = machine_key()
    forced = os.environ.get("APPRENTICE_AUTO_DTYPE", "").strip().lower()
    if forced:
        if forced not in ("bf16", "fp32"):
            raise ValueError(f"APPRENTICE_AUTO_DTYPE must be 'bf16' or 'fp32', not {forced!r}")
        return Probe(forced, 0.0, 0.0, key, "env")
    path = _cache_file()
    try:
        cached = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        cached = None
    if isinstance(cached, dict) and cached.get("dtype") in ("bf16", "fp32"):
        return Probe(cached["dtype"], float(cached["speedup"]), float(cached["rel_error"]), key, "cache")
    speedup, err = measure()
    probe = Probe("bf16" if speedup >= MIN_SPEEDUP and err <= MAX_REL_ERROR else "fp32", round(speedup, 3),
                  float(f"{err:.3g}"), key)
    _store(path, key, probe)
    return probe


def _store(path: Path, key: str, probe: Probe) -> None:
    """Merge this machine's decision into the cache file (atomically: stages may race on a fresh machine)."""
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}  # a corrupt cache is rewritten
    if not isinstance(data, dict):
        data = {}
    try:
        entry = asdict(probe)
        entry.pop("machine"), entry.pop("source")
        data[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the measurement again next time
