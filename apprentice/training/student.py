"""Student construction: a smaller causal LM that shares the teacher's tokenizer.

Two sources (``distill.student.source``):
  * ``prune`` (default): a layer-dropped copy of the teacher, copy embeddings, final norm and head.
    ``keep_every`` k sets the size (as many layers as "every k-th plus the last"); ``prune`` picks
    which: ``every`` keeps 0, k, 2k, ... and the last; ``influence`` keeps the layers that change
    the residual stream most on the teacher's own training data (Block Influence of "ShortGPT:
    Layers in Large Language Models are More Redundant Than You Expect", arXiv:2403.03853:
    BI_i = 1 - mean cos(h_i, h_{i+1}) over tokens; the first and last layers are always kept).
    Dropping the layers that barely rotate the hidden state removes less of what the teacher
    learned than dropping every other layer, so the warm start starts from a lower loss. The copy
    is a FRESH module built from a config with fewer layers, then loaded with renamed weights:
    deleting entries of the teacher's ``ModuleList`` would keep the old ``layer_idx`` values, which
    KV-cache indexing depends on. Keeping the last layer matters: it lowers the initial loss
    markedly, because the last layer maps the residual stream back to what the head expects. The
    result is still badly broken and needs an SFT warm start (``distill.student.warmup_steps``).
  * any HF id/path: loaded as is, after checking it can be distilled from the teacher (same
    vocabulary: on-policy distillation compares the two next-token distributions id by id).

Why hand-written: neither transformers nor TRL ships layer pruning; torch.nn.utils.prune and
optimum prune weights/heads, not whole decoder layers. It is ~40 lines over ``state_dict``.
"""

from __future__ import annotations

import contextlib
import copy
import re
from pathlib import Path
from typing import Any

import torch

_LAYER_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<idx>\d+)\.(?P<rest>.+)$")


def kept_layers(n_layers: int, keep_every: int) -> list[int]:
    """Indices kept by the layer drop: 0, k, 2k, ... plus the last layer."""
    if n_layers < 1:
        raise ValueError("the teacher has no decoder layers to keep")
    if keep_every < 1:
        raise ValueError("distill.student.keep_every must be >= 1")
    keep = list(range(0, n_layers, keep_every))
    if keep[-1] != n_layers - 1:
        keep.append(n_layers - 1)
    return keep


def block_influence(teacher: Any, batches: list[torch.Tensor]) -> list[float]:
    """ShortGPT's Block Influence of each decoder layer: 1 - mean cosine(input, output) over tokens,
    i.e. one minus the block similarity of a one-layer block."""
    return [1 - x for x in block_similarity(teacher, batches, 1)]


