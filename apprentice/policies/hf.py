"""A local transformers model as a policy: batched ``generate`` over many live episodes at once.

Why batched with left padding: on CPU a decode step is bound by reading the weights, so it costs
about as much for a batch of episodes as for one, and generating many episodes' next turns
together multiplies throughput. Left
padding keeps every row's last position at its real last token, so the KV-cached decode is the
same computation as for a single sequence (greedy outputs match the unbatched ones).

Tool calls are parsed from the decoded text with :mod:`apprentice.policies.toolcalls`; a
malformed call becomes ``Turn.parse_error``, never an exception.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from apprentice.lm import modeling
from apprentice.policies.base import Message, Turn
from apprentice.policies.toolcalls import parse_assistant

_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>")


class HFPolicy:
    """``HFPolicy("models/base")`` or ``HFPolicy(model, tokenizer)``.

    ``temperature == 0`` means greedy. ``dtype`` is the compute dtype ('auto' = bf16 autocast on
    hardware with fast bf16, else fp32); weights stay as loaded. ``seed`` makes sampling
    reproducible: call ``i`` of ``act`` samples with ``seed + i`` without touching global RNG.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Any,
        tokenizer: Any | None = None,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_new_tokens: int = 96,
        batch_size: int = 32,
        dtype: str | torch.dtype = "auto",
        chat_template: modeling.ChatTemplate = "model",
        device: str | None = None,
        seed: int = 0,
        policy_id: str | None = None,
    ) -> None:
        if isinstance(model, str | os.PathLike):
            name = str(model)
            self.model = modeling.load_model(model, device=device)
            self.tokenizer = tokenizer or modeling.load_tokenizer(model, chat_template)
        else:
            if tokenizer is None:
                raise ValueError("pass the tokenizer together with a model object: HFPolicy(model, tokenizer)")
            name = getattr(model.config, "_name_or_path", "") or type(model).__name__
            self.model, self.tokenizer = model, tokenizer
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.device = next(self.model.parameters()).device
        self.dtype = modeling.resolve_dtype(dtype, self.device.type)
        self.temperature, self.top_p = temperature, top_p
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.seed, self._calls = seed, 0
        self.policy_id = policy_id or f"hf:{Path(name).name or name}"
        vocab = self.tokenizer.get_vocab()
        self.stop_ids = sorted({i for t in _STOP_TOKENS if (i := vocab.get(t)) is not None}
                               | ({self.tokenizer.eos_token_id} - {None}))

    # -- protocol ------------------------------------------------------------------------------
    def act(
        self,
        conversations: list[list[Message]],
        tools: list[list[dict[str, Any]]],
        *,
        contexts: list[dict[str, Any]] | None = None,
    ) -> list[Turn]:
        return self.complete(conversations, tools)

    # -- with per-call sampling overrides (the HTTP server uses these) ---------------------------
    def complete(
        self,
        conversations: list[list[Message]],
        tools: list[list[dict[str, Any]]] | None = None,
        *,
        temperature: float | None = None,
        top_p: float | None = None,
        max_new_tokens: int | None = None,
    ) -> list[Turn]:
        tools = tools if tools is not None else [[] for _ in conversations]
        if len(tools) != len(conversations):
            raise ValueError(f"got {len(conversations)} conversations but {len(tools)} tool lists")
        temperature = self.temperature if temperature is None else temperature
        top_p = self.top_p if top_p is None else top_p
        max_new_tokens = max_new_tokens or self.max_new_tokens
        out: list[Turn] = []
        for s in range(0, len(conversations), self.batch_size):
            out += self._generate(conversations[s:s + self.batch_size], tools[s:s + self.batch_size],
                                  temperature, top_p, max_new_tokens)
        return out

    def render(self, conversation: list[Message], tools: list[dict[str, Any]] | None) -> str:
        """The prompt text for one conversation (chat template, generation prompt added)."""
        return self.tokenizer.apply_chat_template(conversation, tools=tools or None,
                                                  add_generation_prompt=True, tokenize=False)

    def _generate(self, convs: list[list[Message]], tools: list[list[dict[str, Any]]],
                  temperature: float, top_p: float, max_new_tokens: int) -> list[Turn]:
        tok = self.tokenizer
        prompts = [self.render(c, t) for c, t in zip(convs, tools, strict=True)]
        tok.padding_side = "left"
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        sample = temperature > 0
        gen_kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens, do_sample=sample, eos_token_id=self.stop_ids,
            pad_token_id=tok.pad_token_id, use_cache=True,
        )
        if sample:
            gen_kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        else:  # neutralise sampling fields a model's generation_config may carry (avoids warnings)
            gen_kwargs.update(temperature=None, top_p=None, top_k=None)
        self._calls += 1
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(self.seed + self._calls)
            with modeling.generation(self.dtype, self.device):
                seqs = self.model.generate(**enc, **gen_kwargs)
        new = seqs[:, enc["input_ids"].shape[1]:].tolist()
        prompt_lens = enc["attention_mask"].sum(dim=1).tolist()
        turns = []
        for ids, n_prompt in zip(new, prompt_lens, strict=True):
            stop_at = next((i for i, t in enumerate(ids) if t in self.stop_ids), None)
            finish = "length" if stop_at is None else "stop"
            used = ids if stop_at is None else ids[:stop_at + 1]
            text = tok.decode(used if stop_at is None else ids[:stop_at], skip_special_tokens=True)
            msg, err = parse_assistant(text)
            turns.append(Turn(message=msg, prompt_tokens=int(n_prompt), completion_tokens=len(used),
                              parse_error=err, raw=text, extra={"finish_reason": finish}))
        return turns
