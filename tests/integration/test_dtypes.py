"""Both compute dtypes in every path that runs a model, on any CPU.

``model.dtype: auto`` means bf16 autocast on AMX machines and fp32 on AVX2-only ones, so a CI on
either kind would only ever exercise one of them. Every test here forces each dtype explicitly (bf16
autocast runs on AVX2 too, emulated), so a break in either is caught on whichever machine runs it:
generation (plain ``HFPolicy``, the KV-reusing engine over multi-turn episodes, ``serve``) and one
step of each trainer (SFT, GRPO, distillation with its OPD step).

The tolerance between the two (also printed by ``bench/dtype.py`` on the real model): the same
batch's SFT loss within 2 % relative, next-token log-probs within 0.05 nats mean absolute.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from echokit import EchoEnv, config, write_data  # noqa: E402

from apprentice.lm import modeling  # noqa: E402
from apprentice.paths import Paths  # noqa: E402

pytestmark = pytest.mark.integration
DTYPES = ["fp32", "bf16"]
SFT_LOSS_REL_TOL = 0.02
LOGPROB_ABS_TOL = 0.05


@pytest.fixture
def training_precision(monkeypatch):
    """Whether autocast was on in each forward pass that built a graph (a training forward): the
    trainers' own loss paths call the backbone directly, past the autocast accelerate puts on
    ``model.forward``, so a bf16 run can silently train in fp32 (SFT's and distillation's loss paths
    both go that way)."""
    from transformers.models.llama import modeling_llama

    seen: list[bool] = []
    forward = modeling_llama.LlamaModel.forward

    def spy(self, *args, **kwargs):
        if torch.is_grad_enabled():
            seen.append(torch.is_autocast_enabled("cpu"))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaModel, "forward", spy)
    return seen


def _specs():
    from apprentice.envs import FAMILIES

    return [FAMILIES[f].generate(seed, level) for f in ("grid", "search") for level, seed in ((0, 1), (2, 2))]


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_and_kv_reusing_generation_run_multi_turn_episodes(tiny_model_dir, dtype):
    from apprentice.policies.hf import HFPolicy
    from apprentice.policies.hf_cached import CachedHFPolicy
    from apprentice.rollout.episodes import run_episodes

    plain = HFPolicy(tiny_model_dir, max_new_tokens=10, batch_size=8, dtype=dtype)
    assert plain.dtype == modeling.resolve_dtype(dtype)
    cached = CachedHFPolicy.from_policy(plain)
    specs = _specs()
    for pol in (plain, cached):
        trajs = run_episodes(specs, pol, max_turns=3, progress=False)
        assert len(trajs) == len(specs)
        assert all(t.turns == 3 and t.completion_tokens > 0 for t in trajs)  # every turn generated
    assert cached.stats["reused_tokens"] > 0  # turns 2 and 3 ran on the stored keys/values
    # a store that holds ~2 conversations: after the first round the rollout gets no more rows than fit
    small = CachedHFPolicy.from_policy(plain, cache_tokens=800)
    assert small.live_rows(64) == 64  # nothing measured yet
    batches: list[int] = []
    act = small.act
    small.act = lambda convs, tools, **kw: batches.append(len(convs)) or act(convs, tools, **kw)  # type: ignore[method-assign]
    trajs = run_episodes(specs, small, max_turns=3, progress=False)
    assert all(t.turns == 3 for t in trajs) and batches[0] == len(specs)
    assert 1 <= small.live_rows(64) == 800 // small._row_tokens < len(specs)
    assert max(batches[1:]) < len(specs) and sum(batches) == 3 * len(specs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_serve_answers_a_tool_call_request(tiny_model_dir, dtype):
    from fastapi.testclient import TestClient

    from apprentice.infra.serve import create_app
    from apprentice.policies.hf import HFPolicy

    app = create_app(HFPolicy(tiny_model_dir, max_new_tokens=8, dtype=dtype), "tiny", batch_size=2)
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Word: red"}],
            "tools": EchoEnv.tool_schemas(), "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_sft_step(tmp_path, tiny_model_dir, dtype, echo_env, training_precision):
    from apprentice.stages import sft

    paths = Paths(tmp_path)
    write_data(paths, n=2)
    cfg = config(tiny_model_dir, model={"dtype": dtype}, sft={"max_steps": 1, "batch_size": 2, "max_length": 128})
    result = sft.run(cfg, paths)
    assert result["steps"] == 1
    assert (paths.sft_model / "config.json").exists()
    assert training_precision and set(training_precision) == {dtype == "bf16"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_grpo_step(tmp_path, tiny_model_dir, dtype, echo_env, training_precision):
    from apprentice.stages import rl

    paths = Paths(tmp_path)
    write_data(paths)
    shutil.copytree(tiny_model_dir, paths.sft_model)
    cfg = config(tiny_model_dir, model={"dtype": dtype},
                 rl={"max_steps": 1, "prompts_per_step": 2, "num_generations": 2, "max_completion_length": 16,
                     "probe_samples": 2, "probe_problems": 2})
    result = rl.run(cfg, paths, reward_funcs=[lambda completions, **kw: [float(len(str(c)) % 3) for c in completions]])
    assert result["steps"] == 1
    assert training_precision and set(training_precision) == {dtype == "bf16"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_distillation_warm_start_and_one_opd_step(tmp_path, smol_tokenizer_dir, dtype, echo_env, training_precision):
    from apprentice.lm.modeling import load_tokenizer, make_tiny_model
    from apprentice.stages import distill

    paths = Paths(tmp_path)
    write_data(paths, n=2)
    make_tiny_model(load_tokenizer(smol_tokenizer_dir), paths.sft_model, hidden=64, layers=4, seed=1)
    cfg = config(str(paths.sft_model), model={"dtype": dtype}, sft={"batch_size": 2, "max_length": 128},
                 distill={"max_steps": 1, "batch_size": 2, "max_completion_length": 8,
                          "student": {"keep_every": 3, "warmup_steps": 1}})
    result = distill.run(cfg, paths)
    assert result["steps"] == 1
    assert (paths.student_model / "config.json").exists()
    assert len(training_precision) >= 2  # the warm start's step and the OPD step
    assert set(training_precision) == {dtype == "bf16"}


def test_bf16_stays_within_tolerance_of_fp32(tiny_model_dir, smol_tokenizer_dir):
    """Same model, same batch: the loss and the log-probs bf16 autocast computes are fp32's, rounded."""
    tok = modeling.load_tokenizer(smol_tokenizer_dir)
    model = modeling.load_model(tiny_model_dir)
    text = ["<|im_start|>user\nWord: red<|im_end|>\n<|im_start|>assistant\nsay red<|im_end|>"] * 2
    batch = tok(text, return_tensors="pt")
    out = {}
    with torch.no_grad():
        for dtype in DTYPES:
            with modeling.autocast(dtype, "cpu"):
                res = model(**batch, labels=batch["input_ids"])
            out[dtype] = (float(res.loss), torch.log_softmax(res.logits.float(), -1))
    (l32, lp32), (l16, lp16) = out["fp32"], out["bf16"]
    assert abs(l16 - l32) / l32 < SFT_LOSS_REL_TOL, (l16, l32)
    assert float((lp16 - lp32).abs().mean()) < LOGPROB_ABS_TOL
    assert float((lp16 - lp32).abs().mean()) > 0  # bf16 really ran (autocast was not a no-op)
