"""Rollouts and the rollout/evaluate stages with a real HFPolicy on a tiny random model."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from apprentice.config import load_config
from apprentice.data.trajectories import problems_frame, read_parquet, write_parquet
from apprentice.envs import FAMILIES
from apprentice.paths import Paths
from apprentice.policies.hf import HFPolicy
from apprentice.policies.hf_cached import CachedHFPolicy
from apprentice.rollout.episodes import run_episodes

pytestmark = pytest.mark.integration


def _specs():
    return [FAMILIES[f].generate(seed, level) for f in ("grid", "search") for level, seed in ((0, 1), (2, 2))]


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    return HFPolicy(tiny_model_dir, max_new_tokens=12, batch_size=16, dtype="fp32")


def test_tiny_model_rollout_records_tokens_and_counts_bad_output(tiny_policy):
    specs = _specs()
    trajs = run_episodes(specs, tiny_policy, max_turns=2, levels=[0, 2] * 2, progress=False)
    assert [t.problem_id for t in trajs] == [s.problem_id for s in specs]
    for t in trajs:
        assert t.policy_id == tiny_policy.policy_id and t.turns == 2 and t.truncated and not t.success
        # a random model writes no valid tool call: every turn is a counted parse error, answered
        # with an error observation, and the episode still runs to its budget
        assert t.parse_errors == 2
        assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "user", "assistant", "user"]
        assert t.prompt_tokens > 100 and 0 < t.completion_tokens <= 2 * 12
        assert t.tools == FAMILIES[t.family].tool_schemas()


@pytest.fixture(scope="module")
def chatty_policy(tiny_model_dir):
    """The tiny model with large random weights: greedy output is varied text, not one repeated token,
    so equal transcripts really mean equal generations."""
    import torch

    pol = HFPolicy(tiny_model_dir, max_new_tokens=12, batch_size=16, dtype="fp32")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in pol.model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return pol


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])  # forced: 'auto' would test only what this CPU picks
@pytest.mark.parametrize("chunked", [False, True])
def test_kv_cache_reuse_takes_the_same_actions_as_one_episode_at_a_time(chatty_policy, dtype, chunked, monkeypatch):
    """The engine (batched, KV reused across turns, shared prefixes) against plain HF ``generate``
    one conversation at a time, re-encoding everything, in the same compute dtype. bf16 autocast
    is where it breaks first (a StaticCache in bf16 fed RoPE keys in fp32 fails every generation with an
    index_copy_ dtype error).
    ``chunked``: free chunks, so every prefill runs in sub-batches, one per distinct new length."""
    import apprentice.policies.hf_cached as engine

    if chunked:
        monkeypatch.setattr(engine, "PREFILL_CALL_COST", 0)
        monkeypatch.setattr(engine, "PREFILL_SWAP_COST", 0)
    specs = _specs()
    cached = CachedHFPolicy.from_policy(chatty_policy, dtype=dtype)
    fast = run_episodes(specs, cached, max_turns=3, progress=False)
    single = HFPolicy(chatty_policy.model, chatty_policy.tokenizer, max_new_tokens=12, batch_size=1, dtype=dtype)
    plain = [run_episodes([s], single, max_turns=3, batch_size=1, progress=False)[0] for s in specs]
    assert len({t.messages[2]["content"] for t in plain}) > 1  # varied output, not a degenerate model
    assert [t.messages for t in fast] == [t.messages for t in plain]
    assert [t.completion_tokens for t in fast] == [t.completion_tokens for t in plain]
    # turn 1 shares each family's system prompt; later turns reuse the whole earlier conversation
    assert cached.stats["reused_tokens"] > 0.6 * cached.stats["prompt_tokens"]


def test_kv_cache_is_bounded_and_sampling_is_seeded(tiny_policy):
    specs = _specs()[::2]
    runs = []
    for _ in range(2):
        pol = CachedHFPolicy.from_policy(tiny_policy, cache_tokens=300)
        pol.temperature = 1.0
        runs.append(run_episodes(specs, pol, max_turns=2, progress=False))
        assert sum(len(e.ids) for e in pol._store) <= 300
    assert [t.messages for t in runs[0]] == [t.messages for t in runs[1]]


class _Recording(CachedHFPolicy):
    """The engine, recording the rows of each decode call and the store after each pre-decode eviction.
    It offers no ``live_rows``, so the rollout sends every live episode in one call, as a caller of
    ``act`` or ``complete_ids`` may: what the engine itself does when a call passes its budgets."""

    live_rows = None

    def _run(self, rows, *args):
        self.call_hits = {id(r): self._best(r)[1] for r in rows}  # what the store held for each row at the call
        out = super()._run(rows, *args)
        self.after_call = [*getattr(self, "after_call", []), sum(len(e.ids) for e in self._store)]
        return out

    def _decode(self, rows, *args):
        self.calls = [*getattr(self, "calls", []), len(rows)]
        self.lost = getattr(self, "lost", 0) + sum(self._best(r)[1] < self.call_hits[id(r)] for r in rows)
        return super()._decode(rows, *args)

    def _evict(self, reserve=0):
        dropped = super()._evict(reserve)
        if reserve:
            pinned = sum(len(e.ids) for e in self._store if id(e) in self._pinned)
            kept = sum(len(e.ids) for e in self._store) - pinned
            self.made_room = [*getattr(self, "made_room", []), (kept, pinned, reserve)]
        return dropped


def test_a_call_over_the_kv_budget_runs_in_parts_with_the_same_actions(chatty_policy):
    """``kv_gb`` bounds the engine in bytes: a call whose decode buffers would pass it is split into
    smaller calls (same greedy actions, fp32), and the prefix store makes room for a call's new
    entries before decoding, so it never holds the cap's worth of old entries plus the new ones."""
    specs = _specs() * 2
    ref = run_episodes(specs, CachedHFPolicy.from_policy(chatty_policy), max_turns=3, progress=False)
    tight = _Recording.from_policy(chatty_policy, cache_tokens=600)
    turn_prompt = max(t.prompt_tokens for t in ref) // 3  # prompt_tokens sums the 3 turns' prompts
    tight.buffer_tokens = 3 * (turn_prompt + tight.max_new_tokens)  # a few rows a call
    split = run_episodes(specs, tight, max_turns=3, progress=False)
    assert [t.messages for t in split] == [t.messages for t in ref]
    assert max(tight.calls) < len(specs) and len(tight.calls) > 3  # the 8 live episodes ran in parts
    per_layer = tight._buffers[0][0].numel() // (tight._kv_heads * tight._head_dim)
    assert per_layer <= tight.buffer_tokens
    # room is made before decoding: what stays plus what the call will add fits the cap (or nothing stays),
    # except the entries the call's later parts will reuse: pinned until the call ends, then the cap holds
    assert all(n + reserve <= tight.cache_tokens or n == 0 for n, _, reserve in tight.made_room)
    assert any(n + pinned > 0 for n, pinned, _ in tight.made_room)
    assert max(tight.after_call) <= tight.cache_tokens
    assert tight.lost == 0  # no part's eviction dropped what a later part of its call matched
    # the counters stats_line prints say so too: more parts than calls, each decode step's rows counted
    st = tight.stats
    assert st["parts"] == len(tight.calls) > st["calls"] and st["row_steps"] >= st["decode_steps"] > 0
    assert f"{st['calls']:.0f} calls in {st['parts']:.0f} parts" in tight.stats_line()


