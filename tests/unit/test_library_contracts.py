"""Every private library method we override or call is pinned, and its contract checked here.

If one of these fails after a version bump, the override in question must be re-read against the new
library source before the pin in pyproject.toml (and requirements.lock) moves.
"""

from __future__ import annotations

import inspect
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PINNED = ("trl", "transformers", "dvclive")  # dvclive: Live._init_dvc (training/loggers.py)


def _pyproject_pins() -> dict[str, str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {m.group(1).lower(): m.group(2) for d in deps if (m := re.match(r"([A-Za-z0-9_.-]+)==([^;\s]+)", d))}


def _lock() -> dict[str, str]:
    out = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, ver = line.split("==", 1)
            out[name.strip().lower()] = ver.strip()
    return out


def test_overridden_libraries_are_pinned_exactly_and_match_the_lock():
    from importlib.metadata import version

    pins, lock = _pyproject_pins(), _lock()
    for lib in PINNED:
        assert lib in pins, f"pyproject.toml must pin {lib} exactly (==): we override its private methods"
        assert pins[lib] == lock[lib], f"{lib}: pyproject pins {pins[lib]}, requirements.lock {lock[lib]}"
        assert version(lib).split("+")[0] == pins[lib].split("+")[0], f"installed {lib} {version(lib)} != pin"


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _calls(cls, caller: str, callee: str) -> bool:
    return f"self.{callee}(" in inspect.getsource(getattr(cls, caller))


def test_grpo_generate_single_turn_override():
    """CurriculumGRPOTrainer._generate_single_turn samples through the engine in place of TRL's plain
    ``generate`` path: same arguments, same return (completion ids, logprobs), the switches it reads
    to leave vLLM / continuous batching to TRL; ``_generate`` is the phase after which it frees the
    engine's cache (a behaviour test: tests/integration/test_training.py)."""
    from trl import GRPOTrainer

    from apprentice.training.rl import CurriculumGRPOTrainer

    assert "_generate_single_turn" in vars(GRPOTrainer) and "_generate" in vars(GRPOTrainer)
    assert _calls(GRPOTrainer, "_generate", "_generate_single_turn")
    assert _params(GRPOTrainer._generate_single_turn) == ["self", "prompt_ids", "images", "multimodal_fields",
                                                          "num_generations", "has_tool_images"]
    assert _params(CurriculumGRPOTrainer._generate_single_turn) == _params(GRPOTrainer._generate_single_turn)
    src = inspect.getsource(GRPOTrainer._generate_single_turn)
    assert "return completion_ids, logprobs" in src and "logprobs = None" in src
    for attr in ("self.use_vllm", "self.use_transformers_continuous_batching", "self.generation_config",
                 "self.eos_token_ids"):
        assert attr in src, attr
    init = inspect.getsource(GRPOTrainer.__init__)
    assert '"max_new_tokens": self.max_completion_length' in init and "self.eos_token_ids = eos_token_ids" in init


def test_grpo_dynamic_sampling_override():
    """DynamicSampling wraps GRPOTrainer._generate_and_score_completions: TRL calls it with the generation
    batch (each prompt num_generations times in a row), computes the advantages within each group of
    consecutive rows, and returns the per-row tensors the wrapper merges (prompts left-padded, completions
    right-padded) with ``num_items_in_batch`` from the completion and tool masks."""
    from trl import GRPOTrainer

    from apprentice.training.dynamic_sampling import DynamicSampling
    from apprentice.training.rl import CurriculumGRPOTrainer

    assert _params(GRPOTrainer._generate_and_score_completions) == ["self", "inputs"]
    assert _calls(GRPOTrainer, "_prepare_inputs", "_generate_and_score_completions")
    assert CurriculumGRPOTrainer.__mro__.index(DynamicSampling) < CurriculumGRPOTrainer.__mro__.index(GRPOTrainer)
    src = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch",
                "tool_mask"):
        assert f'"{key}"' in src, f"TRL's generation batch no longer carries {key!r}"
    assert "view(-1, num_generations)" in src  # group statistics over consecutive rows
    assert "loss_mask = completion_mask if tool_mask is None else completion_mask * tool_mask" in src
    assert 'padding_side="left"' in src or "padding_side='left'" in src or "pad(" in src


