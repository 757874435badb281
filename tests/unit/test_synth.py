"""Stages ``benchmark`` + ``synth``: a fixed benchmark, training disjoint from it *by content*,
reproducible (byte-for-byte); idempotent reruns; every spec rebuilds an episode its oracle solves."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from apprentice.config import Config
from apprentice.data.dedupe import spec_content_key as content_key
from apprentice.data.trajectories import PROBLEM_COLUMNS, specs_of
from apprentice.envs import FAMILIES, replay
from apprentice.paths import Paths
from apprentice.stages import benchmark, synth


def _cfg(n_eval: int = 6, **synth_over) -> Config:
    """Round robin over synth.levels in every iteration (the frontier controller off: its mix is tested
    with a frontier record below)."""
    s = {"families": ["grid", "search"], "n_train": 12, "levels": [0, 2], "seed": 3}
    return Config.model_validate({"synth": {**s, **synth_over}, "benchmark": {"n": n_eval, "levels": []},
                                  "frontier": {"mode": "fixed"}})


def _run(cfg: Config, paths: Paths) -> dict:
    benchmark.run(cfg, paths)
    return synth.run(cfg, paths)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    paths = Paths(tmp_path_factory.mktemp("synth_a"), 1)
    return paths, _run(_cfg(), paths)


def test_writes_disjoint_train_and_eval(first_run):
    paths, summary = first_run
    train, ev = pd.read_parquet(paths.problems), pd.read_parquet(paths.eval_problems)
    assert list(train.columns) == PROBLEM_COLUMNS == list(ev.columns)
    assert len(train) == 12 and len(ev) == 6
    assert set(train["split"]) == {"train"} and set(ev["split"]) == {"eval"}
    assert not set(train["problem_id"]) & set(ev["problem_id"])
    assert train["problem_id"].is_unique and ev["problem_id"].is_unique
    assert summary["counts"]["train"] == {"grid": {"0": 3, "2": 3}, "search": {"0": 3, "2": 3}}
    assert json.loads((paths.benchmark_dir / "benchmark.json").read_text())["counts"] == \
        {"grid": {"0": 2, "2": 1}, "search": {"0": 2, "2": 1}}
    assert summary["skipped"] is False
    keys = [content_key(s) for s in specs_of(pd.concat([train, ev]))]
    assert len(set(keys)) == len(keys)  # no content duplicate within or across the two


def test_benchmark_is_fixed_across_iterations_and_seeds(first_run, tmp_path):
    """One benchmark for every iteration: its path has no iteration, and it ignores synth/pipeline seeds."""
    paths, _ = first_run
    assert Paths(paths.root, 3).eval_problems == paths.eval_problems == paths.benchmark
    other = Paths(tmp_path, 2)
    cfg = _cfg(seed=9).model_copy(update={"pipeline": _cfg().pipeline.model_copy(update={"seed": 5})})
    benchmark.run(cfg, other)
    assert other.benchmark.read_bytes() == paths.benchmark.read_bytes()


def test_training_never_repeats_a_benchmark_problem_by_content(tmp_path, monkeypatch):
    """A training slot whose problem has the content of a benchmark problem (same task text and oracle
    plan, another id) is replaced: here the benchmark is made of exactly the problems the first
    training slots would produce, under new ids."""
    cfg = _cfg()
    paths = Paths(tmp_path, 1)
    jobs = synth.plan(cfg, 1, "train", 4)
    clash = [FAMILIES[f].generate(seed, lv) for f, lv, seed in jobs]
    monkeypatch.setattr(benchmark, "plan", lambda c: jobs)  # the benchmark = those same slots
    benchmark.run(cfg, paths)
    held = pd.read_parquet(paths.benchmark)
    assert {content_key(s) for s in specs_of(held)} == {content_key(s) for s in clash}
    monkeypatch.undo()
    synth.run(cfg, paths)
    train = pd.read_parquet(paths.problems)
    assert len(train) == 12
    assert not {content_key(s) for s in specs_of(train)} & {content_key(s) for s in clash}
    assert not set(train["problem_id"]) & set(held["problem_id"])


def test_synth_needs_the_benchmark(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m apprentice benchmark"):
        synth.run(_cfg(), Paths(tmp_path, 1))


def test_specs_rebuild_solvable_episodes_at_their_level(first_run):
    paths, _ = first_run
    df = pd.concat([pd.read_parquet(paths.problems), pd.read_parquet(paths.eval_problems)])
    for spec, level, pid in zip(specs_of(df), df["level"], df["problem_id"], strict=True):
        cls = FAMILIES[spec.family]
        assert spec.problem_id == pid
        assert dict(spec.difficulty) == cls.sample_difficulty(None, level)
        env = cls()
        env.reset(spec=spec)
        assert replay(cls, spec, env.oracle()) == 1.0


def test_same_config_gives_byte_identical_files(first_run, tmp_path):
    paths, _ = first_run
    other = Paths(tmp_path, 1)
    _run(_cfg(), other)
    assert other.problems.read_bytes() == paths.problems.read_bytes()
    assert other.eval_problems.read_bytes() == paths.eval_problems.read_bytes()


def test_seed_and_iteration_change_the_problems(first_run, tmp_path):
    paths, _ = first_run
    ids = set(pd.read_parquet(paths.problems)["problem_id"])
    it2 = Paths(tmp_path / "b", 2)
    _run(_cfg(), it2)
    assert not ids & set(pd.read_parquet(it2.problems)["problem_id"])
    s4 = Paths(tmp_path / "c", 1)
    _run(_cfg(seed=4), s4)
    assert not ids & set(pd.read_parquet(s4.problems)["problem_id"])


def test_rerun_is_a_no_op_until_config_or_outputs_change(tmp_path):
    paths = Paths(tmp_path, 1)
    _run(_cfg(n_train=4, n_eval=2), paths)
    stamp = paths.problems.stat().st_mtime_ns
    again = synth.run(_cfg(n_train=4, n_eval=2), paths)
    assert again["skipped"] is True and again["train"] == 4
    assert paths.problems.stat().st_mtime_ns == stamp

    changed = synth.run(_cfg(n_train=6, n_eval=2), paths)  # different config -> regenerate
    assert changed["skipped"] is False and len(pd.read_parquet(paths.problems)) == 6

    paths.problems.write_bytes(b"corrupt")  # damaged output -> regenerate
    fixed = synth.run(_cfg(n_train=6, n_eval=2), paths)
    assert fixed["skipped"] is False and len(pd.read_parquet(paths.problems)) == 6


def _previous_episodes(root, success_by_level: dict[int, float]) -> None:
    """Iteration 1's held-out episodes of the RL model: success rate per level as given (seeded)."""
    import numpy as np

    p1 = Paths(root, 1)
    _run(_cfg(n_eval=60, levels=[0, 1, 2]), p1)
    ev = pd.read_parquet(p1.eval_problems)
    rng = np.random.default_rng(0)
    ev["success"] = [bool(rng.random() < success_by_level[lv]) for lv in ev["level"]]
    p1.eval_dir.mkdir(parents=True)
    ev.to_parquet(p1.eval_dir / "rl.parquet")


