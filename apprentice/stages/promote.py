"""Stage ``promote``: register the iteration's candidate, move the aliases, name the next start model.

The iteration's models ``promote.kinds`` (``promote.candidate``, default the RL model, then
``promote.alternates``, default SFT) are each tested against the incumbent: an exact McNemar test on
the *same* benchmark episodes (matched by problem id and sample), each at ``promote.alpha / m`` for
the m models tested. The winner with the smallest p (else the candidate) is registered in MLflow by
reference and becomes ``challenger``; ``champion`` moves to it only when it won. Otherwise the champion
stays and the version, the run and ``reports/iter_k/promotion.json`` (every model's test under
``tested``) record why.

Why SFT is tested too: a few GRPO steps on a CPU budget are a noisy update that can undo what the
iteration's SFT learned (docs/experiments.md measures it). Promoting whichever of the two beats the
champion keeps the loop climbing when RL does not help; the Bonferroni split keeps the chance of
promoting a model no better than the champion at ``alpha`` although two models had a chance.

The incumbent of an empty registry is the base model (its benchmark evaluation,
``data/benchmark/eval/base``): a first candidate that does not beat the model the loop started from
does not become champion either, so the alias never points at a model worse on the benchmark than
what it replaced. If the champion was never evaluated on the benchmark
(the benchmark params changed), it is evaluated here first (``reports/iter_k/champion_eval/``).

The record's ``champion`` entry (weights path + md5 of the model the registry now calls best, or
the base model while the registry has none) is what iteration k+1 starts from
(:func:`apprentice.stages.sft.start_model`): the record is a DVC dependency of ``sft-(k+1)``, so
``dvc repro`` rebuilds the same chain without Prefect or MLflow.

Both evaluation tables pass the ``eval_results`` gate before any alias moves.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import pandas as pd

from apprentice import gate
from apprentice.config import Config
from apprentice.data.trajectories import read_parquet
from apprentice.evaluation.metrics import paired_test
from apprentice.ops import lineage
from apprentice.paths import Paths, atomic_path

_MODEL_DIR = {"sft": "sft_model", "rl": "rl_model", "student": "student_model"}
_PRODUCER = {"sft": "sft", "rl": "rl", "student": "distill"}


def decide(challenger: pd.DataFrame | None, champion: pd.DataFrame | None, alpha: float,
           has_champion: bool) -> dict[str, Any]:
    """The promotion rule, kept pure for tests: ``{"promote": bool, "reason": str, ...test stats}``.

    ``champion`` is the incumbent's episodes: the registry champion's, or (``has_champion=False``)
    the base model's. Only an empty registry with no base evaluation promotes without a test."""
    if not has_champion and champion is None:
        return {"promote": True, "reason": "no champion and no base-model evaluation: the first evaluated model "
                                           "becomes champion"}
    if challenger is None or champion is None:
        return {"promote": False, "reason": "champion has no evaluation on these problems; champion kept"}
    t = paired_test(challenger, champion)
    stats = {"p_value": t["p_value"], "challenger_only": t["a_only"], "champion_only": t["b_only"],
             "n_pairs": t["n_pairs"], "challenger_success": t["success_rate_a"],
             "champion_success": t["success_rate_b"]}
    vs = "" if has_champion else " against the base model"
    if t["direction"] == "a" and t["p_value"] < alpha:
        return {"promote": True, "reason": f"challenger wins the paired test{vs} (p={t['p_value']:.4g} < {alpha})",
                **stats}
    why = ("challenger is not better" if t["direction"] != "a"
           else f"improvement not significant (p={t['p_value']:.4g} >= {alpha})")
    kept = "champion kept" if has_champion else "the base model stays the start model"
    return {"promote": False, "reason": f"{why}{vs}; {kept}", **stats}


def _base_results(paths: Paths) -> pd.DataFrame:
    """The base model's benchmark episodes: the incumbent while the registry has no champion."""
    table = paths.eval_episodes("base")
    if not table.is_file():
        raise FileNotFoundError(f"an empty registry's candidate competes with the base model, but {table} does not "
                                "exist; run `python -m apprentice evaluate --policy base` first (dvc repro does)")
    return read_parquet(table)


def _base_entry(cfg: Config, paths: Paths) -> dict[str, Any]:
    from apprentice.lm.modeling import resolve_model_ref

    ref = Path(resolve_model_ref(cfg.model.base, paths.root))
    return {"version": 0, "kind": "base", "iteration": 0, "weights_path": _rel(ref, paths.root),
            "root": _root(paths.root, paths), "md5": weights_md5(ref) if ref.is_dir() else ""}


