"""Stage ``sft``: fine-tune the start model on validated teacher trajectories -> ``models/iter_k/sft``.

Start model: iteration k > 1 continues from iteration k-1's RL model when it exists (the model the
loop improved last), else from ``model.base``. Rerunning with unchanged params and inputs is a
no-op; an interrupted run resumes from its last checkpoint (``models/iter_k/.work/sft``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from apprentice.config import Config
from apprentice.paths import Paths


def start_model(cfg: Config, paths: Paths) -> str:
    from apprentice.modeling import resolve_model_ref

    prev = paths.previous()
    if prev is not None and (prev.rl_model / "config.json").exists():
        return str(prev.rl_model)
    return resolve_model_ref(cfg.model.base, paths.root)


def run(cfg: Config, paths: Paths, callbacks: list[Any] | None = None, **_: Any) -> dict[str, Any]:
    from apprentice.gates import require_passed
    from apprentice.modeling import load_tokenizer
    from apprentice.training import common
    from apprentice.training.sft import train_sft
    from apprentice.trajectories import read_parquet, to_sft_records

    require_passed(paths.sft_data, paths.gate_record)  # never train on data the gate did not pass
    common.setup_runtime(cfg)
    base = start_model(cfg, paths)
    common.require_model(base)
    stamp = common.fingerprint({"sft": cfg.sft.model_dump(), "model": cfg.model.model_dump(), "start": base},
                               [paths.sft_data, Path(base)])
    if common.is_done(paths.sft_model, stamp):
        return {"model": str(paths.sft_model), "skipped": True, "reason": "outputs up to date"}
    records = to_sft_records(read_parquet(paths.sft_data))
    tok = load_tokenizer(base, cfg.model.chat_template)
    result = train_sft(base, tok, records, paths.sft_model, cfg.sft, dtype=cfg.model.dtype, stamp=stamp,
                       callbacks=callbacks or [])
    return {"start_model": base, **result}
