"""The RL stage's problem selection: difficulty order + pass-rate filter, or a curriculum sampler.

The probe (sampled rollouts of the current model) is replaced by a fixed pass-rate table so the
selection rule itself is what is tested."""

from __future__ import annotations

from pathlib import Path

import pytest

from apprentice.config import load_config
from apprentice.curriculum import PassRate
from apprentice.data.trajectories import problems_frame
from apprentice.envs import FAMILIES
from apprentice.stages import rl as rl_stage

ROOT = Path(__file__).resolve().parents[2]


def _problems(n: int = 6):
    grid = FAMILIES["grid"]
    specs = [grid.generate(seed=i, level=i % 3) for i in range(n)]
    return problems_frame(specs, [i % 3 for i in range(n)], "train")


def _with_rates(monkeypatch, problems, rates):
    table = {pid: PassRate(s, 4) for pid, s in zip(problems["problem_id"], rates, strict=True)}
    monkeypatch.setattr(rl_stage, "probe_pass_rates", lambda cfg, rows, m, t: {p: table[p] for p in rows["problem_id"]})


def test_pass_rate_filter_drops_always_and_never_solved(monkeypatch):
    problems = _problems()
    _with_rates(monkeypatch, problems, [0, 4, 2, 1, 3, 4])
    cfg = load_config(ROOT / "params.yaml", overrides=["rl.probe_problems=6", "rl.probe_samples=4"])
    kept, summary = rl_stage.select_problems(cfg, problems, None, None)
    rates = dict(zip(problems["problem_id"], [0, 4, 2, 1, 3, 4], strict=True))
    assert sorted(rates[p] for p in kept["problem_id"]) == [1, 2, 3]
    assert summary["never_solved"] == 1 and summary["always_solved"] == 2


def test_sampler_curriculum_uses_curriculum_sampler(monkeypatch):
    problems = _problems()
    _with_rates(monkeypatch, problems, [0, 4, 2, 1, 3, 4])
    cfg = load_config(ROOT / "params.yaml", overrides=[
        "rl.curriculum=sampler", "rl.probe_problems=6", "rl.probe_samples=4",
        "curriculum.sampler=pass_band", "curriculum.p_star=0.5", "curriculum.band=0.1"])
    picked, summary = rl_stage.select_problems(cfg, problems, None, None)
    rates = dict(zip(problems["problem_id"], [0, 4, 2, 1, 3, 4], strict=True))
    assert [rates[p] for p in picked["problem_id"]] == [2]  # only pass rate 0.5 lies within 0.1 of p*
    assert summary["sampler"] == "pass_band"


def test_sampler_that_picks_nothing_falls_back_to_the_whole_order(monkeypatch):
    problems = _problems()
    _with_rates(monkeypatch, problems, [0] * 6)  # a policy that solves nothing: outside every pass band
    cfg = load_config(ROOT / "params.yaml", overrides=["rl.curriculum=sampler", "curriculum.sampler=pass_band",
                                                         "rl.probe_problems=6", "rl.probe_samples=4"])
    with pytest.warns(UserWarning, match="picked none"):
        kept, summary = rl_stage.select_problems(cfg, problems, None, None)
    assert len(kept) == 6 and summary["sampler"] == "pass_band"


def _generations(n_gen: int = 3, n: int = 4):
    store = FAMILIES["store"]
    return [problems_frame([store.generate(seed=100 * g + i, level=g) for i in range(n)], [g] * n, f"gen_{g}")
            for g in range(n_gen)]