def _project(tmp_path, n=4):
    paths = Paths(tmp_path, 1)
    specs = _specs()[:n]
    write_parquet(problems_frame(specs, [0] * n, "train"), paths.problems)
    write_parquet(problems_frame(specs, [1] * n, "eval"), paths.eval_problems)
    (tmp_path / "params.yaml").write_text("{}\n")  # typed defaults
    return paths


def test_rollout_stage_with_oracle_is_complete_and_resumable(tmp_path):
    from apprentice.stages import rollout as stage

    paths = _project(tmp_path)
    cfg = load_config(tmp_path / "params.yaml")  # teacher = oracle
    first = stage.run(cfg, paths, progress=False)
    assert first["success_rate"] == 1.0 and first["episodes"] == 4 and not first["skipped"]
    df = read_parquet(paths.teacher_trajectories)
    assert df["success"].all() and (df["policy_id"] == "oracle").all()
    mtime = paths.teacher_trajectories.stat().st_mtime_ns
    again = stage.run(cfg, paths, progress=False)
    assert again["skipped"] and paths.teacher_trajectories.stat().st_mtime_ns == mtime
    cfg2 = load_config(tmp_path / "params.yaml", overrides=["rollout.samples_per_problem=2"])
    changed = stage.run(cfg2, paths, progress=False)
    assert not changed["skipped"] and changed["episodes"] == 8


