"""Progress of a streaming conversion: a stderr line per layer (layers done, time per layer, elapsed, ETA)."""

from __future__ import annotations

import time

from diffmeg.errors import stderr


def clock(seconds: float) -> str:
    """`m:ss`, or `h:mm:ss` from an hour on."""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


class Progress:
    """One stderr line per layer converted: layers done, time per layer, elapsed time and the ETA."""

    def __init__(self, label: str, layers: int) -> None:
        self.label, self.layers = label, layers
        self.restart()

    def restart(self) -> None:
        """Time layers from now (after the tensors outside the layers, which take as long as several)."""
        self.start = time.perf_counter()

    def layer_done(self, done: int) -> None:
        elapsed = time.perf_counter() - self.start
        per_layer = elapsed / done
        stderr(
            f"{self.label}: layer {done}/{self.layers}, {per_layer:.1f} s/layer, elapsed {clock(elapsed)}, "
            f"ETA {clock(per_layer * (self.layers - done))}"
        )