def test_distillation_generate_single_turn_override():
    """ApprenticeDistillationTrainer._generate_single_turn samples the student through the engine in
    place of TRL's plain ``generate`` path: same arguments, the completion ids as the return."""
    from trl.trainer.distillation_trainer import DistillationTrainer

    from apprentice.training.distill import ApprenticeDistillationTrainer

    assert _params(DistillationTrainer._generate_single_turn) == ["self", "prompt_ids", "images",
                                                                  "multimodal_fields", "has_tool_images"]
    assert _params(ApprenticeDistillationTrainer._generate_single_turn) == _params(DistillationTrainer._generate_single_turn)
    src = inspect.getsource(DistillationTrainer._generate_single_turn)
    assert "return completion_ids" in src and "self.use_vllm" in src and "self.generation_config" in src
    assert _calls(DistillationTrainer, "_generate", "_generate_single_turn")
    init = inspect.getsource(DistillationTrainer.__init__)
    assert '"max_new_tokens": self.max_completion_length' in init and "self.eos_token_ids = eos_token_ids" in init


@pytest.fixture(scope="module")
def distill_cls():
    from trl.trainer.distillation_trainer import DistillationTrainer

    return DistillationTrainer


def test_distillation_generate_and_score_completions_override(distill_cls):
    """Both our distillers replace it: TRL calls it with the generation batch and splits the dict it returns."""
    assert _params(distill_cls._generate_and_score_completions) == ["self", "inputs"]
    assert _calls(distill_cls, "_prepare_inputs", "_generate_and_score_completions")
    src = inspect.getsource(distill_cls._generate_and_score_completions)
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "num_items_in_batch"):
        assert f'"{key}"' in src, f"TRL's generation batch no longer carries {key!r}"


def test_distillation_generate_and_tokenize_prompts_overrides(distill_cls):
    assert _params(distill_cls._generate) == ["self", "prompts"]
    assert _params(distill_cls._tokenize_prompts) == ["self", "prompts"]
    assert "_generate_single_turn" in vars(distill_cls)
    assert _calls(distill_cls, "_generate_single_turn", "_tokenize_prompts") or _calls(
        distill_cls, "_generate", "_tokenize_prompts")


def test_distillation_compute_loss_override(distill_cls):
    """OPDTrainer._compute_loss: called through _forward_redirection with (student, inputs,
    num_items_in_batch), where num_items_in_batch = the window's loss tokens / processes; returns
    (loss, entropy_sum, n_valid)."""
    assert _params(distill_cls._compute_loss) == ["self", "unwrapped_student", "inputs", "num_items_in_batch"]
    src = inspect.getsource(distill_cls.compute_loss)
    assert 'inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes' in src
    assert "loss, entropy_sum, num_valid_tokens = self._forward_redirection(" in src
    assert "self._compute_loss, unwrapped_student, inputs, num_items_in_batch" in src
    assert _params(distill_cls._get_last_hidden_state)[:5] == [
        "self", "unwrapped_model", "input_ids", "attention_mask", "logits_to_keep"]


def test_distillation_micro_batches_share_one_generation_and_one_token_count(distill_cls):
    """``distill.micro_batch_size`` is exact only because TRL generates once per optimizer step, splits
    that batch into ``gradient_accumulation_steps`` pieces, divides every piece's loss by the whole
    step's token count and tells the Trainer not to divide again: 8 prompts at once and the same
    8 in 4 micro-batches give the same step loss and grad norm."""
    assert distill_cls.loss_is_scaled_for_ga is True
    src = inspect.getsource(distill_cls._prepare_inputs)
    assert "generate_every = self.args.gradient_accumulation_steps" in src
    assert "split_tensor_dict(generation_batch, self.args.gradient_accumulation_steps)" in src
    gen = inspect.getsource(distill_cls._generate_and_score_completions)
    assert "num_items_in_batch = self.accelerator.gather(loss_mask.sum()).sum()" in gen


