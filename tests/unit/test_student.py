"""Student construction: layer-pruned copy of the teacher, or a given model checked for compatibility."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from apprentice.training.student import build_student, check_compatible, kept_layers, num_params, prune_layers


def _llama(layers: int, vocab: int = 512, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, use_cache=False)
    return LlamaForCausalLM(cfg).eval()


def test_kept_layers_every_kth_plus_last():
    assert kept_layers(30, 3) == [0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 29]
    assert kept_layers(4, 2) == [0, 2, 3]
    assert kept_layers(3, 1) == [0, 1, 2]
    with pytest.raises(ValueError):
        kept_layers(4, 0)


def test_pruned_student_is_smaller_fresh_and_copies_weights():
    teacher = _llama(6)
    student = prune_layers(teacher, keep_every=3)  # keeps 0, 3, 5
    assert student.config.num_hidden_layers == 3
    assert num_params(student) < num_params(teacher)
    # fresh module: layer_idx renumbered (KV-cache indexing depends on it)
    assert [layer.self_attn.layer_idx for layer in student.model.layers] == [0, 1, 2]
    for new, old in enumerate([0, 3, 5]):
        assert torch.equal(student.model.layers[new].mlp.up_proj.weight, teacher.model.layers[old].mlp.up_proj.weight)
    assert torch.equal(student.model.embed_tokens.weight, teacher.model.embed_tokens.weight)
    assert torch.equal(student.model.norm.weight, teacher.model.norm.weight)
    assert student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()  # tied
    # a config saved by SFTTrainer says use_cache=False: a student built from it would generate uncached
    assert student.config.use_cache and student.generation_config.use_cache


def test_pruned_student_forward_and_cached_generation_match_vocab(smol_tokenizer_dir):
    from apprentice.lm.modeling import load_tokenizer

    tok = load_tokenizer(smol_tokenizer_dir)
    teacher = _llama(4, vocab=len(tok))
    student = build_student(teacher, "prune", keep_every=2, teacher_tokenizer=tok)
    ids = tok("Hello there", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = student(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    check_compatible(student, teacher, tok, tok)  # same tokenizer: no error
    out = student.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():  # the KV cache gives the same tokens as recomputing from scratch
        x = ids
        for _ in range(4):
            x = torch.cat([x, student(x, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, x)


def test_student_from_path_with_other_vocabulary_is_rejected(tmp_path):
    teacher = _llama(2, vocab=512)
    other = _llama(1, vocab=300)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary size 300 != teacher's 512"):
        build_student(teacher, str(tmp_path / "other"))
    same = _llama(1, vocab=512, seed=1)
    same.save_pretrained(tmp_path / "same")
    student = build_student(teacher, str(tmp_path / "same"))
    assert student.config.num_hidden_layers == 1 and student.config.use_cache
