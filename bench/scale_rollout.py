"""Benchmark: the Ray rollout engine vs ``local``, and 1 vs 2 Ray workers, measured side by side.

Same held-out-style problems, same HF model (``models/base`` if built, else the quick profile's
tiny model), greedy decoding, the KV-cache policy the stages use. Three runs back to back:

* ``local``  -- ``rollout.engine: local``: build the policy in this process, run the engine;
* ``ray x1`` -- one Ray actor with the same threads: actor start + policy load + the shard;
* ``ray x2`` -- two actors, one shard each.

The Ray instance is started before the clock (on a cluster it is already running); actor start and
model loading are inside the Ray timings, as model loading is inside ``local``'s. The script checks
that all three produced identical transcripts, then prints episodes/s and the ratios; the last line
is ``overhead <ray x1 time / local time>`` (target <= 1.15).

    python bench/scale_rollout.py                 # 24 problems, models/base
    python bench/scale_rollout.py --problems 8    # 8 problems, models/base (what `make bench` runs)
    python bench/scale_rollout.py --quick         # 8 problems, tiny model: a smoke check

Without Ray (``pip install -e '.[ray]'``) it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from apprentice.config import RayConfig  # noqa: E402
from apprentice.envs import FAMILIES  # noqa: E402
from apprentice.infra import distributed  # noqa: E402


class Factory:
    """Builds the stages' policy (CachedHFPolicy) in whichever process calls it."""

    def __init__(self, model: str, max_new_tokens: int, batch_size: int, threads: int) -> None:
        self.model, self.max_new_tokens, self.batch_size, self.threads = model, max_new_tokens, batch_size, threads

    def __call__(self):
        import torch

        from apprentice.policies.hf import HFPolicy
        from apprentice.policies.hf_cached import CachedHFPolicy

        torch.set_num_threads(self.threads)
        pol = HFPolicy(self.model, max_new_tokens=self.max_new_tokens, batch_size=self.batch_size, dtype="fp32",
                       chat_template="compact")
        return CachedHFPolicy.from_policy(pol)


def transcript(trajs) -> list:
    return [(t.problem_id, t.sample_idx, t.messages, t.reward) for t in trajs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problems", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads of local and of each Ray actor")
    p.add_argument("--model", default="")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    try:
        import ray
    except ImportError:
        print("scale_rollout: skipped, Ray is not installed (pip install -e '.[ray]')")
        return 0
    n = 8 if a.quick else a.problems
    model = a.model or str(ROOT / ("models/base" if (ROOT / "models/base/config.json").exists() and not a.quick
                                   else "models/tiny"))
    if not (Path(model) / "config.json").exists():
        print(f"{model} holds no model: run `python -m apprentice prepare-base` "
              f"({'--profile quick ' if 'tiny' in model else ''}first)", file=sys.stderr)
        return 2
    fams = ("grid", "search")
    specs = [FAMILIES[fams[i % 2]].generate(1000 + i, i % 3) for i in range(n)]
    factory = Factory(model, a.max_new_tokens, a.batch_size, a.threads)
    kw = dict(max_turns=3, batch_size=a.batch_size, progress=False, max_format_errors=2)
    print(f"{n} problems, model {model}, max_new_tokens {a.max_new_tokens}, {a.threads} thread(s) per process")

    ray.init(num_cpus=2 * a.threads, include_dashboard=False, log_to_driver=False)
    try:
        t0 = time.perf_counter()
        pol = factory()
        t_load = time.perf_counter() - t0
        local = distributed.run_episodes(specs, pol, engine="local", **kw)
        t_local = time.perf_counter() - t0
        times, outs, parts = {}, {}, {}
        for w in (1, 2):
            t0 = time.perf_counter()
            runner = distributed.RayRollout(RayConfig(workers=w, threads_per_worker=a.threads))
            outs[w] = runner.run(specs, factory, progress=False, **{k: v for k, v in kw.items() if k != "progress"})
            times[w] = time.perf_counter() - t0
            parts[w] = runner.timings
    finally:
        ray.shutdown()
    same = all(transcript(outs[w]) == transcript(local) for w in (1, 2))
    print(f"identical transcripts (local, ray x1, ray x2): {same}")
    print(f"local   {t_local:7.1f} s  {n / t_local:6.2f} episodes/s  (model load {t_load:.1f} s, "
          f"episodes {t_local - t_load:.1f} s)")
    for w in (1, 2):
        t = parts[w]
        build = max(x["build_s"] for x in t["actors"])
        eps = max(x["episodes_s"] for x in t["actors"])
        print(f"ray x{w}  {times[w]:7.1f} s  {n / times[w]:6.2f} episodes/s  (connect {t['connect_s']:.1f} s, actor start "
              f"{t['actors_ready_s'] - build:.1f} s, model load in actor {build:.1f} s, episodes {eps:.1f} s, "
              f"object store + scheduling {t['gather_s'] - eps:.1f} s)")
    print(f"speedup 2 vs 1 workers {times[1] / times[2]:.2f}")
    print(f"overhead {times[1] / t_local:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
