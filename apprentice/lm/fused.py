"""A Llama-family decoder for low-precision generation: bf16 weight copies, fused projections, few ops.

Why not the transformers model under autocast: autocast keeps the weights in fp32 and casts each one
to bf16 at every matmul (twice the bytes read where a decode step is bound by reading weights), and
the module graph costs dozens of small ops per layer (mask building, cache bookkeeping, RMSNorm as
five ops, RoPE as eight) that a small model's decode step at low batch pays in full. This module
holds bf16 copies of the weights with the query/key/value projections fused into one matmul and the
gate/up projections into another, and runs a forward pass over the generation engine's own cache
layout (:mod:`apprentice.policies.hf_cached`).

Numerics follow what bf16 autocast computes for the same model: matmuls in bf16 with the weights
rounded to bf16, the residual stream, RMSNorm and RoPE in fp32, keys and values stored in bf16.
fp32 generation does not come here: it runs the transformers model itself, unchanged.

Weight changes: the copies are refreshed whenever a parameter of the source model was modified in
place (its version counter moved, as an optimizer step does) or replaced (its storage moved), so a
model being trained generates with its current weights; :meth:`FusedLlama.sync` checks that in a few
microseconds and recopies only when needed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def supports(model: Any) -> bool:
    """Whether :class:`FusedLlama` computes what ``model`` does: a Llama-architecture causal LM with
    default RoPE, SiLU MLP and no biases (SmolLM2 and the tiny test models are such)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) != "llama":
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    return (not getattr(cfg, "attention_bias", False) and not getattr(cfg, "mlp_bias", False)
            and getattr(cfg, "hidden_act", "silu") == "silu" and rope.get("rope_type", "default") == "default"
            and getattr(cfg, "pretraining_tp", 1) == 1 and hasattr(model, "model") and hasattr(model, "lm_head"))