def test_evaluate_stage_with_a_model_path_writes_episodes_and_metrics(tmp_path, tiny_model_dir, capsys):
    from apprentice.stages import evaluate as stage

    paths = _project(tmp_path, n=2)
    cfg = load_config(tmp_path / "params.yaml", overrides=["evaluate.max_new_tokens=8", "model.chat_template=model"])
    out = stage.run(cfg, paths, policy=tiny_model_dir, progress=False)
    name = out["policy"]
    metrics = json.loads((paths.eval_dir / f"{name}.json").read_text())
    episodes = pd.read_parquet(paths.eval_dir / f"{name}.parquet")
    assert len(episodes) == 2 and metrics["n_episodes"] == 2 and metrics["success_rate"] == 0.0
    assert metrics["parse_error_rate"] == 1.0 and "level_1/success_rate" in metrics
    printed = capsys.readouterr().out
    assert "success (95% Wilson CI)" in printed and f"evaluate {name}: engine " in printed
    assert stage.run(cfg, paths, policy=tiny_model_dir, progress=False)["skipped"]
    oracle = stage.run(cfg, paths, policy="oracle", progress=False)
    assert oracle["success_rate"] == 1.0 and (paths.eval_dir / "oracle.json").exists()


def test_evaluate_stage_drafts_a_model_from_its_parents_episodes(tmp_path, tiny_model_dir, capsys):
    """``evaluate --policy rl`` after ``--policy sft``: the RL model's turns are drafted from SFT's
    episodes (fp32: ``evaluate.drafts: auto`` uses them), and here, the same weights, it plays SFT's
    episodes; ``evaluate.drafts=false`` reads no drafts."""
    import shutil

    from apprentice.stages import evaluate as stage

    paths = _project(tmp_path, n=2)
    for model in (paths.sft_model, paths.rl_model):
        shutil.copytree(tiny_model_dir, model)
    sets = ["evaluate.max_new_tokens=8", "model.chat_template=model", "model.dtype=fp32"]
    cfg = load_config(tmp_path / "params.yaml", overrides=sets)
    stage.run(cfg, paths, policy="sft", progress=False)
    assert "draft turns" not in capsys.readouterr().out  # iteration 1's SFT has no scored parent
    stage.run(cfg, paths, policy="rl", progress=False)
    import re

    assert re.search(r"evaluate rl: [1-9]\d* draft turns from data/iter_1/eval/sft\.parquet", capsys.readouterr().out)
    sft, rl = (read_parquet(paths.eval_episodes(m)) for m in ("sft", "rl"))
    assert sft["messages"].tolist() == rl["messages"].tolist()
    off = load_config(tmp_path / "params.yaml", overrides=[*sets, "evaluate.drafts=false"])
    stage.run(off, paths, policy="rl", out=str(tmp_path / "off"), progress=False)
    assert "draft turns" not in capsys.readouterr().out
    assert read_parquet(tmp_path / "off" / "rl.parquet")["messages"].tolist() == rl["messages"].tolist()


def test_grouped_decode_attention_takes_the_same_actions_as_one_episode_at_a_time(chatty_policy, monkeypatch):
    """Decode steps read each group of rows' own columns only (rows sorted by first used column): with
    episodes admitted while others are turns ahead (batch 3 of 8), rows of one call start far apart.
    Groups made free and reordering forced, greedy fp32 actions still equal plain ``generate``'s."""
    import apprentice.policies.hf_cached as engine

    monkeypatch.setattr(engine, "GROUP_COST", 0)
    monkeypatch.setattr(engine, "worth_reordering", lambda *a: True)
    plans = []
    real = engine.decode_groups
    monkeypatch.setattr(engine, "decode_groups", lambda starts, end: plans.append(real(starts, end)) or plans[-1])
    specs = _specs() * 2
    fast = run_episodes(specs, CachedHFPolicy.from_policy(chatty_policy), max_turns=3, batch_size=3, progress=False)
    single = HFPolicy(chatty_policy.model, chatty_policy.tokenizer, max_new_tokens=12, batch_size=1, dtype="fp32")
    plain = [run_episodes([s], single, max_turns=3, batch_size=1, progress=False)[0] for s in specs]
    assert [t.messages for t in fast] == [t.messages for t in plain]
    assert any(len(p) > 1 and p[-1][2] > p[0][2] for p in plans)  # some steps ran several groups, later ones starting later