def test_trainer_signature_columns_override():
    """OPDTrainer._set_signature_columns_if_needed keeps the ``spec`` column TRL would drop."""
    from transformers import Trainer

    assert _params(Trainer._set_signature_columns_if_needed) == ["self"]
    assert "self._signature_columns" in inspect.getsource(Trainer._set_signature_columns_if_needed)


def test_grpo_scoring_override():
    """SharedPromptScoring._get_per_token_logps_and_entropies keeps TRL's signature and returns, and
    relies on its fused LM head taking ``shift_labels`` and passing other kwargs to the backbone."""
    from trl import GRPOTrainer
    from trl.trainer import utils

    params = _params(GRPOTrainer._get_per_token_logps_and_entropies)
    assert params[:7] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                          "compute_entropy"] and params[7] == "compute_aux_loss"
    src = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "outputs = model(**model_inputs, labels=labels, fused_lm_head=True)" in src
    assert "return logps, entropies, aux_loss" in src
    head = inspect.getsource(utils.add_fused_lm_head)
    assert "shift_labels=None" in head and "backbone_outputs = getattr(self, backbone_attr)(*args, **kwargs)" in head
    assert "labels = shift_labels" in head


def test_trainer_train_sampler_override():
    """ApprenticeSFTTrainer._get_train_sampler returns a per-index sampler for the DataLoader that
    transformers builds from it (``sampler=``, cut into ``train_batch_size`` runs), or defers to it."""
    from transformers import Trainer

    assert _params(Trainer._get_train_sampler) == ["self", "train_dataset"]
    loader = inspect.getsource(Trainer._get_dataloader)
    assert "sampler = sampler_fn(dataset)" in loader and 'dataloader_params["sampler"] = sampler' in loader
    assert "sampler_fn=self._get_train_sampler" in inspect.getsource(Trainer.get_train_dataloader)