class FusedLlama:
    """bf16 generation forward of a transformers ``LlamaForCausalLM`` (see the module docstring)."""

    def __init__(self, model: Any, dtype: torch.dtype = torch.bfloat16) -> None:
        cfg = model.config
        self.source, self.dtype = model, dtype
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self.hidden = cfg.hidden_size
        theta = float(cfg.rope_parameters["rope_theta"])
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        self._rope: torch.Tensor | None = None
        self._stamp: tuple[tuple[int, int], ...] = ()
        self.copies = 0  # how many times the weights were copied (the first time included)
        self.layers: list[dict[str, torch.Tensor]] = []
        self.sync()

    # -- weights -----------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return list(self.source.parameters())

    def _fingerprint(self) -> tuple[tuple[int, int], ...]:
        return tuple((p._version, p.data_ptr()) for p in self._params())

    def sync(self) -> bool:
        """Copy the source model's weights when they changed since the last copy; True if it copied."""
        stamp = self._fingerprint()
        if stamp == self._stamp:
            return False
        dt = self.dtype

        def cat(*ws: torch.Tensor) -> torch.Tensor:  # cast while copying: one pass over the fp32 weights
            out = torch.empty(sum(w.shape[0] for w in ws), ws[0].shape[1], dtype=dt, device=ws[0].device)
            at = 0
            for w in ws:
                out[at:at + w.shape[0]].copy_(w.detach())
                at += w.shape[0]
            return out

        D = self.head_dim
        # each head's output rows reordered (0, D/2, 1, D/2 + 1, ...): the pairs RoPE rotates together
        # become adjacent, so the rotation is one complex multiplication (see decoder)
        pairs = torch.stack([torch.arange(D // 2), torch.arange(D // 2) + D // 2], 1).reshape(-1)

        def paired(w: torch.Tensor) -> torch.Tensor:
            return w.detach().reshape(-1, D, w.shape[-1]).index_select(1, pairs).reshape(w.shape)

        # on one thread: a cast-copy is bound by memory bandwidth, which one core nearly saturates, and a
        # second thread's barrier per tensor costs far more than it saves when the other core is busy
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._copy(dt, cat, paired)
        finally:
            torch.set_num_threads(threads)
        self._stamp = stamp
        self.copies += 1
        return True

    def _copy(self, dt: torch.dtype, cat: Any, paired: Any) -> None:
        m = self.source.model
        with torch.no_grad():
            self.layers = []
            for layer in m.layers:
                a, mlp = layer.self_attn, layer.mlp
                self.layers.append({
                    "in_norm": layer.input_layernorm.weight.detach().float(),
                    "qkv": cat(paired(a.q_proj.weight), paired(a.k_proj.weight), a.v_proj.weight),
                    "o": a.o_proj.weight.detach().to(dt),
                    "post_norm": layer.post_attention_layernorm.weight.detach().float(),
                    "gate_up": cat(mlp.gate_proj.weight, mlp.up_proj.weight),
                    "down": mlp.down_proj.weight.detach().to(dt),
                })
            self.embed = m.embed_tokens.weight.detach()  # looked up, not multiplied: read as the source has it
            self.norm = m.norm.weight.detach().float()
            head = self.source.lm_head.weight
            self.head = head.detach().to(dt)
        self.device = self.embed.device

    def nbytes(self) -> int:
        """Bytes the copies hold."""
        ts = [t for layer in self.layers for t in layer.values()] + [self.norm, self.head]
        return sum(t.numel() * t.element_size() for t in ts)

    # -- forward -----------------------------------------------------------------------------------
    def _rotation(self, pos: torch.Tensor) -> torch.Tensor:
        """RoPE's rotation at positions ``pos`` as complex fp32 ``cos + i sin`` ([B, T] -> [B, T, 1,
        head_dim / 2]), from a table grown on demand."""
        need = int(pos.max()) + 1
        if self._rope is None or self._rope.shape[0] < need:
            n = max(need, 2 * (self._rope.shape[0] if self._rope is not None else 1024))
            freqs = torch.arange(n, dtype=torch.float)[:, None] * self.inv_freq[None, :]
            self._rope = torch.polar(torch.ones_like(freqs), freqs).to(self.device)
        return self._rope[pos][:, :, None]

    def decoder(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
                kv: list[tuple[torch.Tensor, torch.Tensor]], start: int,
                spans: list[tuple[int, int, int]] | None = None) -> torch.Tensor:
        """The final-normed hidden states (fp32, [B, T, hidden]) of ``input_ids`` written at cache
        columns ``[start, start + T)`` of every layer's ``kv`` ([B, kv_heads, width, head_dim] views,
        written in place). Column ``j`` attends to columns ``<= j`` whose ``attention_mask`` ([B,
        width]) is 1, and always to itself (a padding column then attends to its own finite key, never
        to nothing: a fully masked row would fill its keys with NaN). ``spans``, for one-token steps
        only: ``(first row, end row, first column)`` groups whose rows read only from their first
        column (columns before it are masked for them)."""
        B, T = input_ids.shape
        end = start + T
        x = F.embedding(input_ids, self.embed).float()
        rot = self._rotation(position_ids)
        H, K, D = self.heads, self.kv_heads, self.head_dim
        group = H // K
        if T == 1:
            groups = spans or [(0, B, 0)]
            masks = [attention_mask[a:b, s:end].bool()[:, None, None, :] for a, b, s in groups]
        else:
            cols = torch.arange(end, device=x.device)
            q_cols = torch.arange(start, end, device=x.device)
            allowed = (cols[None, :] <= q_cols[:, None])[None] & attention_mask[:, None, :end].bool()
            allowed[:, :, start:] |= torch.eye(T, dtype=torch.bool, device=x.device)[None]
            full_mask = allowed[:, None]  # [B, 1, T, end]
        for layer, (keys, values) in zip(self.layers, kv, strict=True):
            h = F.rms_norm(x, (self.hidden,), layer["in_norm"], self.eps).to(self.dtype)
            qkv = F.linear(h, layer["qkv"]).view(B, T, H + 2 * K, D)
            # RoPE on queries and keys at once, in fp32 as autocast runs it: each adjacent pair (see sync)
            # times cos + i sin
            pairs = torch.view_as_complex(qkv[:, :, :H + K].float().unflatten(-1, (D // 2, 2)))
            qk = torch.view_as_real(pairs * rot).flatten(-2).to(self.dtype)
            q = qk[:, :, :H].transpose(1, 2)
            keys[:, :, start:end] = qk[:, :, H:].transpose(1, 2)
            values[:, :, start:end] = qkv[:, :, H + K:].transpose(1, 2)
            if T == 1:  # one query per head, keys shared by a head group (enable_gqa): on the CPU flash
                # kernel this beats folding a group's query heads into one head's rows (bench/engine_peak.py)
                outs = [F.scaled_dot_product_attention(q[a:b], keys[a:b, :, s:end], values[a:b, :, s:end],
                                                       attn_mask=m, scale=self.scale, enable_gqa=group > 1)
                        for (a, b, s), m in zip(groups, masks, strict=True)]
                o = (outs[0] if len(outs) == 1 else torch.cat(outs)).reshape(B, 1, H * D)
            else:
                o = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=full_mask,
                                                   scale=self.scale, enable_gqa=True)
                o = o.transpose(1, 2).reshape(B, T, H * D)
            x = x + F.linear(o, layer["o"])
            h = F.rms_norm(x, (self.hidden,), layer["post_norm"], self.eps).to(self.dtype)
            gu = F.linear(h, layer["gate_up"])
            inter = gu.shape[-1] // 2
            x = x + F.linear(F.silu(gu[..., :inter]) * gu[..., inter:], layer["down"])
        return F.rms_norm(x, (self.hidden,), self.norm, self.eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 next-token logits of final-normed hidden states (the LM head in bf16, as autocast runs it)."""
        return F.linear(hidden.to(self.dtype), self.head).float()
