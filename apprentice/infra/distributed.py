"""Episodes on Ray: the same rollout engine, sharded over actors that each hold one policy replica.

Why Ray and not a scheduler of our own: the frameworks users outgrow one machine into (verl,
OpenRLHF, SkyRL, NeMo-RL) all put rollouts on Ray, so a cluster they already run can take ours.
Why wrap :func:`apprentice.rollout.episodes.run_episodes` instead of distributing inside it: the engine stays
the single implementation of an episode (batching, budgets, parse errors), ``local`` stays a plain
call, and each actor runs that very function on its shard, so greedy results are
byte-identical to ``local``.

``run_episodes(specs, policy, engine=..., ray=..., **engine_kwargs)``:

* ``engine="local"``: builds the policy (``policy`` may be a factory) and calls the engine.
* ``engine="ray"``: splits the problems into ``workers * shards_per_worker`` contiguous shards (all
  samples of one problem stay together), starts ``workers`` actors that each build the policy once
  (an HF model, an OpenAI-compatible client, the oracle, or an in-memory model shipped through the
  object store), runs the shards and concatenates them in shard order: problem order, then sample
  index, as ``local`` returns them.
* Fault tolerance is Ray's own: actors are created with ``max_restarts`` and ``max_task_retries``, so
  an actor process that dies mid-shard is restarted (its constructor reloads the policy) and the
  shard reruns from its start. A shard's result is returned whole or not at all, so episodes are
  never lost or duplicated.
* ``ray.address`` unreachable: one :class:`RayUnavailable` error within ``connect_timeout_s``,
  naming the address and the fix (instead of Ray's minute-long connection retries).

``on_finish`` (a callback per finished episode, :func:`apprentice.rollout.episodes.run_episodes`):
``local`` calls it the moment each episode finishes; ``ray`` keeps shard granularity, calling it for
each episode once the whole run has returned (an actor's process cannot call back into the driver's
open files), so a killed driver loses the episodes of that run.

Sampling seeds: shard ``i`` runs with ``seed + i``, so a rerun shard and a rerun with the same
worker count reproduce the same episodes; greedy decoding ignores the seed.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from apprentice.data.trajectories import Trajectory, specs_of
from apprentice.envs import ProblemSpec
from apprentice.rollout import episodes as rollout

if TYPE_CHECKING:
    from apprentice.config import RayConfig

log = logging.getLogger(__name__)

ENGINES = ("local", "ray")
RAY_EXTRA_HINT = "pip install -e '.[ray]'  (make setup installs it)"


class RayUnavailable(RuntimeError):
    """``rollout.engine: ray`` cannot start or reach its cluster; the message says how to fix it."""


def run_episodes(
    specs: Sequence[ProblemSpec] | pd.DataFrame,
    policy: Any,
    *,
    engine: str = "local",
    ray: RayConfig | None = None,
    levels: Sequence[int] | Mapping[str, int] | None = None,
    progress: bool = True,
    seed: int = 0,
    on_finish: Callable[[Trajectory], None] | None = None,
    **engine_kwargs: Any,
) -> list[Trajectory]:
    """:func:`apprentice.rollout.episodes.run_episodes` on ``engine``; ``policy`` is a Policy or a zero-argument
    factory returning one (a factory lets each Ray actor build its own replica instead of shipping a
    built one). ``engine_kwargs`` go to the engine unchanged (samples_per_problem, batch_size, ...).
    ``on_finish`` gets each finished episode: as it finishes on ``local``, after the run on ``ray``."""
    if engine not in ENGINES:
        raise ValueError(f"rollout.engine must be one of {ENGINES}, got {engine!r}")
    if engine == "local":
        pol = policy() if _is_factory(policy) else policy
        return rollout.run_episodes(specs, pol, levels=levels, progress=progress, seed=seed, on_finish=on_finish,
                                    **engine_kwargs)
    from apprentice.config import RayConfig

    out = RayRollout(ray or RayConfig()).run(specs, policy, levels=levels, progress=progress, seed=seed,
                                              **engine_kwargs)
    if on_finish is not None:
        for t in out:
            on_finish(t)
    return out


def _is_factory(policy: Any) -> bool:
    """A class or a function that builds a policy (a built policy has a bound ``act``)."""
    return callable(policy) and (isinstance(policy, type) or not hasattr(policy, "act"))


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous, non-empty [start, end) ranges covering 0..n, sizes differing by at most 1."""
    shards = max(1, min(shards, n))
    q, r = divmod(n, shards)
    out, start = [], 0
    for i in range(shards):
        end = start + q + (1 if i < r else 0)
        out.append((start, end))
        start = end
    return out