def _root(root: str | Path, paths: Paths) -> str:
    """A record's ``root``: ``.`` for this project (a tracked record must not hold the clone's absolute
    path: it would hash differently in every folder), the absolute root of another project's champion."""
    return "." if Path(root).resolve() == paths.root.resolve() else str(root)


def _rel(p: Path, root: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(Path(root).resolve()))
    except ValueError:
        return str(p)


def weights_md5(folder: Path) -> str:
    """md5 over a model folder's files (sorted relative paths + bytes): identifies the start model."""
    h = hashlib.md5()
    for f in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def previous_champion(paths: Paths, why: str) -> dict[str, Any]:
    """The ``champion`` entry of promote-(k-1)'s record, for a stage of iteration k that needs it (``why``
    says which, in the error). Raises with the command to run when the record or the entry is missing."""
    prev = paths.previous()
    assert prev is not None, "iteration 1 has no previous promotion"
    if not prev.promotion.exists():
        raise FileNotFoundError(f"iteration {paths.iteration} {why} after promote-{prev.iteration}, but "
                                f"{prev.promotion} does not exist; run `python -m apprentice promote --iter "
                                f"{prev.iteration}` first (dvc repro does)")
    champ = json.loads(prev.promotion.read_text()).get("champion")
    if not champ:
        raise ValueError(f"{prev.promotion} names no champion (written by an older version); rerun "
                         f"`python -m apprentice promote --iter {prev.iteration}`")
    return dict(champ)


def champion_path(entry: dict[str, Any], root: Path) -> Path:
    """Absolute weights folder of a promotion record's ``champion`` entry."""
    p = Path(entry["weights_path"])
    return p if p.is_absolute() else Path(root) / (entry.get("root") or ".") / p


def check_coverage(df: pd.DataFrame, problem_ids: list[str], name: str, policy: str = "") -> None:
    """Refuse a table that misses problems of the set it is compared on.

    A challenger evaluated on 8 of 40 problems (all solved) must not beat a champion on those 8 alone:
    the paired test only sees the pairs both tables have, so each table must cover every problem.
    """
    have = set(df["problem_id"].astype(str))
    missing = sorted(set(problem_ids) - have)
    if missing:
        fix = f"`python -m apprentice evaluate --policy {policy}`" if policy else "its evaluation"
        raise ValueError(
            f"{name} covers {len(problem_ids) - len(missing)} of the {len(problem_ids)} problems promotion compares on "
            f"(missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}); promotion needs complete tables: "
            f"rerun {fix} on the full problem set")


def check_same_pairs(challenger: pd.DataFrame, champion: pd.DataFrame, problem_ids: list[str]) -> None:
    """Both tables hold the same (problem, sample) pairs of ``problem_ids``: the test is like for like."""
    def pairs(df: pd.DataFrame) -> set[tuple[str, int]]:
        cols = df[df["problem_id"].astype(str).isin(problem_ids)]
        return set(zip(cols["problem_id"].astype(str), cols.get("sample_idx", pd.Series(0, index=cols.index)),
                       strict=True))
    a, b = pairs(challenger), pairs(champion)
    if a != b:
        raise ValueError(f"challenger and champion tables differ in {len(a ^ b)} (problem, sample) pairs "
                         f"(e.g. {sorted(a ^ b)[:3]}); evaluate both with the same evaluate.samples_per_problem")


def weights_digest(weights: Path, dvc_md5: str) -> str:
    """What identifies the registered weights: DVC's md5 when the stage ran under DVC, else a content hash."""
    if dvc_md5:
        return f"md5:{dvc_md5}"
    from apprentice.rollout.shards import model_fingerprint

    return "sha256:" + model_fingerprint(str(weights)) if Path(weights).is_dir() else "missing"


def file_md5(path: Path) -> str:
    """md5 of one file's bytes: what an evaluation table was when its model was registered."""
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _same_weights(tags: dict[str, Any], weights: Path) -> bool:
    """Whether ``weights`` are still those registered (the version's ``weights_digest``; no tag: assumed)."""
    recorded = tags.get("weights_digest")
    producer = _PRODUCER.get(tags.get(lineage.TAG_KIND, ""))
    if not recorded or producer is None:
        return True
    md5 = lock_md5(Path(tags.get("root", ".")), f"{producer}-{tags.get(lineage.TAG_ITER, '')}",
                   tags.get("weights_path", ""))
    return weights_digest(weights, md5) == recorded


def lock_md5(workdir: Path, stage: str, out: str) -> str:
    """DVC's md5 of output ``out`` of ``stage`` in ``dvc.lock`` ("" when the stage never ran under DVC)."""
    lock = lineage.dvc_lock_entry(workdir, stage)
    return next((o.get("md5", "") for o in lock.get("outs", []) if o["path"] == out), "")


