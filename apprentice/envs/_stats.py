"""Measure oracle episodes per family and level: turns and tokens under a real chat template.

``python -m apprentice.envs._stats [N] [TOKENIZER_DIR]`` (defaults: 30 problems, ``models/base``).
Why: TRL GRPO's ``max_completion_length`` covers every call *and* every (loss-masked) tool response
of a multi-turn episode, so level design needs these numbers; they are printed, not asserted.
"""

from __future__ import annotations

import statistics as st
import sys
from typing import Any

from apprentice.envs import FAMILIES, grid, search
from apprentice.paths import DEFAULT_BASE


def measure(n: int = 30, tokenizer_dir: str = DEFAULT_BASE) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(tokenizer_dir)

    def count(msgs: list[dict[str, Any]], tools: Any, gen: bool = False) -> int:
        text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, tokenize=False)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    rows: list[dict[str, Any]] = []
    for fam in ("grid", "search"):
        cls = FAMILIES[fam]
        levels = {"grid": grid.LEVELS, "search": search.LEVELS}[fam]
        for lv in range(len(levels)):
            turns, total, after, obs = [], [], [], []
            for s in range(n):
                env = cls()
                first = env.reset(spec=cls.generate(1000 + s, lv))
                msgs: list[dict[str, Any]] = [{"role": "system", "content": cls.system_prompt}, {"role": "user", "content": first}]
                tools = cls.tool_schemas()
                prompt = count(msgs, tools, gen=True)
                plan = env.oracle()
                for c in plan:
                    o = env.execute(c)
                    obs.append(len(tok(o)["input_ids"]))
                    msgs += [{"role": "assistant", "content": "", "tool_calls": [c.as_message_call()]},
                             {"role": "tool", "name": c.name, "content": o}]
                assert env.get_reward() == 1.0
                n_tok = count(msgs, tools)
                turns.append(len(plan))
                total.append(n_tok)
                after.append(n_tok - prompt)
            rows.append({"family": fam, "level": lv, "turns_mean": st.mean(turns), "turns_max": max(turns),
                         "tokens_mean": st.mean(total), "tokens_max": max(total),
                         "completion_tokens_mean": st.mean(after), "obs_tokens_mean": st.mean(obs)})
    return rows


if __name__ == "__main__":
    args = sys.argv[1:]
    for r in measure(int(args[0]) if args else 30, args[1] if len(args) > 1 else DEFAULT_BASE):
        print(f"{r['family']:6s} L{r['level']} turns {r['turns_mean']:4.1f} (max {r['turns_max']:2d}) | "
              f"tokens/episode {r['tokens_mean']:5.0f} (max {r['tokens_max']:4d}) | after the prompt "
              f"{r['completion_tokens_mean']:5.0f} | per observation {r['obs_tokens_mean']:4.1f}")