@torch.no_grad()
def block_similarity(teacher: Any, batches: list[torch.Tensor], n_drop: int) -> list[float]:
    """Mean cosine between the residual stream before layer l and after layer l+n_drop-1, for each l
    ("The Unreasonable Ineffectiveness of the Deeper Layers", arXiv:2403.17887): the most similar
    pair marks the contiguous block of ``n_drop`` layers that changes the stream least."""
    was = teacher.training
    teacher.eval()
    sums: list[float] = []
    count = 0
    for ids in batches:
        hs = teacher(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        cos = [float(torch.nn.functional.cosine_similarity(hs[i].float(), hs[i + n_drop].float(), dim=-1).sum())
               for i in range(len(hs) - n_drop)]
        sums = cos if not sums else [a + b for a, b in zip(sums, cos, strict=True)]
        count += hs[0].shape[0] * hs[0].shape[1]
    teacher.train(was)
    return [x / max(count, 1) for x in sums]


def block_layers(similarity: list[float], n_layers: int, n_keep: int) -> list[int]:
    """Keep everything but the contiguous block of ``n_layers - n_keep`` layers whose input and output
    are most similar; the block never includes the first or the last layer."""
    n_drop = n_layers - n_keep
    if n_drop <= 0:
        return list(range(n_layers))
    starts = [i for i in range(1, n_layers - n_drop) if i + n_drop <= n_layers - 1]
    best = max(starts, key=lambda i: similarity[i])
    return [i for i in range(n_layers) if not best <= i < best + n_drop]


def influence_layers(influence: list[float], n_keep: int) -> list[int]:
    """The ``n_keep`` layers with the highest influence, always including the first and the last."""
    n = len(influence)
    if n_keep >= n:
        return list(range(n))
    forced = {0, n - 1}
    rest = sorted((i for i in range(n) if i not in forced), key=lambda i: -influence[i])
    return sorted(forced | set(rest[: max(n_keep - len(forced), 0)]))


def prune_layers(teacher: Any, keep_every: int, keep: list[int] | None = None) -> Any:
    """A fresh model of the teacher's class with only the kept decoder layers (weights copied).

    ``keep``: explicit layer indices (e.g. :func:`influence_layers`); default every ``keep_every``-th + last."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(teacher.config)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = int(text_cfg.num_hidden_layers)
    keep = sorted(keep) if keep is not None else kept_layers(n, keep_every)
    text_cfg.num_hidden_layers = len(keep)
    if isinstance(getattr(text_cfg, "layer_types", None), list):  # per-layer attention kinds (sliding/full)
        text_cfg.layer_types = [text_cfg.layer_types[i] for i in keep]
    cfg.use_cache = True
    new_index = {old: new for new, old in enumerate(keep)}

    state = {}
    for key, value in teacher.state_dict().items():
        m = _LAYER_KEY.match(key)
        if m is None:
            state[key] = value
        elif int(m["idx"]) in new_index:
            state[f"{m['prefix']}.{new_index[int(m['idx'])]}.{m['rest']}"] = value

    dtype = next(teacher.parameters()).dtype
    student = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    missing, unexpected = student.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k and getattr(cfg, "tie_word_embeddings", False)}
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"layer pruning of {type(teacher).__name__} failed: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; this architecture does not keep its decoder layers under "
            "'*.layers.N.'; give a student model path instead (distill.student.source=<path>)"
        )
    student.tie_weights()
    student.generation_config = copy.deepcopy(teacher.generation_config)
    student.config.use_cache = student.generation_config.use_cache = True
    return student


def check_compatible(student: Any, teacher: Any, student_tokenizer: Any | None = None,
                     teacher_tokenizer: Any | None = None) -> None:
    """Raise ``ValueError`` naming the mismatch when ``student`` cannot be distilled from ``teacher``."""
    sv = student.get_output_embeddings().weight.shape[0]
    tv = teacher.get_output_embeddings().weight.shape[0]
    if sv != tv:
        raise ValueError(
            f"student vocabulary size {sv} != teacher's {tv}: on-policy distillation compares next-token "
            "distributions id by id, so the student must use the teacher's tokenizer. Pick a student from "
            "the same model family or use distill.student.source=prune"
        )
    if (student_tokenizer is not None and teacher_tokenizer is not None
            and student_tokenizer.get_vocab() != teacher_tokenizer.get_vocab()):
        raise ValueError(
            "the student's tokenizer maps tokens to different ids than the teacher's (same size, different "
            "vocabulary); distillation would compare unrelated tokens. Use a student sharing the teacher's "
            "tokenizer or distill.student.source=prune"
        )


def build_student(teacher: Any, source: str = "prune", keep_every: int = 3, *, teacher_tokenizer: Any = None,
                  root: str | Path = ".", prune: str = "every", calibration: list[torch.Tensor] | None = None) -> Any:
    """The student for ``teacher``: ``source='prune'`` or an HF id/path (checked for compatibility).

    ``prune='influence'`` needs ``calibration``: a few token-id batches of the teacher's training data."""
    if source == "prune":
        keep = None
        if prune in ("influence", "block"):
            if not calibration:
                raise ValueError(f"distill.student.prune={prune} needs calibration sequences (the SFT set is empty?)")
            n_layers = int(teacher.config.get_text_config().num_hidden_layers)
            n_keep = len(kept_layers(n_layers, keep_every))
            if prune == "influence":
                keep = influence_layers(block_influence(teacher, calibration), n_keep)
            else:
                keep = block_layers(block_similarity(teacher, calibration, n_layers - n_keep), n_layers, n_keep)
        student = prune_layers(teacher, keep_every, keep)
        student.config.apprentice_kept_layers = keep or kept_layers(
            int(teacher.config.get_text_config().num_hidden_layers), keep_every)
        return student
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from apprentice.lm.modeling import resolve_model_ref

    ref = resolve_model_ref(source, root)
    try:
        student = AutoModelForCausalLM.from_pretrained(ref, dtype=next(teacher.parameters()).dtype)
    except OSError as e:
        raise ValueError(f"cannot load student model '{source}': {e}. Set distill.student.source to 'prune' "
                         "or to an HF folder/id") from e
    student_tok = None
    with contextlib.suppress(OSError, ValueError):  # a bare weights folder: the vocab-size check still applies
        student_tok = AutoTokenizer.from_pretrained(ref)
    check_compatible(student, teacher, student_tok, teacher_tokenizer)
    student.config.use_cache = True
    student.generation_config.use_cache = True
    return student


def num_params(model: torch.nn.Module) -> int:
    """Unique parameters (a tied head counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