def _recorded(prior: dict[str, Any] | None) -> dict[str, Any] | None:
    """The decision a killed earlier attempt recorded on its registered version (rerun = same decision)."""
    if not prior or "promotion" not in prior["tags"]:
        return None
    tags = prior["tags"]
    stats = json.loads(tags.get("promotion_stats") or "{}")
    return {"promote": tags["promotion"] == "promoted", "reason": tags.get("promotion_reason", ""), **stats}


def _gate(df: pd.DataFrame, eval_ids: list[str], name: str) -> None:
    res = gate.check(df, "eval_results", {"eval_problem_ids": eval_ids}, table=name)
    gate.raise_if_failed([res])


def _champion_results(champ: dict[str, Any], challenger: pd.DataFrame, cfg: Config,
                      paths: Paths) -> pd.DataFrame | None:
    """The champion's episodes on the challenger's held-out problems.

    Its own evaluation table when that covers the same problems (evaluation sets repeat when the
    environments do not evolve); otherwise it is evaluated here; None if its weights are gone.
    """
    tags = champ["tags"]
    table = Path(tags.get("eval_table", ""))
    if table.is_file():
        now = file_md5(table)
        if tags.get("eval_table_md5", now) != now:  # versions registered before the tag: trusted as before
            # another run of the champion's iteration in this workspace (a `dvc exp run` of another rule)
            # rewrote the table since the champion was registered: its rows are not the champion's
            warnings.warn(f"champion v{champ['version']}'s evaluation table {table} changed since it was registered; "
                          "not comparing against it", stacklevel=2)
        else:
            df = read_parquet(table)
            if set(challenger["problem_id"]) <= set(df["problem_id"]):
                return df
    weights = Path(tags.get("root", paths.root)) / tags.get("weights_path", "")
    if not (weights / "config.json").exists():
        return None
    if not _same_weights(tags, weights):
        warnings.warn(f"champion v{champ['version']}'s weights {weights} changed since it was registered; it cannot "
                      "be re-evaluated, so it stays champion. To compare a re-run of an iteration against the champion "
                      "before it, rewind the registry first (apprentice.ops.lineage.rewind, as experiments/loop_rules.py does)",
                      stacklevel=2)
        return None
    from apprentice.stages import evaluate

    res = evaluate.run(cfg, paths, policy=str(weights), out=str(paths.reports / "champion_eval"))
    return read_parquet(res["episodes"])


def choose(decisions: dict[str, dict[str, Any]]) -> str:
    """Which tested model the iteration puts forward (pure, for tests): among those whose decision
    promotes, the smallest p (ties: the earlier in ``decisions``' order); if none promotes, the first.

    The decisions must come from :func:`decide` at ``alpha / len(decisions)``: picking the best of m
    models on the same benchmark and testing it at ``alpha`` would promote a model no better than the
    champion with probability up to ``m * alpha``; Bonferroni keeps it at ``alpha``."""
    order = list(decisions)
    wins = [k for k in order if decisions[k]["promote"]]
    if not wins:
        return order[0]
    return min(wins, key=lambda k: (decisions[k].get("p_value", 0.0), order.index(k)))


def _tested(cfg: Config, paths: Paths, eval_ids: list[str]) -> dict[str, pd.DataFrame]:
    """The evaluation tables of ``promote.kinds``: the candidate's must exist, an alternate without one
    (a pipeline that does not evaluate it) is not tested. Each is complete and passes the gate."""
    out = {}
    for kind in cfg.promote.kinds:
        table = paths.eval_episodes(kind)
        if kind != cfg.promote.candidate and not table.is_file():
            continue
        df = read_parquet(table)
        check_coverage(df, eval_ids, f"challenger table {table}", kind)
        _gate(df, eval_ids, str(table))
        out[kind] = df
    return out


