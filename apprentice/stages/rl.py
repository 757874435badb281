"""Stage ``rl``: curriculum GRPO from the SFT model -> ``models/iter_k/rl``.

1. keep the problems on the frontier window's levels (``frontier.json``: where the champion half
   succeeded) whose oracle episode fits GRPO's budget (``rl.max_completion_length``,
   ``rl.max_tool_calls``: :mod:`apprentice.curriculum.budget`), order them easy -> hard;
2. probe the first ``rl.probe_problems`` of them with ``rl.probe_samples`` sampled episodes each
   (temperature 1, the same engine evaluation uses) and drop those the policy always or never
   solves (``apprentice.curriculum``), or let ``curriculum.sampler`` pick (``rl.curriculum: sampler``);
   with ``curriculum.evolve.feed > 0`` the generation scheduler also probes the evolved generations
   (``data/iter_k/evolve``) and adds the first one the policy has not mastered to what is picked from;
3. GRPO over what is left, in order (``training.rl``), a group whose rewards are all equal replaced
   from the problems GRPO does not reach (dynamic sampling, ``rl.refill_rounds``), at
   ``rl.learning_rate x loop.lr_factor`` when SFT continued from a trained champion (as SFT's rate).

``rl.max_steps = 0`` copies the SFT model unchanged (lets a profile skip RL while keeping the DAG).
"""

from __future__ import annotations

import json
import shutil
from typing import TYPE_CHECKING, Any

import pandas as pd

from apprentice.config import Config
from apprentice.paths import Paths, atomic_path
from apprentice.progress import enabled  # APPRENTICE_QUIET=1: no bars

if TYPE_CHECKING:
    from apprentice.curriculum import Need

CURRICULUM_FILE = "curriculum.json"


def select_problems(cfg: Config, problems: pd.DataFrame, model: Any, tokenizer: Any,
                    generations: list[pd.DataFrame] | None = None) -> tuple[pd.DataFrame, dict]:
    """Curriculum order + pass-rate filter (or sampler); returns the kept rows (in order) and a summary.

    ``generations``: the evolved generations (0..G) the scheduler may feed in (``curriculum.evolve.feed``).
    The decisions are :mod:`apprentice.curriculum`'s; this runs the probe they read."""
    from apprentice import curriculum

    feed = cfg.curriculum.evolve.feed if generations else 0
    ordered, probe_rows = curriculum.probe_plan(problems, cfg, feed)
    if probe_rows is None:
        return ordered, {"candidates": len(ordered), "probed": 0, "kept": len(ordered)}
    table = probe_pass_rates(cfg, probe_rows, model, tokenizer)
    fed: dict[str, Any] = {}
    if feed:  # the scheduler's generation joins right after the probed problems (GRPO reads in order)
        rows, rates, fed = curriculum.feed_generations(
            generations or [], feed, cfg.curriculum.advance_threshold,
            lambda r: probe_pass_rates(cfg, r, model, tokenizer))
        rows = rows[[c for c in ordered.columns if c in rows.columns]]
        n = len(probe_rows)
        ordered = pd.concat([ordered.head(n), rows, ordered.iloc[n:]], ignore_index=True)
        probe_rows = ordered.head(n + len(rows))
        table.update(rates)
        fed = {"evolve_feed": fed}
    kept, summary = curriculum.keep_for_grpo(ordered, probe_rows, table, cfg)
    return kept, {**summary, **fed}


