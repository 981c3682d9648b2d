"""A value derived from some weights (a converted, stacked or split copy), kept until a weight changes."""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

import torch

_VERSION = attrgetter("_version")


class Derived:
    """A value built from some weights, kept until any source's storage or version counter moves, so it never goes
    stale (a weight replaced, or changed in place, rebuilds it on the next `get`)."""

    def __init__(self):
        self._key: tuple | None = None
        self._value = None

    def get(self, sources: list[torch.Tensor], build: Callable[[], Any]) -> Any:
        key = (tuple(map(torch.Tensor.data_ptr, sources)), tuple(map(_VERSION, sources)))
        if key != self._key:
            self._value, self._key = build(), key
        return self._value