def _own_completions(policy, n):
    """``n`` prompts as token ids, and the engine's greedy completion of each (no drafts)."""
    import numpy as np

    tok = policy.tokenizer
    rows = [np.asarray(tok(policy.render([{"role": "user", "content": f"Question {i}: where is the key?"}], []),
                           add_special_tokens=False)["input_ids"], dtype=np.int64) for i in range(n)]
    fresh = CachedHFPolicy.from_policy(policy, dtype=policy.dtype)
    return rows, [ids for ids, _ in fresh._run(rows, 0.0, 1.0, fresh.max_new_tokens)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_draft_of_the_models_own_completion_is_accepted_and_a_wrong_one_changes_nothing(chatty_policy, dtype,
                                                                                          monkeypatch):
    """Greedy calls with drafts (``_verify``) give the completions the engine gives without them: a
    draft that is the model's own greedy completion is accepted (no decode step for its row); a draft
    with one token changed keeps the tokens before it and its row decodes on from there, to the
    completion it would have had without a draft."""
    import numpy as np

    import apprentice.policies.hf_cached as engine

    monkeypatch.setattr(engine, "DRAFT_MARGINS", {})  # the random model has near-ties; the rule itself: below
    monkeypatch.setattr(engine, "DRAFT_MARGIN_LOW_PRECISION", 0.0)
    pol = CachedHFPolicy.from_policy(chatty_policy, dtype=dtype)
    rows, ref = _own_completions(pol, 6)
    drafts = [np.asarray(out, dtype=np.int64) for out in ref]
    middle = len(drafts[-1]) // 2
    drafts[-1][middle] += 1  # one wrong token in the middle of the last draft
    drafts[-2][0] += 1  # one wrong first token
    drafts[2] = None  # and a row without one
    got = [ids for ids, _ in pol._run(rows, 0.0, 1.0, pol.max_new_tokens, drafts)]
    assert got == ref
    assert pol.stats["drafted_rows"] == 5 and pol.stats["accepted_rows"] <= 3 and pol.stats["draft_tokens_kept"] > 0
    if dtype == "fp32":  # the right drafts accepted, the wrong row kept the tokens before its wrong one
        assert pol.stats["accepted_rows"] == 3
        assert pol.stats["draft_tokens_kept"] == sum(len(ref[i]) for i in (0, 1, 3)) + middle
    # bf16: a prefill rounds apart from a decode step, and at this test's zero margin this random model's
    # near-ties (exact ties, in bf16) stop a right draft early on one CPU and not on another, so how many
    # are accepted depends on the CPU: the completions above are what must not move
    # the store holds every row's prompt + completion, drafted or not: a next turn reuses them
    pol.complete_ids([r.tolist() + out + [5] for r, out in zip(rows, ref, strict=True)])
    assert pol.stats["reused_tokens"] > 0.9 * sum(len(r) + len(out) for r, out in zip(rows, ref, strict=True))


def test_a_draft_is_accepted_only_where_the_model_is_sure_of_every_token(chatty_policy, monkeypatch):
    """``DRAFT_MARGINS``: a prefill sums in another order than a decode step, so a draft decides only
    tokens whose argmax leads by the margin; with an impossible margin no draft is accepted and the
    completions are still the engine's own."""
    import numpy as np

    import apprentice.policies.hf_cached as engine

    monkeypatch.setattr(engine, "DRAFT_MARGINS", {})
    monkeypatch.setattr(engine, "DRAFT_MARGIN_LOW_PRECISION", 1e9)
    pol = CachedHFPolicy.from_policy(chatty_policy)
    rows, ref = _own_completions(pol, 3)
    got = [ids for ids, _ in pol._run(rows, 0.0, 1.0, pol.max_new_tokens, [np.asarray(o) for o in ref])]
    assert got == ref
    assert pol.stats["drafted_rows"] == 3 and pol.stats["accepted_rows"] == 0


def test_episodes_read_back_from_parquet_draft_every_turn_of_a_replay(chatty_policy, tmp_path):
    """``add_drafts`` with stored episodes: replaying them, every turn of every episode finds its draft,
    though Parquet sorted the episodes' JSON keys (matching is by content, not key order), and the
    episodes come out as they were played."""
    specs = _specs()
    first = run_episodes(specs, CachedHFPolicy.from_policy(chatty_policy), max_turns=3, progress=False)
    write_parquet(pd.DataFrame([t.to_row() for t in first]), tmp_path / "parent.parquet")
    stored = read_parquet(tmp_path / "parent.parquet")
    pol = CachedHFPolicy.from_policy(chatty_policy)
    added = pol.add_drafts((json.loads(m), json.loads(t)) for m, t in stored[["messages", "tools"]].itertuples(index=False))
    assert added == sum(t.turns for t in first) == 3 * len(specs)
    again = run_episodes(specs, pol, max_turns=3, progress=False)
    assert [t.messages for t in again] == [t.messages for t in first]
    assert pol.stats["drafted_rows"] == added


def test_a_draft_is_the_stored_turn_as_the_chat_template_writes_it(chatty_policy, tmp_path):
    """The draft of a stored tool call (the oracle's, read back from Parquet) is the template's rendering
    of it up to the end-of-turn token: decoded and parsed, the same tool call."""
    from apprentice.policies.oracle import OraclePolicy
    from apprentice.policies.toolcalls import parse_assistant

    episodes = run_episodes(_specs(), OraclePolicy(), max_turns=3, progress=False)
    write_parquet(pd.DataFrame([t.to_row() for t in episodes]), tmp_path / "oracle.parquet")
    stored = read_parquet(tmp_path / "oracle.parquet")
    pol = CachedHFPolicy.from_policy(chatty_policy)
    pol.add_drafts((json.loads(m), json.loads(t)) for m, t in stored[["messages", "tools"]].itertuples(index=False))
    for t in episodes:  # the live objects: key order as the environment wrote it
        conv = t.messages[:2]
        draft = pol._draft_ids(conv, t.tools, pol.render(conv, t.tools), max_new_tokens=96)
        assert draft is not None and draft[-1] in pol.stop_ids and not set(draft[:-1].tolist()) & set(pol.stop_ids)
        msg, err = parse_assistant(pol.tokenizer.decode(draft[:-1].tolist(), skip_special_tokens=True))
        assert err is None and msg["tool_calls"] == t.messages[2]["tool_calls"]
    # max_new_tokens cuts a draft as it would cut the turn
    assert len(pol._draft_ids(conv, t.tools, pol.render(conv, t.tools), max_new_tokens=3)) == 3


def test_live_rows_leaves_the_store_room_for_each_rows_next_turn(chatty_policy):
    """``live_rows`` sizes a row as it will be after the next call: its prompt, a reply and the new
    tokens it brought to this call (which the next brings again). Sized at the last call alone, the live
    rows would pass the store at the next one and be re-encoded, losing the reuse the store exists for."""
    import numpy as np

    pol = CachedHFPolicy.from_policy(chatty_policy, cache_tokens=2000)
    rng = np.random.default_rng(0)
    rows = [rng.integers(100, 1000, size=30 + 5 * i) for i in range(4)]  # no common prefix to share
    first = pol._run(rows, 0.0, 1.0, pol.max_new_tokens)
    rows = [np.concatenate([r, np.asarray(ids, dtype=np.int64), rng.integers(100, 1000, size=10)])
            for r, (ids, _) in zip(rows, first, strict=True)]  # each conversation's next turn: reply + observation
    second = pol._run(rows, 0.0, 1.0, pol.max_new_tokens)
    new = [len(r) - reused for r, (_, reused) in zip(rows, second, strict=True)]
    assert min(new) >= 10  # the observation, at least, was not in the store
    size = np.mean([len(r) for r in rows]) + pol.max_new_tokens + np.mean(new)
    assert pol.live_rows(1000) == int(2000 // size) < int(2000 // (size - np.mean(new)))
