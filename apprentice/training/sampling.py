"""TRL trainers sampling through the pipeline's generation engine: one engine for every generation.

GRPO (:mod:`apprentice.training.rl`) and on-policy distillation (:mod:`apprentice.training.distill`)
sample from the model they train. TRL's trainers do it in ``_generate_single_turn``, which gets
token ids and, off vLLM, left-pads them into one batched ``generate`` call that re-encodes every
prompt, every tool round. :class:`EngineSampling` answers the same call with
:meth:`CachedHFPolicy.complete_ids <apprentice.policies.hf_cached.CachedHFPolicy.complete_ids>`: an
episode's tool rounds reuse the keys/values of its earlier rounds, and copies of one prompt (GRPO's
group) share one encoding of it. Same stop rule (the trainer's eos ids, the last one kept) and no
logprobs, as TRL's plain path.

Why not a library: TRL's alternatives on CPU are its plain path and ``use_transformers_paged``
(transformers' continuous batching, the slowest candidate of ``bench/generation_engines.py`` on CPU).
vLLM's CPU build keeps finished requests' caches too, but runs as a server that loads its weights
at start-up and cannot take the trained model's new weights each step on CPU. vLLM is used where
configured (``use_vllm``), and TRL keeps whatever the engine does not do
(images, DeepSpeed or FSDP-wrapped models, and any generation setting besides greedy or
temperature + top_p sampling: :func:`engine_can_sample`).

Lifecycle: in bf16 the engine generates from bf16 copies of the weights, re-made on the first call
after the optimizer changed them (:meth:`~apprentice.policies.hf_cached.CachedHFPolicy.sync_weights`).
The engine's cache is dropped when the weights change (a new ``global_step``) and freed,
with the heap trimmed, after each generation phase (:meth:`EngineSampling._engine_release`), so it
never sits under the backward pass's peak. Its sampling seed is ``seed + global_step``, so a run
resumed from a checkpoint samples what the uninterrupted run did.
"""

from __future__ import annotations

from typing import Any

from apprentice.lm.modeling import trim_heap

# What the engine implements of a GenerationConfig (greedy, or temperature + top_p sampling, to a token
# budget, stopping at eos ids); bookkeeping keys besides. Any other setting a user passes through TRL's
# ``generation_kwargs`` (stop strings, n-gram bans, typical_p, beams, ...) leaves sampling to TRL.
_ENGINE_KEYS = {"max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "pad_token_id", "bos_token_id", "eos_token_id", "cache_implementation", "disable_compile",
                "use_cache", "transformers_version", "_from_model_config"}


def engine_can_sample(gc: Any) -> bool:
    """Whether the engine samples what ``generate`` would with generation config ``gc``."""
    diff = gc.to_diff_dict()
    return (set(diff) <= _ENGINE_KEYS and gc.max_new_tokens is not None and not gc.top_k
            and gc.min_p is None and gc.repetition_penalty in (None, 1.0))


class EngineSampling:
    """Mixin for a TRL trainer (before it in the bases): ``_engine_sample`` and its lifecycle."""

    _engine: Any = None
    _engine_step: int = -1
    engine_calls: int = 0
    _rollout_dtype: str = "fp32"

    def _engine_serves(self, images: Any, multimodal_fields: Any) -> bool:
        """Whether the engine can stand in for TRL's sampling here (else TRL's own path runs)."""
        t: Any = self
        gc = getattr(t, "generation_config", None)
        return (gc is not None and not getattr(t, "use_vllm", False)
                and not getattr(t, "use_transformers_continuous_batching", False)
                and not images and not multimodal_fields
                and not t.is_deepspeed_enabled and not t.is_fsdp_enabled and engine_can_sample(gc))

    def _engine_sample(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """TRL's plain path's result for ``prompt_ids``: completion ids up to and including the first
        eos id, sampled with the trainer's generation config."""
        from apprentice.policies.hf_cached import CachedHFPolicy

        t: Any = self
        gc = t.generation_config
        if self._engine is None:
            self._engine = CachedHFPolicy(t.model, t._tokenizer, dtype=self._rollout_dtype,
                                          batch_size=max(1, len(prompt_ids)), policy_id=type(self).__name__)
            self._engine.stop_ids = list(t.eos_token_ids)
        if t.state.global_step != self._engine_step:  # new weights: no stale keys/values, a fresh seed
            self._engine.reset_cache()
            self._engine.seed, self._engine._calls = t.args.seed + t.state.global_step, 0
            self._engine_step = t.state.global_step
        self._engine.batch_size = max(self._engine.batch_size, len(prompt_ids))
        self.engine_calls += 1
        return self._engine.complete_ids([list(p) for p in prompt_ids],
                                         temperature=gc.temperature if gc.do_sample else 0.0,
                                         top_p=gc.top_p if gc.top_p is not None else 1.0,
                                         max_new_tokens=gc.max_new_tokens)

    def _engine_release(self) -> None:
        """After a generation phase: free the engine's keys/values and hand the pages back."""
        if self._engine is not None:
            self._engine.reset_cache()
            trim_heap()