def in_window(paths: Paths, problems: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The problems on the levels of the frontier window (``frontier.json``), where the champion's pass
    rate was near the target: RL's groups vary there. All problems when there is no record or the
    window holds none (iteration 1, ``frontier.mode: fixed``)."""
    from apprentice.curriculum import frontier

    if not paths.frontier_record.exists():
        return problems, {}
    levels = frontier.band_levels(json.loads(paths.frontier_record.read_text()))
    if not levels:
        return problems, {}
    keep = [int(lv) in levels.get(str(f), []) for f, lv in zip(problems["family"], problems["level"], strict=True)]
    picked = problems.loc[keep].reset_index(drop=True)
    if picked.empty:
        return problems, {"window": levels, "window_problems": 0}
    return picked, {"window": levels, "window_problems": len(picked)}


def oracle_needs(problems: pd.DataFrame, tokenizer: Any) -> dict[str, Need]:
    """The oracle's tool calls and completion tokens per problem, as GRPO counts them: every token after
    the prompt (assistant turns and the tool responses the chat template wraps), through the model's own
    chat template. The oracle plays in milliseconds, so this costs a tokenization per problem."""
    from apprentice.curriculum import Need
    from apprentice.infra.distributed import run_episodes
    from apprentice.policies.oracle import OraclePolicy

    def ids(messages: list[dict[str, Any]], tools: list[dict[str, Any]], prompt: bool) -> int:
        out = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True, add_generation_prompt=prompt)
        return len(out["input_ids"] if hasattr(out, "keys") else out)

    needs = {}
    for t in run_episodes(problems, OraclePolicy(), samples_per_problem=1, progress=False, seed=0):
        msgs = [dict(m) for m in t.messages]
        first = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), None)
        if not t.success or first is None:
            continue  # the oracle did not solve it: nothing known (the gate and check-env report that)
        calls = sum(len(m.get("tool_calls") or []) for m in msgs if m.get("role") == "assistant")
        needs[str(t.problem_id)] = Need(calls, ids(msgs, t.tools, False) - ids(msgs[:first], t.tools, True))
    return needs


def fit_budget(cfg: Config, problems: pd.DataFrame, tokenizer: Any) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The problems whose oracle episode fits GRPO's budget (:mod:`apprentice.curriculum.budget`)."""
    from apprentice.curriculum import budget

    needs = oracle_needs(problems, tokenizer)
    kept = budget.within_budget(problems, needs, cfg.rl.max_completion_length, cfg.rl.max_tool_calls)
    return kept, budget.budget_summary(problems, kept, needs, cfg.rl.max_completion_length, cfg.rl.max_tool_calls)


def evolved_generations(cfg: Config, paths: Paths) -> list[pd.DataFrame] | None:
    """Generations 0..G of this iteration's evolve stage when the scheduler feeds them (else None)."""
    if not cfg.curriculum.evolve.feed:
        return None
    from apprentice.data.trajectories import read_parquet

    files = paths.evolve_generations()
    if not files:
        raise FileNotFoundError(f"curriculum.evolve.feed > 0 but {paths.evolve_dir} holds no generations; run "
                                f"`python -m apprentice evolve --iter {paths.iteration}` first (or set feed: 0)")
    return [read_parquet(f) for f in files]


def learning_rate(cfg: Config, paths: Paths) -> float:
    """GRPO's learning rate this iteration (:func:`apprentice.training.loop_rules.rl_learning_rate`): scaled
    like SFT's when SFT continued from a trained champion, which ``sft_start.json`` records."""
    from apprentice.training.loop_rules import rl_learning_rate

    start = json.loads(paths.sft_start.read_text()).get("start_model", {}) if paths.sft_start.exists() else {}
    return rl_learning_rate(cfg.loop.rule, paths.iteration, cfg.rl.learning_rate, cfg.loop.lr_factor,
                            trained_start=int(start.get("version") or 0) > 0)


def probe_pass_rates(cfg: Config, problems: pd.DataFrame, model: Any, tokenizer: Any) -> dict:
    from apprentice.curriculum import pass_rates
    from apprentice.infra.distributed import run_episodes
    from apprentice.policies.hf_cached import CachedHFPolicy

    was_training = model.training
    model.eval()
    # Probe what GRPO can do: its episodes stop after rl.max_tool_calls tool calls and
    # rl.max_completion_length tokens, so no probe turn needs more tokens or the episode more turns.
    # The KV-cache-reusing policy: each turn extends the cached keys/values of the conversation so far
    # instead of re-encoding it.
    policy = CachedHFPolicy(model, tokenizer, temperature=1.0,
                            max_new_tokens=min(cfg.evaluate.max_new_tokens, cfg.rl.max_completion_length),
                            batch_size=cfg.evaluate.batch_size, dtype=cfg.model.dtype, seed=cfg.rl.seed,
                            policy_id="rl-probe")
    # GRPO's max_completion_length budgets the whole episode, tool responses (as the chat template
    # wraps them) included. The ChatML wrapper below is the compact/qwen2.5 templates' (a model's own
    # template may differ by a few tokens, an approximation we accept). A probe that ignored the
    # wrappers would call long `search` episodes solvable that GRPO always truncates, and the samplers
    # would then pick groups with zero reward variance.
    def tool_turn_tokens(obs: str) -> int:
        wrapped = f"<|im_start|>user\n<tool_response>\n{obs}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        return len(tokenizer(wrapped, add_special_tokens=False)["input_ids"])

    trajs = run_episodes(problems, policy, engine=cfg.rollout.engine, ray=cfg.ray,  # ray: a replica per actor
                         samples_per_problem=cfg.rl.probe_samples,
                         max_turns=cfg.rl.max_tool_calls, batch_size=cfg.evaluate.batch_size,
                         seed=cfg.rl.seed, progress=enabled(), max_format_errors=cfg.evaluate.max_format_errors,
                         episode_tokens=cfg.rl.max_completion_length, count_tokens=tool_turn_tokens)
    model.train(was_training)
    return pass_rates([t.problem_id for t in trajs], [t.success for t in trajs])


def run(cfg: Config, paths: Paths, callbacks: list[Any] | None = None, reward_funcs: list[Any] | None = None,
        **_: Any) -> dict[str, Any]:
    from apprentice.data.trajectories import read_parquet
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.training import common
    from apprentice.training.rl import train_grpo

    common.setup_runtime(cfg)
    start = str(paths.sft_model)
    common.require_model(start)
    generations = evolved_generations(cfg, paths)
    rl_cfg = cfg.rl.model_copy(update={"learning_rate": learning_rate(cfg, paths)})
    stamp = common.fingerprint({"rl": rl_cfg.model_dump(), "model": cfg.model.model_dump(),
                                "curriculum": cfg.curriculum.model_dump(),
                                "probe": [cfg.evaluate.max_new_tokens, cfg.evaluate.batch_size,
                                          cfg.evaluate.max_format_errors]},
                               [paths.problems, paths.sft_model, *([] if generations is None else [paths.evolve_dir])])
    if common.is_done(paths.rl_model, stamp):
        return {"model": str(paths.rl_model), "skipped": True, "reason": "outputs up to date"}
    if cfg.rl.max_steps == 0:
        with atomic_path(paths.rl_model) as tmp:
            shutil.copytree(paths.sft_model, tmp)
            (tmp / common.STAMP_FILE).write_text(json.dumps(stamp))
            (tmp / common.METRICS_FILE).write_text("")
        return {"model": str(paths.rl_model), "steps": 0, "note": "rl.max_steps=0: SFT model copied"}

    tok = load_tokenizer(start, cfg.model.chat_template)
    model = load_model(start, dtype="fp32")
    all_problems = read_parquet(paths.problems)
    # The probe samples at temperature 1: a resumed run must keep the curriculum it started with.
    saved = common.work_dir_for(paths.rl_model) / CURRICULUM_FILE
    if saved.exists() and common.last_checkpoint(saved.parent):
        summary = json.loads(saved.read_text())
        pool = pd.concat([all_problems, *(generations or [])], ignore_index=True)[all_problems.columns]
        problems = pool.set_index("problem_id", drop=False).loc[summary["order"]].reset_index(drop=True)
    else:
        candidates, window = in_window(paths, all_problems)
        candidates, fitted = fit_budget(cfg, candidates, tok)
        problems, summary = select_problems(cfg, candidates, model, tok, generations)
        summary = {**summary, **window, **fitted}
        summary = {**summary, "order": problems["problem_id"].tolist()}
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(summary, indent=2))
    result = train_grpo(model, tok, problems, paths.rl_model, rl_cfg, dtype=cfg.model.dtype, stamp=stamp,
                        callbacks=callbacks or [], reward_funcs=reward_funcs or [],
                        extra_files={CURRICULUM_FILE: saved.read_text()})
    return {"start_model": start, "learning_rate": rl_cfg.learning_rate,
            "curriculum": {k: v for k, v in summary.items() if k != "order"}, **result}
