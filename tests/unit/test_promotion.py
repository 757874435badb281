"""Promotion: aliases move only on a significant paired win, in a real MLflow sqlite store."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from apprentice.config import load_config
from apprentice.data.trajectories import write_parquet
from apprentice.paths import Paths
from apprentice.stages.promote import decide
from apprentice.stages.sft import start_record

REPO = Path(__file__).resolve().parents[2]
IDS = [f"p{i:02d}" for i in range(30)]


def _episodes(successes: list[bool], policy: str) -> pd.DataFrame:
    return pd.DataFrame({"problem_id": IDS[: len(successes)], "policy_id": policy, "sample_idx": 0,
                         "success": successes, "reward": [float(s) for s in successes]})


def test_decide_rule():
    strong, weak = _episodes([True] * 27 + [False] * 3, "a"), _episodes([True] * 10 + [False] * 20, "b")
    assert decide(strong, None, 0.05, has_champion=False)["promote"]
    up = decide(strong, weak, 0.05, has_champion=True)
    assert up["promote"] and up["p_value"] < 0.05 and up["challenger_only"] == 17
    down = decide(weak, strong, 0.05, has_champion=True)
    assert not down["promote"] and "not better" in down["reason"]
    slight = decide(_episodes([True] * 12 + [False] * 18, "c"), weak, 0.05, has_champion=True)
    assert not slight["promote"] and "not significant" in slight["reason"]
    kept = decide(strong, None, 0.05, has_champion=True)
    assert not kept["promote"] and "no evaluation" in kept["reason"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    return tmp_path


def _iteration(root: Path, k: int, successes: list[bool], candidate: str, base: list[bool] | None = None) -> Paths:
    paths = Paths(root, k)
    held = pd.DataFrame({"problem_id": IDS, "split": "eval"})
    write_parquet(held, paths.eval_problems)
    if not (paths.benchmark_eval_dir / "base.parquet").exists():  # the base model, scored once
        write_parquet(_episodes(base or [False] * 30, "base"), paths.benchmark_eval_dir / "base.parquet")
    write_parquet(_episodes(successes, candidate), paths.eval_dir / f"{candidate}.parquet")
    getattr(paths, f"{candidate}_model").mkdir(parents=True, exist_ok=True)  # referenced, never read
    return paths


def test_champion_stays_when_challenger_is_worse(store):
    from apprentice.ops import lineage
    from apprentice.stages import promote

    cfg = load_config(REPO / "params.yaml")
    cand = cfg.promote.candidate
    first = promote.run(cfg, _iteration(store, 1, [True] * 20 + [False] * 10, cand))
    assert first["promoted"] and first["champion_version"] == 1 and "against the base model" in first["reason"]
    assert first["champion"]["weights_path"] == f"models/iter_1/{cand}" and first["champion"]["iteration"] == 1

    worse = promote.run(cfg, _iteration(store, 2, [True] * 8 + [False] * 22, cand))
    assert not worse["promoted"] and worse["version"] == 2 and worse["champion_version"] == 1
    assert "not better" in worse["reason"] and worse["p_value"] < 0.05
    name = cfg.promote.registered_model
    assert lineage.aliases(name) == {"champion": "1", "challenger": "2"}
    v2 = lineage.alias_version(name, "challenger")
    assert v2["tags"]["promotion"] == "kept" and "not better" in v2["tags"]["promotion_reason"]
    assert v2["tags"]["weights_path"] == f"models/iter_2/{cand}"  # a reference, not a copy
    record = json.loads((store / "reports/iter_2/promotion.json").read_text())
    assert record["promoted"] is False and record["champion_before"] == 1
    # the loser is registered, but the next iteration starts from the champion (iteration 1's model)
    assert record["champion"]["version"] == 1 and record["champion"]["weights_path"] == f"models/iter_1/{cand}"
    assert start_record(cfg, Paths(store, 3))["path"] == str(store / f"models/iter_1/{cand}")

    better = promote.run(cfg, _iteration(store, 3, [True] * 30, cand))
    assert better["promoted"] and lineage.aliases(name) == {"champion": "3", "challenger": "3"}
    assert start_record(cfg, Paths(store, 4))["path"] == str(store / f"models/iter_3/{cand}")


def test_rewound_registry_lets_a_second_iteration_2_meet_iteration_1s_champion(store):
    """Two loop rules re-run iteration 2 in one workspace (experiments/loop_rules.py): after ``lineage.rewind``
    the second rule's promote-2 meets v1, the champion iteration 1 left, not the first rule's v2."""
    from apprentice.ops import lineage
    from apprentice.stages import promote

    cfg = load_config(REPO / "params.yaml")
    cand, name = cfg.promote.candidate, cfg.promote.registered_model
    promote.run(cfg, _iteration(store, 1, [True] * 10 + [False] * 20, cand))
    assert promote.run(cfg, _iteration(store, 2, [True] * 30, cand))["promoted"]  # rule A: v2 champion
    assert lineage.rewind(name, 1, 1) == ["2"] and lineage.aliases(name) == {"champion": "1", "challenger": "1"}
    (store / "models" / "iter_2" / cand / "weights.bin").write_text("rule B's weights")  # another digest
    again = promote.run(cfg, _iteration(store, 2, [True] * 11 + [False] * 19, cand))  # rule B: barely better
    assert not again["promoted"] and again["champion_before"] == 1 and again["champion_version"] == 1
    assert lineage.rewind(name, 0, None) == ["1", str(again["version"])]
    assert lineage.aliases(name) == {}


def test_first_candidate_must_beat_the_base_model(store):
    """An empty registry's incumbent is the base model: a candidate no better than it is registered as
    challenger only, no alias says 'champion', and the next iteration starts from the base model again."""
    from apprentice.ops import lineage
    from apprentice.stages import promote

    cfg = load_config(REPO / "params.yaml").model_copy(deep=True)
    cand = cfg.promote.candidate
    base = [True] * 12 + [False] * 18
    res = promote.run(cfg, _iteration(store, 1, [True] * 10 + [False] * 20, cand, base=base))
    assert not res["promoted"] and "base model" in res["reason"] and res["champion_version"] == 0
    assert lineage.aliases(cfg.promote.registered_model) == {"challenger": "1"}
    assert res["champion"]["kind"] == "base"
    start = start_record(cfg, Paths(store, 2))
    assert start["source"] == "base" and start["version"] == 0


def test_iteration_k_needs_the_previous_promotion_record(tmp_path):
    cfg = load_config(REPO / "params.yaml")
    with pytest.raises(FileNotFoundError, match="promote --iter 1"):
        start_record(cfg, Paths(tmp_path, 2))


def test_dead_tracking_server_fails_fast_with_a_fix(monkeypatch, tmp_path):
    import socket
    import time

    from apprentice.ops import lineage

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    t = time.time()
    with pytest.raises(lineage.LineageError, match="not reachable.*sqlite:///mlruns.db"):
        lineage.configure(f"http://127.0.0.1:{port}", "apprentice", tmp_path)
    assert time.time() - t < 10


def test_partial_challenger_table_is_refused(store):
    """8 of 30 problems, all solved, must not beat anything: promotion needs the complete set."""
    from apprentice.stages import promote

    cfg = load_config(REPO / "params.yaml")
    paths = _iteration(store, 1, [True] * 8, cfg.promote.candidate)
    with pytest.raises(ValueError, match="covers 8 of the 30 problems"):
        promote.run(cfg, paths)
    assert not (paths.reports / "promotion.json").exists()


def test_rerun_of_promote_is_idempotent_and_leaves_the_flow_run_running(store, monkeypatch):
    """A rerun (e.g. after a kill right after the registry write) finds the same version and repeats
    its recorded decision; the run handed over by the flow is not closed by the stage."""
    from mlflow import MlflowClient

    from apprentice.ops import lineage
    from apprentice.stages import promote

    cfg = load_config(REPO / "params.yaml")
    cand, name = cfg.promote.candidate, cfg.promote.registered_model
    promote.run(cfg, _iteration(store, 1, [True] * 10 + [False] * 20, cand))
    lineage.configure(cfg.lineage.tracking_uri, cfg.lineage.experiment, store)
    exp = MlflowClient().get_experiment_by_name(cfg.lineage.experiment).experiment_id
    flow_run = MlflowClient().create_run(exp, run_name="promote-2").info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", flow_run)

    paths = _iteration(store, 2, [True] * 30, cand)
    first = promote.run(cfg, paths)
    assert first["promoted"] and first["version"] == 2
    assert MlflowClient().get_run(flow_run).info.status == "RUNNING"  # the flow ends it, not the stage

    again = promote.run(cfg, paths)
    assert (again["version"], again["promoted"], again["reason"]) == (2, True, first["reason"])
    assert again["champion_before"] == 1 and again["p_value"] == first["p_value"]
    assert len(MlflowClient().search_model_versions(f"name='{name}'")) == 2
    assert lineage.aliases(name) == {"champion": "2", "challenger": "2"}


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    """A real ``mlflow server`` over HTTP (sqlite backend, proxied artifacts, one worker): a server
    validates registry calls that a local sqlite store lets through."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    d = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
                             f"sqlite:///{d / 'mlflow.db'}", "--artifacts-destination", str(d / "artifacts"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                            stdout=(d / "server.log").open("w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, (d / "server.log").read_text()[-2000:]
                time.sleep(0.5)
        else:
            pytest.fail("mlflow server did not answer in 150 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_promotion_registers_and_moves_aliases_on_a_tracking_server(tracking_server, tmp_path, monkeypatch):
    """The registry calls of promote against a tracking server over HTTP (the shared-stores setup):
    register a version per iteration, move the aliases, find the same version again on a rerun."""
    from apprentice.ops import lineage
    from apprentice.stages import promote

    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    cfg = load_config(REPO / "params.yaml")
    cand, name = cfg.promote.candidate, cfg.promote.registered_model
    first = promote.run(cfg, _iteration(tmp_path, 1, [True] * 20 + [False] * 10, cand))
    assert first["promoted"] and first["version"] == 1
    worse = promote.run(cfg, _iteration(tmp_path, 2, [True] * 8 + [False] * 22, cand))
    assert not worse["promoted"] and worse["version"] == 2
    assert lineage.aliases(name) == {"champion": "1", "challenger": "2"}
    again = promote.run(cfg, Paths(tmp_path, 2))  # a rerun: the same weights find their version
    assert again["version"] == 2 and lineage.aliases(name) == {"champion": "1", "challenger": "2"}


def test_a_champion_whose_table_was_rewritten_is_not_compared_on_the_new_rows(store):
    """`dvc exp run` of another loop rule in the same workspace rewrites the champion's evaluation table
    and weights (same paths). promote must not read those rows as the champion's: it keeps the champion,
    saying why, instead of comparing a challenger against a table that is no longer the champion's."""
    from apprentice.ops import lineage
    from apprentice.stages import promote

    cfg = load_config(REPO / "params.yaml")
    cand, name = cfg.promote.candidate, cfg.promote.registered_model
    promote.run(cfg, _iteration(store, 1, [True] * 25 + [False] * 5, cand))  # v1: 25 / 30
    v1 = lineage.alias_version(name, "champion")
    assert v1["tags"]["eval_table_md5"] == promote.file_md5(Path(v1["tags"]["eval_table"]))
    # another rule re-runs iteration 1 here: a weak table and other weights at v1's paths
    write_parquet(_episodes([False] * 30, cand), store / "data" / "iter_1" / "eval" / f"{cand}.parquet")
    (store / "models" / "iter_1" / cand / "config.json").write_text("{}")
    with pytest.warns(UserWarning, match="changed since it was registered"):
        res = promote.run(cfg, _iteration(store, 2, [True] * 12 + [False] * 18, cand))  # worse than v1's 25
    assert not res["promoted"] and res["champion_version"] == 1 and "no evaluation" in res["reason"]


def test_choose_takes_the_smallest_winning_p_and_falls_back_to_the_candidate():
    from apprentice.stages.promote import choose

    assert choose({"rl": {"promote": True, "p_value": 0.01}, "sft": {"promote": True, "p_value": 0.001}}) == "sft"
    assert choose({"rl": {"promote": True, "p_value": 0.01}, "sft": {"promote": False, "p_value": 0.2}}) == "rl"
    assert choose({"rl": {"promote": False, "p_value": 0.3}, "sft": {"promote": False, "p_value": 0.04}}) == "rl"
    assert choose({"rl": {"promote": True}, "sft": {"promote": True}}) == "rl"  # no test (empty registry, no base)


def _alternate(paths: Paths, kind: str, successes: list[bool]) -> None:
    write_parquet(_episodes(successes, kind), paths.eval_dir / f"{kind}.parquet")
    getattr(paths, f"{kind}_model").mkdir(parents=True, exist_ok=True)


def test_sft_is_promoted_when_rl_gives_back_what_it_learned(store):
    """RL-2 loses to the champion but SFT-2 beats it at alpha / 2: SFT-2 becomes champion and the next
    iteration starts from it; both tests are recorded."""
    from apprentice.ops import lineage
    from apprentice.stages import promote

    cfg = load_config(REPO / "params.yaml", overrides=["promote.candidate=rl", "promote.alternates=[sft]"])
    promote.run(cfg, _iteration(store, 1, [True] * 20 + [False] * 10, "rl"))
    paths = _iteration(store, 2, [True] * 15 + [False] * 15, "rl")
    _alternate(paths, "sft", [True] * 30)
    res = promote.run(cfg, paths)
    assert res["promoted"] and res["candidate"] == "sft" and res["champion_version"] == 2
    assert set(res["tested"]) == {"rl", "sft"} and not res["tested"]["rl"]["promote"]
    assert res["tested"]["sft"]["p_value"] < 0.025 and "alpha / 2" in res["reason"]
    assert res["champion"]["kind"] == "sft" and res["champion"]["weights_path"] == "models/iter_2/sft"
    v2 = lineage.alias_version(cfg.promote.registered_model, "champion")
    assert v2["tags"][lineage.TAG_KIND] == "sft" and v2["tags"]["weights_path"] == "models/iter_2/sft"
    assert start_record(cfg, Paths(store, 3))["path"] == str(store / "models/iter_2/sft")
    again = promote.run(cfg, paths)  # a rerun repeats the decision and registers nothing new
    assert again["candidate"] == "sft" and again["version"] == res["version"] and again["promoted"]
    assert set(again["tested"]) == {"rl", "sft"} and again["tested"]["sft"]["challenger_only"] == 30 - 20


@pytest.mark.parametrize("alternates, promoted", [("[]", True), ("[sft]", False)])
def test_testing_two_models_halves_each_ones_alpha(store, alternates, promoted):
    """6 wins and no loss against the base model: p = 0.031, significant at 0.05 alone, not at 0.05 / 2."""
    from apprentice.stages import promote

    cfg = load_config(REPO / "params.yaml", overrides=["promote.candidate=rl", f"promote.alternates={alternates}"])
    paths = _iteration(store, 1, [True] * 6 + [False] * 24, "rl")
    _alternate(paths, "sft", [True] * 5 + [False] * 25)
    res = promote.run(cfg, paths)
    assert res["promoted"] is promoted and res["candidate"] == "rl"
    assert len(res["tested"]) == (1 if alternates == "[]" else 2)


def test_an_alternate_listed_twice_fails_at_load():
    with pytest.raises(ValueError, match="promote.alternates"):
        load_config(REPO / "params.yaml", overrides=["promote.alternates=[sft,sft]"])