def test_chunked_divergence_kernel_positional_contract():
    """losses.chunked_per_token_divergence calls ChunkedDivergenceFunction.apply with 12 positional args."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    names = _params(ChunkedDivergenceFunction.forward)
    assert names[:1] == ["ctx"] and len(names) - 1 == 12, names
    assert names[1:9] == ["student_hidden", "student_weight", "student_bias", "teacher_hidden", "teacher_weight",
                          "teacher_bias", "beta", "temperature"], names


def test_dvclive_init_dvc_override():
    """loggers._stage_live overrides Live._init_dvc (the repo probe that may `dvc init`); Live.__init__ must
    still call it by that name, and the pipeline attributes it sets must still exist."""
    from dvclive import Live

    assert "_init_dvc" in vars(Live)
    assert _calls(Live, "__init__", "_init_dvc")
    src = inspect.getsource(Live.__init__)
    assert "self._inside_dvc_pipeline" in src and "self._save_dvc_exp" in src


def test_static_layer_contract_for_the_engine_layer():
    """The engine's ``_EngineLayer`` swaps its class into transformers' ``StaticLayer`` objects: the
    layer must still call ``lazy_initialization`` from ``update`` and ``early_initialization``, write at
    its ``cumulative_length`` and return its own tensors; the cast must store bf16 keys exactly; with
    ``buffers`` set, keys/values are views of them (no allocation), stale values left in place."""
    import torch
    from transformers.cache_utils import StaticCache, StaticLayer

    from apprentice.policies.hf_cached import _EngineLayer

    assert _params(StaticLayer.update)[:3] == ["self", "key_states", "value_states"]
    assert _params(StaticLayer.lazy_initialization) == ["self", "key_states", "value_states"]
    layer = StaticLayer(max_cache_len=6)
    layer.__class__ = _EngineLayer
    layer.lazy_initialization(torch.zeros(1, 2, 1, 4, dtype=torch.bfloat16), torch.zeros(1, 2, 1, 4, dtype=torch.bfloat16))
    layer.cumulative_length.fill_(2)
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4).bfloat16()
    keys, values = layer.update(k, v)
    assert keys is layer.keys and values is layer.values and keys.dtype == torch.bfloat16
    assert torch.equal(keys[:, :, 2:5], k.bfloat16()) and torch.equal(values[:, :, 2:5], v)
    assert not keys[:, :, :2].any() and int(layer.cumulative_length) == 5

    # through StaticCache.early_initialization, into reused buffers
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=2)
    bufs = (torch.full((100,), 7.0), torch.full((100,), 7.0))
    cache = StaticCache(config=cfg, max_cache_len=5)
    cache.layers[0].__class__ = _EngineLayer
    cache.layers[0].buffers = bufs
    cache.early_initialization(2, 2, 4, torch.float32, torch.device("cpu"))
    lay = cache.layers[0]
    assert lay.keys.shape == (2, 2, 5, 4) and lay.keys.data_ptr() == bufs[0].data_ptr()
    assert lay.values.data_ptr() == bufs[1].data_ptr() and bool((lay.keys == 7).all())
    lay.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4))
    assert bool((lay.keys[:, :, 0] == 1).all()) and bool((lay.keys[:, :, 1:] == 7).all())
    assert bool((bufs[0][:4] == 1).all()) and int(lay.cumulative_length) == 1


def test_sdpa_force_gqa_switch_is_read_per_call():
    """The engine's prefill sets ``TRANSFORMERS_SDPA_FORCE_GQA`` for its forward passes only
    (``hf_cached._gqa_sdpa``): transformers must read it on every call, with a mask present."""
    import torch
    from transformers.integrations import sdpa_attention

    from apprentice.policies.hf_cached import _gqa_sdpa

    k = torch.zeros(1, 2, 3, 4)
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    assert not sdpa_attention.use_gqa_in_sdpa(mask, k, k)
    with _gqa_sdpa():
        assert sdpa_attention.use_gqa_in_sdpa(mask, k, k)
    assert not sdpa_attention.use_gqa_in_sdpa(mask, k, k)
    assert "use_gqa_in_sdpa(attention_mask, key, value)" in inspect.getsource(sdpa_attention.sdpa_attention_forward)


def test_attention_functions_are_looked_up_per_forward_with_a_local_override():
    """The engine's decode steps override transformers' ``sdpa`` attention through the global
    interface's local mapping (``hf_cached._grouped_decode``): the model must look the function up
    on every forward, by ``config._attn_implementation``, and the override must be undone after."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama

    from apprentice.policies.hf_cached import _grouped_decode, _grouped_sdpa

    src = inspect.getsource(modeling_llama.LlamaAttention.forward)
    assert "ALL_ATTENTION_FUNCTIONS.get_interface(" in src and "self.config._attn_implementation" in src
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    with _grouped_decode():
        assert ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None) is _grouped_sdpa
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    params = list(inspect.signature(sdpa_attention_forward).parameters)
    assert params[:5] == ["module", "query", "key", "value", "attention_mask"]


def test_the_engine_samples_only_generation_configs_it_implements():
    """TRL's own sampling config (greedy or temperature + top_p, top_k 0) goes to the engine; any other
    setting a user passes through ``generation_kwargs`` leaves sampling to TRL's ``generate``."""
    from transformers import GenerationConfig

    from apprentice.training.sampling import engine_can_sample

    trl = dict(max_new_tokens=256, do_sample=True, pad_token_id=2, bos_token_id=1, eos_token_id=[2], temperature=1.0,
               top_p=0.9, top_k=0, min_p=None, repetition_penalty=1.0, cache_implementation=None, disable_compile=True)
    assert engine_can_sample(GenerationConfig(**trl))
    assert engine_can_sample(GenerationConfig(**{**trl, "do_sample": False}))
    for other in ({"top_k": 50}, {"min_p": 0.1}, {"repetition_penalty": 1.2}, {"no_repeat_ngram_size": 3},
                  {"stop_strings": ["</tool>"]}, {"typical_p": 0.5}, {"num_beams": 2}, {"max_new_tokens": None}):
        assert not engine_can_sample(GenerationConfig(**{**trl, **other})), other
