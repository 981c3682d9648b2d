"""Incremental detokenisation with stop strings matched across token boundaries (vLLM semantics): the matched stop
string is cut from the text (kept with include_stop_str_in_output), and streamed text holds back any tail that
could still grow into a stop string."""

from __future__ import annotations

from ..tokenizer import Tokenizer
from .sampling_params import SamplingParams


class StopChecker:
    """Owns one completion's text. `append(token)` returns the stop string that just matched, if any."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.params = params
        self.decoder = tokenizer.incremental_decoder(skip_special_tokens=params.skip_special_tokens)
        self.text = ""
        self.stopped = False
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._emitted = 0

    def append(self, token_id: int, check_stops: bool) -> str | None:
        before = len(self.text)
        self.text += self.decoder.feed(token_id)
        if not check_stops or not self.params.stop:
            return None
        # A match must end inside the new text, so only look from where a stop could have started.
        start = max(0, before - self._hold)
        best = None
        for s in self.params.stop:
            at = self.text.find(s, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        self.text = self.text[: at + len(s)] if self.params.include_stop_str_in_output else self.text[:at]
        self.stopped = True
        return s

    def finish(self) -> None:
        if not self.stopped:
            self.text += self.decoder.flush()

    def delta(self, finished: bool) -> str:
        """New text since the last call; while running, the last `max stop length - 1` chars are held back."""
        end = len(self.text) if finished or not self.params.stop else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted:end]
        self._emitted = end
        return out