def _weights(paths: Paths, kind: str) -> tuple[Path, str, str, str]:
    """(weights folder, its project-relative path, DVC's md5 of it, the digest the registry records)."""
    weights = getattr(paths, _MODEL_DIR[kind])
    rel = str(weights.relative_to(paths.root))
    md5 = lock_md5(paths.root, f"{_PRODUCER[kind]}-{paths.iteration}", rel)
    return weights, rel, md5, weights_digest(weights, md5)


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    pc = cfg.promote
    eval_ids = sorted(read_parquet(paths.eval_problems)["problem_id"].astype(str).unique())
    tables = _tested(cfg, paths, eval_ids)

    lineage.configure(cfg.lineage.tracking_uri, cfg.lineage.experiment, paths.root)
    name = pc.registered_model
    # a rerun after a kill: the model an earlier attempt registered (with its decision) is the one chosen
    prior, cand = None, str(pc.candidate)
    for kind in tables:
        rel_k, digest_k = _weights(paths, kind)[1::2]
        found = lineage.find_version(name, rel_k, digest_k)
        if _recorded(found):
            prior, cand = found, kind
            break
    recorded = _recorded(prior)
    if recorded and prior is not None:  # a rerun: repeat the decision recorded with the version
        decision = recorded
        before = prior["tags"].get("champion_before", "none")
        champ = (lineage.alias_version(name, lineage.CHAMPION) if not decision["promote"]
                 else None if before == "none" else {"version": before, "tags": {}})
    else:
        champ = lineage.alias_version(name, lineage.CHAMPION)
        champ_df = _champion_results(champ, tables[pc.candidate], cfg, paths) if champ else _base_results(paths)
        if champ_df is not None:
            incumbent = f"champion v{champ['version']} episodes" if champ else "base-model episodes"
            check_coverage(champ_df, eval_ids, incumbent, "" if champ else "base")
            _gate(champ_df, eval_ids, incumbent)
            for df in tables.values():
                check_same_pairs(df, champ_df, eval_ids)
        alpha = pc.alpha / len(tables)
        tests = {kind: decide(df, champ_df, alpha, champ is not None) for kind, df in tables.items()}
        cand = choose(tests)
        decision = {**tests[cand], "tested": tests}  # recorded with the version: a rerun repeats all of it
        if len(tables) > 1:
            decision["reason"] += (f" ({cand} of {', '.join(tables)}, each tested at alpha / {len(tables)} = "
                                   f"{alpha:.4g})")
    challenger = tables[cand]
    table = paths.eval_episodes(cand)
    weights, rel, md5, digest = _weights(paths, cand)
    prior = prior or lineage.find_version(name, rel, digest)  # registered by an older version, undecided

    git = lineage.git_commit(paths.root)
    success = float(challenger["success"].mean())
    stats = {k: v for k, v in decision.items() if k not in ("promote", "reason")}
    with lineage.attach_or_start(f"promote-{paths.iteration}",
                                 {lineage.TAG_ITER: str(paths.iteration)}) as run_id:
        # the decision is recorded with the version in one write, so a rerun after a kill repeats it
        version = prior["version"] if prior else lineage.register_reference(
            run_id, name, rel, paths.root, md5, git,
            {lineage.TAG_ITER: paths.iteration, lineage.TAG_KIND: cand, "root": str(paths.root),
             "success_rate": success, "eval_table": str(table), "eval_table_md5": file_md5(table),
             "weights_digest": digest,
             "promotion": "promoted" if decision["promote"] else "kept", "promotion_reason": decision["reason"],
             "promotion_stats": json.dumps(stats, default=str),
             "champion_before": champ["version"] if champ else "none"})
        lineage.set_alias(name, lineage.CHALLENGER, version)
        if decision["promote"]:
            lineage.set_alias(name, lineage.CHAMPION, version)
        record = {"promote.decision": "promoted" if decision["promote"] else "kept",
                  "promote.reason": decision["reason"], "promote.version": version,
                  "promote.champion_before": champ["version"] if champ else "none"}
        lineage.set_tags(run_id, record)
        lineage.tag_version(name, version, {"promotion": record["promote.decision"],
                                            "promotion_reason": decision["reason"]})
    champion: dict[str, Any]
    if decision["promote"]:
        champion = {"version": int(version), "kind": cand, "iteration": paths.iteration, "weights_path": rel,
                    "root": ".", "md5": md5 or weights_md5(weights)}
    elif champ is not None:
        t = champ["tags"]
        champion = {"version": int(champ["version"]), "kind": t.get(lineage.TAG_KIND, ""),
                    "iteration": int(t.get(lineage.TAG_ITER, 0) or 0), "weights_path": t.get("weights_path", ""),
                    "root": _root(t.get("root", paths.root), paths), "md5": t.get("dvc_md5", "")}
    else:
        champion = _base_entry(cfg, paths)
    if (cp := champion_path(champion, paths.root)).is_dir():  # one md5 kind for every entry: the files' own
        champion["md5"] = weights_md5(cp)
    champion_now = champion["version"]
    out = {"registered_model": name, "version": int(version), "candidate": cand, "promoted": decision["promote"],
           "reason": decision["reason"], "champion_version": int(champion_now),
           "champion_before": int(champ["version"]) if champ else 0, "challenger_success": success,
           "weights_path": rel, "dvc_md5": md5, "champion": champion,
           **{k: v for k, v in decision.items() if k not in ("promote", "reason")}}
    path = paths.promotion
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"promotion: {name} v{version} ({cand}) -> {'champion' if decision['promote'] else 'challenger'}: "
          f"{decision['reason']}")
    return out