@pytest.mark.parametrize(("p_star", "favoured"), [(0.85, 0), (0.15, 2)])
def test_sampler_selects_training_problems_by_predicted_pass_rate(tmp_path, p_star, favoured):
    """Iteration 2 keeps the n_train of 3 x n_train candidates whose *predicted* pass rate (predictor
    fitted on iteration 1's episodes: level 0 mostly solved, level 2 mostly failed) the band around
    p_star holds, so the target pass rate moves the level mix; the held-out split is untouched."""
    _previous_episodes(tmp_path, {0: 0.85, 1: 0.5, 2: 0.15})
    over = {"levels": [0, 1, 2], "n_train": 12, "sampler": "pass_band", "oversample": 3.0}
    cfg = Config.model_validate({"synth": {**_cfg().synth.model_dump(), **over}, "benchmark": {"n": 60, "levels": []},
                                 "curriculum": {"p_star": p_star, "band": 0.2}, "frontier": {"mode": "fixed"}})
    p2 = Paths(tmp_path, 2)
    summary = synth.run(cfg, p2)
    train = pd.read_parquet(p2.problems)
    sel = summary["selection"]
    assert len(train) == 12 and sel["candidates"] == 36 and sel["fitted_on"] == "rl.parquet"
    counts = train["level"].value_counts()
    assert counts.get(favoured, 0) >= 9, counts.to_dict()  # unselected, a third of them would be
    assert abs(sel["predicted_pass_rate_kept"] - p_star) < 0.15 < abs(sel["predicted_pass_rate_all"] - p_star)
    assert sel["fitted_on"] == "rl.parquet"  # the benchmark itself is untouched by selection


def test_the_sampler_fits_on_the_champion_promotion_named(tmp_path):
    """Training continues from the champion: when promote-(k-1) promoted an alternate (SFT), the sampler's
    predictor fits on that model's episodes, not promote.candidate's."""
    import json

    p1 = Paths(tmp_path, 1)
    p1.eval_dir.mkdir(parents=True)
    for name in ("rl", "sft"):
        pd.DataFrame({"success": [True]}).to_parquet(p1.eval_dir / f"{name}.parquet")
    p2 = Paths(tmp_path, 2)
    assert synth.previous_episodes(_cfg(), p2).name == "rl.parquet"  # no record yet: promote.candidate
    p1.promotion.parent.mkdir(parents=True)
    p1.promotion.write_text(json.dumps({"champion": {"kind": "sft", "iteration": 1, "version": 1}}))
    assert synth.previous_episodes(_cfg(), p2).name == "sft.parquet"
    p1.promotion.write_text(json.dumps({"champion": {"kind": "sft", "iteration": 0, "version": 0}}))
    assert synth.previous_episodes(_cfg(), p2).name == "rl.parquet"  # an older champion: not in this folder


