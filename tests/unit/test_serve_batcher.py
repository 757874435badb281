"""apprentice.infra.serve.MicroBatcher: requests held back for other sampling settings are batched together."""

from __future__ import annotations

import threading

from apprentice.infra.serve import MicroBatcher


class RecordingPolicy:
    """Stands in for HFPolicy.complete: records each generate call's batch; the first call blocks."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, list[str]]] = []
        self.release = threading.Event()

    def complete(self, messages, tools, *, temperature, top_p, max_new_tokens):
        if not self.calls:
            self.calls.append((temperature, [m[0]["content"] for m in messages]))
            self.release.wait(10)
        else:
            self.calls.append((temperature, [m[0]["content"] for m in messages]))
        return [m[0]["content"] for m in messages]


def test_held_requests_with_equal_settings_share_one_generate_call():
    pol = RecordingPolicy()
    mb = MicroBatcher(pol, batch_size=8, window_s=0.3)
    hot, cold = (0.0, 1.0, 8), (1.0, 1.0, 8)
    first = mb.submit([{"content": "a"}], [], hot)
    while not pol.calls:  # the worker is inside generate with request a
        threading.Event().wait(0.01)
    futs = [mb.submit([{"content": name}], [], params)
            for name, params in (("b", hot), ("c", cold), ("d", cold), ("e", hot))]
    pol.release.set()
    assert first.result(10) == "a" and [f.result(10) for f in futs] == ["b", "c", "d", "e"]
    assert pol.calls == [(0.0, ["a"]), (0.0, ["b", "e"]), (1.0, ["c", "d"])]