def _levels_list(specs: list[ProblemSpec], levels: Sequence[int] | Mapping[str, int] | None) -> list[int] | None:
    if levels is None:
        return None
    if isinstance(levels, Mapping):
        return [int(levels.get(s.problem_id, 0)) for s in specs]
    return [int(x) for x in levels]


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayUnavailable(f"rollout.engine=ray needs the 'ray' package: {RAY_EXTRA_HINT}; "
                             "or set rollout.engine=local") from None
    return ray


def check_reachable(address: str, timeout_s: float) -> None:
    """Fail fast (one TCP connect) when ``address`` names a host:port nobody listens on."""
    if address in ("", "local", "auto"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise RayUnavailable(f"ray.address={address!r} is not 'local', 'auto', host:port or ray://host:port; "
                             "fix it in params.yaml or with --set ray.address=...")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise RayUnavailable(
            f"cannot reach the Ray cluster at ray.address={address!r} ({type(e).__name__}: {e}). Start one with "
            f"`ray start --head --port {port}` on {host} (workers join with `ray start --address {host}:{port}`), "
            "or set ray.address=local to start a private one, or rollout.engine=local") from None


class _Worker:
    """A Ray actor: one policy replica, runs shards with the local engine."""

    def __init__(self, factory: Any, threads: int) -> None:
        import sys

        t0 = time.perf_counter()
        self.policy = factory() if _is_factory(factory) else factory
        self.build_s = time.perf_counter() - t0
        self.episodes_s = 0.0
        if "torch" in sys.modules:  # a model policy: generation uses exactly the CPUs Ray reserved
            sys.modules["torch"].set_num_threads(max(1, threads))

    def pid(self) -> int:
        return os.getpid()

    def timings(self) -> dict[str, float]:
        """Seconds this actor spent building its policy (model load) and playing episodes."""
        return {"build_s": self.build_s, "episodes_s": self.episodes_s}

    def run(self, specs: list[ProblemSpec], levels: list[int] | None, seed: int,
            kwargs: dict[str, Any]) -> list[Trajectory]:
        t0 = time.perf_counter()
        out = rollout.run_episodes(specs, self.policy, levels=levels, seed=seed, progress=False, **kwargs)
        self.episodes_s += time.perf_counter() - t0
        return out


class RayRollout:
    """Runs shards of episodes over ``cfg.workers`` Ray actors (see the module docstring)."""

    def __init__(self, cfg: RayConfig) -> None:
        self.cfg = cfg
        self.actors: list[Any] = []
        self._policy_ref: Any = None
        #: where the last :meth:`run` spent its time (seconds): connect, actors_ready (actor processes
        #: started and policies built), gather (episodes + results through the object store), and per
        #: actor the model load and the episodes themselves
        self.timings: dict[str, Any] = {}

    # -- cluster ------------------------------------------------------------------------------------
    def connect(self) -> bool:
        """Initialise Ray (unless already); returns True if this call started it (then it shuts it down)."""
        ray = import_ray()
        c = self.cfg
        check_reachable(c.address, c.connect_timeout_s)
        if ray.is_initialized():
            return False
        env = {k: v for k, v in os.environ.items()
               if k in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "TRL_EXPERIMENTAL_SILENCE")}
        kw: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True, ignore_reinit_error=True,
                                  runtime_env={"env_vars": env} if env else None)
        if c.address == "local":
            # address="local": a new private instance even inside a Ray worker (where RAY_ADDRESS is set)
            kw.update(address="local", num_cpus=c.workers * c.threads_per_worker,
                      num_gpus=math.ceil(c.workers * c.gpus_per_worker))
        else:
            kw["address"] = c.address
        os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")  # default 30 s: too short on a busy node
        try:
            ray.init(**kw)
        except (ConnectionError, TimeoutError, RuntimeError) as e:
            raise RayUnavailable(f"could not connect to the Ray cluster at ray.address={c.address!r}: {e}. "
                                 "Check `ray status` there, or set ray.address=local / rollout.engine=local") from None
        return True

    def start_actors(self, policy: Any) -> list[Any]:
        ray = import_ray()
        c = self.cfg
        remote = ray.remote(_Worker).options(
            num_cpus=c.threads_per_worker, num_gpus=c.gpus_per_worker,
            max_restarts=c.max_restarts, max_task_retries=c.max_restarts)
        # one copy in the object store, not one per actor; held until the run ends so that a restarted
        # actor can rebuild its replica from it
        self._policy_ref = ray.put(policy)
        self.actors = [remote.remote(self._policy_ref, c.threads_per_worker) for _ in range(c.workers)]
        return self.actors

    # -- episodes -----------------------------------------------------------------------------------
    def run(self, specs: Sequence[ProblemSpec] | pd.DataFrame, policy: Any, *, levels: Any = None,
            progress: bool = True, seed: int = 0, **kwargs: Any) -> list[Trajectory]:
        if isinstance(specs, pd.DataFrame):
            if levels is None and "level" in specs.columns:
                levels = [int(x) for x in specs["level"]]
            specs = specs_of(specs)
        specs = list(specs)
        lv = _levels_list(specs, levels)
        if not specs:
            return []
        ray = import_ray()
        t0 = time.perf_counter()
        started = self.connect()
        try:
            t1 = time.perf_counter()
            actors = self.start_actors(policy)
            ray.get([a.pid.remote() for a in actors])  # started, policy built
            t2 = time.perf_counter()
            bounds = shard_bounds(len(specs), self.cfg.workers * self.cfg.shards_per_worker)
            futures = [actors[i % len(actors)].run.remote(specs[a:b], lv[a:b] if lv is not None else None,
                                                         seed + i, kwargs)
                       for i, (a, b) in enumerate(bounds)]
            results = self._gather(ray, futures, bounds, kwargs.get("samples_per_problem", 1), progress)
            t3 = time.perf_counter()
            self.timings = {"connect_s": t1 - t0, "actors_ready_s": t2 - t1, "gather_s": t3 - t2,
                            "actors": ray.get([a.timings.remote() for a in actors])}
            log.info("ray rollout timings: %s", self.timings)
        finally:
            for a in self.actors:
                ray.kill(a)
            self.actors, self._policy_ref = [], None
            if started:
                ray.shutdown()
        return [t for shard in results for t in shard]

    def _gather(self, ray: Any, futures: list[Any], bounds: list[tuple[int, int]], samples: int,
                progress: bool) -> list[list[Trajectory]]:
        from tqdm.auto import tqdm

        index = {f: i for i, f in enumerate(futures)}
        results: list[list[Trajectory] | None] = [None] * len(futures)
        total = bounds[-1][1] * samples
        bar = tqdm(total=total, desc=f"rollout on ray ({self.cfg.workers} workers, {len(futures)} shards)",
                   unit="ep", disable=not progress, dynamic_ncols=True)
        t0, pending = time.perf_counter(), list(futures)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                i = index[ready[0]]
                try:
                    results[i] = ray.get(ready[0])
                except ray.exceptions.RayActorError as e:
                    raise RuntimeError(
                        f"rollout shard {i} failed: its Ray actor died more than ray.max_restarts="
                        f"{self.cfg.max_restarts} times or could not build its policy ({e}). Raise "
                        "ray.max_restarts, give workers more memory, or check the model path exists on every node"
                    ) from e
                bar.update(len(results[i] or []))
            log.info("ray rollout: %d episodes in %.1f s", total, time.perf_counter() - t0)
        finally:
            bar.close()
        return [r or [] for r in results]