def test_sampler_without_a_previous_iteration_keeps_the_first_candidates(tmp_path):
    cfg = _cfg(sampler="dtac")
    summary = _run(cfg, Paths(tmp_path, 1))
    assert summary["train"] == 12 and "no previous" in summary["selection"]["fallback"]


def test_the_shipped_benchmark_can_tell(tmp_path):
    """The default benchmark can tell a real gain from noise: >= 160 problems (a 10-point gain exceeds
    one Wilson interval's half-width), every trained family at every trained level and at harder
    ones, balanced per (family, level), and no training problem of iterations 1-2 shares its content or
    its task text (the shipped params, only n_train as shipped)."""
    from pathlib import Path

    from apprentice.config import load_config
    from apprentice.data.dedupe import spec_task_key
    from apprentice.evaluation.metrics import wilson_interval

    cfg = load_config(Path(__file__).resolve().parents[2] / "params.yaml")
    assert cfg.benchmark.n >= 160
    assert set(cfg.benchmark_families) >= set(cfg.synth.families)
    assert max(cfg.benchmark_levels) > max(cfg.synth.levels) and set(cfg.benchmark_levels) >= set(cfg.synth.levels)
    lo, hi = wilson_interval(cfg.benchmark.n // 2, cfg.benchmark.n)
    assert (hi - lo) / 2 < 0.08  # a 10-point gain is no longer inside one interval's half-width
    bench = pd.read_parquet(benchmark.run(cfg, Paths(tmp_path, 1)) and Paths(tmp_path, 1).benchmark)
    cells = bench.groupby(["family", "level"]).size()
    assert cells.min() == cells.max() and len(cells) == len(cfg.benchmark_families) * len(cfg.benchmark_levels)
    held = {content_key(s) for s in specs_of(bench)}
    tasks = {spec_task_key(s) for s in specs_of(bench)}
    # iteration 2 trains where a champion half succeeds: levels 3-5, the benchmark's harder half
    _frontier_record(cfg, Paths(tmp_path, 2), {0: 1.0, 1: 1.0, 2: 0.9, 3: 0.5, 4: 0.4, 5: 0.1})
    for k in (1, 2):
        synth.run(cfg, Paths(tmp_path, k))
        train = specs_of(pd.read_parquet(Paths(tmp_path, k).problems))
        assert not {content_key(s) for s in train} & held
        assert not {spec_task_key(s) for s in train} & tasks


def _frontier_record(cfg: Config, paths: Paths, rates: dict[int, float], n: int = 10) -> dict:
    """A frontier.json as the frontier stage writes it, from given per-level pass rates (every family)."""
    import json

    from apprentice.curriculum import frontier
    from apprentice.stages.frontier import tops

    probe = [frontier.Cell(f, lv, n, round(r * n)) for f in cfg.synth.families for lv, r in rates.items()]
    fc = cfg.frontier
    rec = frontier.decide(probe, cfg.synth.families, tops(cfg), cfg.synth.n_train, target=fc.target, band=fc.band,
                          replay_share=fc.replay_share, explore_share=fc.explore_share)
    paths.frontier_record.parent.mkdir(parents=True, exist_ok=True)
    paths.frontier_record.write_text(json.dumps(rec))
    return rec


def test_iteration_2_synthesizes_the_frontier_mix(tmp_path):
    """From iteration 2 on, synthesis follows the frontier record: per family exactly the mix's count at
    each level (window, replay below, the level above), no other level; iteration 1 keeps synth.levels."""
    cfg = Config.model_validate({"synth": {"families": ["grid", "search"], "n_train": 40, "levels": [0, 1, 2], "seed": 3},
                                 "benchmark": {"n": 16, "levels": []}})
    rec = _frontier_record(cfg, Paths(tmp_path, 2), {0: 1.0, 1: 0.9, 2: 0.6, 3: 0.3, 4: 0.0})
    _run(cfg, Paths(tmp_path, 1))
    assert set(pd.read_parquet(Paths(tmp_path, 1).problems)["level"]) == {0, 1, 2}
    summary = synth.run(cfg, Paths(tmp_path, 2))
    train = pd.read_parquet(Paths(tmp_path, 2).problems)
    got = {f: {str(lv): int(n) for lv, n in g.groupby("level").size().items()} for f, g in train.groupby("family")}
    assert got == {f: d["mix"] for f, d in rec["families"].items()} and summary["mix"] == "frontier"
    assert rec["families"]["grid"]["window"] == [2, 3] and rec["families"]["grid"]["above"] == [4]
    assert rec["families"]["grid"]["replay"] == [0, 1]


def test_iteration_2_without_a_frontier_record_names_the_stage_to_run(tmp_path):
    cfg = Config.model_validate({"synth": {"families": ["grid"], "n_train": 4, "levels": [0], "seed": 3},
                                 "benchmark": {"n": 2, "levels": []}})
    benchmark.run(cfg, Paths(tmp_path, 1))
    with pytest.raises(FileNotFoundError, match="apprentice frontier --iter 2"):
        synth.run(cfg, Paths(tmp_path, 2))
