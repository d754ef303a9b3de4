"""How much torch.compile compiled, and for how long: dynamo's compile callbacks (a frame traced,
or a backward graph lowered lazily at its first use) counted per step. The start-up breakdown
takes the first step's seconds; a later step that compiles again is a recompilation."""

from __future__ import annotations

import time


class CompileClock:
    def __init__(self) -> None:
        # Imported here: only a compiled run loads dynamo. An internal module (read in torch 2.13):
        # start/end callbacks around each compilation, nested ones reported once.
        from torch._dynamo.callback import callback_handler

        self.compiles = 0  # compilations that ended (forward frames and lazy backward graphs)
        self.seconds = 0.0
        self._started: float | None = None
        self._handler = callback_handler
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def _start(self, *args) -> None:  # (a CallbackArgs in torch 2.13; none in older versions)
        self._started = time.perf_counter()

    def _end(self, *args) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.compiles += 1
            self._started = None

    def reading(self) -> tuple[int, float]:
        return self.compiles, self.seconds

    def close(self) -> None:
        self._handler.remove_start_callback(self._start)
        self._handler.remove_end_callback(self._end)
