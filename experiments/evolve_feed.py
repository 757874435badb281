"""Where does the generation scheduler stop for a given model? (``curriculum.evolve.feed``)

    .venv/bin/python experiments/evolve_feed.py --model models/iter_1/sft --feed 8

Builds the evolved generations of ``params.yaml`` (``curriculum.evolve``) in a temp dir, then runs
exactly the RL stage's walk (``apprentice.curriculum.feed_generations`` with the RL probe): ``--feed``
problems per generation, ``rl.probe_samples`` sampled episodes each, moving on while the pass rate
reaches ``curriculum.advance_threshold``. Prints the scheduler's state (generation chosen, pass rate
per generation probed) as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--feed", type=int, default=8)
    p.add_argument("--params", type=Path, default=REPO / "params.yaml")
    args = p.parse_args(argv)

    from apprentice.config import load_config
    from apprentice.curriculum import feed_generations
    from apprentice.lm.modeling import load_model, load_tokenizer
    from apprentice.paths import Paths
    from apprentice.stages import evolve
    from apprentice.stages import rl as rl_stage

    cfg = load_config(args.params, overrides=[f"curriculum.evolve.feed={args.feed}"])
    paths = Paths(Path(tempfile.mkdtemp(prefix="evolve-feed-")), 1)
    evolve.run(cfg, paths)
    gens = rl_stage.evolved_generations(cfg, paths) or []
    tok = load_tokenizer(str(args.model), cfg.model.chat_template)
    model = load_model(str(args.model), dtype="fp32")
    _, _, state = feed_generations(gens, args.feed, cfg.curriculum.advance_threshold,
                                   lambda rows: rl_stage.probe_pass_rates(cfg, rows, model, tok))
    print(json.dumps(state))
    return 0


if __name__ == "__main__":
    sys.exit(main())