def test_generation_scheduler_feeds_the_first_unmastered_generation(monkeypatch):
    """Generation 0 mastered (4/4), generation 1 half solved (< advance_threshold 0.6): generation 1's
    probed problems join the RL pool right after the probed training problems; generation 2 is never probed."""
    problems, gens = _problems(), _generations()
    rates = {**dict(zip(problems["problem_id"], [0, 4, 2, 1, 3, 4], strict=True)),
             **dict.fromkeys(gens[0]["problem_id"], 4), **dict(zip(gens[1]["problem_id"], [2, 1, 3, 2], strict=True))}
    probed: list[list[str]] = []

    def probe(cfg, rows, model, tok):
        probed.append(list(rows["problem_id"]))
        return {p: PassRate(rates[p], 4) for p in rows["problem_id"]}

    monkeypatch.setattr(rl_stage, "probe_pass_rates", probe)
    cfg = load_config(ROOT / "params.yaml", overrides=["rl.probe_problems=6", "rl.probe_samples=4",
                                                         "curriculum.evolve.feed=4", "curriculum.advance_threshold=0.6"])
    kept, summary = rl_stage.select_problems(cfg, problems, None, None, gens)
    assert [set(p) for p in probed] == [set(problems["problem_id"]), set(gens[0]["problem_id"]), set(gens[1]["problem_id"])]
    feed = summary["evolve_feed"]
    assert feed["generation"] == 1 and [g for g, _ in feed["history"]] == [0, 1] and feed["history"][1][1] == 0.5
    ids = list(kept["problem_id"])
    assert set(ids[3:]) == set(gens[1]["problem_id"]) and len(ids) == 7  # 3 informative + generation 1
    assert set(ids) & set(gens[0]["problem_id"]) == set()  # mastered: no signal left there


def test_feed_needs_the_probe():
    cfg = load_config(ROOT / "params.yaml", overrides=["rl.probe_samples=0", "curriculum.evolve.feed=2"])
    with pytest.raises(ValueError, match="rl.probe_samples"):
        rl_stage.select_problems(cfg, _problems(), None, None, _generations())


def test_probe_spreads_over_the_order_and_band_problems_come_first(monkeypatch):
    """The probe covers easy to hard (not only the easiest head of the order), and GRPO, which reads
    the dataset in order, meets the problems the model sometimes solves before unprobed ones."""
    problems = _problems(12)
    probed: list[list[str]] = []
    table = dict(zip(problems["problem_id"], [4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 0, 0], strict=True))

    def probe(cfg, rows, m, t):
        probed.append(list(rows["problem_id"]))
        return {p: PassRate(table[p], 4) for p in rows["problem_id"]}

    monkeypatch.setattr(rl_stage, "probe_pass_rates", probe)
    cfg = load_config(ROOT / "params.yaml", overrides=["rl.probe_problems=4", "rl.probe_samples=4"])
    kept, summary = rl_stage.select_problems(cfg, problems, None, None)
    from apprentice.curriculum import order_by_difficulty

    order = order_by_difficulty(problems)["problem_id"].tolist()
    assert probed[0] == [order[0], order[4], order[7], order[11]]  # evenly spaced, first and last included
    first = kept["problem_id"].iloc[0]
    assert 0 < table[first] < 4 and first in probed[0]  # an informative probed problem leads
    assert summary["probed"] == 4


def test_rl_keeps_the_problems_whose_oracle_episode_fits_its_budget(smol_tokenizer_dir):
    """The oracle's episodes, measured through the chat template: long grid levels fall out of a small
    budget, the short ones stay, in order; the summary names what fell out."""
    from apprentice.lm.modeling import load_tokenizer

    grid = FAMILIES["grid"]
    specs = [grid.generate(seed=i, level=lv) for i, lv in enumerate([0, 5, 1, 6, 0])]
    problems = problems_frame(specs, [0, 5, 1, 6, 0], "train")
    tok = load_tokenizer(smol_tokenizer_dir, "compact")
    needs = rl_stage.oracle_needs(problems, tok)
    assert set(needs) == set(problems["problem_id"])
    by_level = {lv: needs[p] for p, lv in zip(problems["problem_id"], problems["level"], strict=True)}
    assert by_level[6].calls > by_level[1].calls and by_level[6].tokens > by_level[1].tokens
    cfg = load_config(ROOT / "params.yaml", overrides=["rl.max_completion_length=640", "rl.max_tool_calls=8"])
    kept, summary = rl_stage.fit_budget(cfg, problems, tok)
    assert kept["level"].tolist() == [0, 1, 0]
    assert summary["over_budget"] == 2 and set(summary["over_budget_by_level"]) == {"grid/5", "grid/6"}
