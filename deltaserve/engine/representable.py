"""What a value must be to cross from the API process to the engine core and into torch.

Requests travel to the engine as msgpack maps (server/messages.py) and their numbers end up in torch (generators,
int64 tensors). This module is the one place that says which Python values survive that trip:

* integers in [INT_MIN, INT_MAX] = [-2**63, 2**64 - 1], what msgpack carries; torch's `Generator.manual_seed`
  accepts exactly the same range, so a seed is valid iff it is a representable integer;
* counts (n, max_tokens, top_k, token ids, ...) additionally fit an int64 (COUNT_MAX), what torch tensors hold;
* floats that are finite (JSON has no NaN / Infinity, and no sampling field means anything with them);
* strings that encode as UTF-8: a lone surrogate (e.g. JSON "\\ud800") decodes to a Python str that msgpack,
  the tokenizer and JSON responses cannot encode.

`first_unrepresentable` walks a parsed JSON value (dicts, lists, scalars) iteratively, so a deeply nested body
cannot exhaust the interpreter's stack, and reports the first bad value by its dotted path.
"""

from __future__ import annotations

import math
from typing import Any

INT_MIN = -(2 ** 63)
INT_MAX = 2 ** 64 - 1
COUNT_MAX = 2 ** 63 - 1


def is_utf8(text: str) -> bool:
    """True when `text` encodes as UTF-8 (it holds no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unrepresentable_reason(value: Any) -> str | None:
    """Why the scalar `value` cannot cross to the engine, or None when it can (containers are not inspected)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return None if INT_MIN <= value <= INT_MAX else f"integer {value} is outside [{INT_MIN}, {INT_MAX}]"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value} is not a finite number"
    if isinstance(value, str):
        return None if is_utf8(value) else "string is not valid UTF-8 (it holds a lone surrogate)"
    return None


def first_unrepresentable(value: Any) -> tuple[str, str] | None:
    """(dotted path, reason) of the first value inside `value` that cannot cross to the engine, else None.

    Dict keys are checked as strings (a bad key is reported at its dict's path, "" for the top level: the key
    itself cannot be printed); list entries are named by index, e.g. `messages.1.content`.
    """
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            entries = []
            for key, sub in item.items():
                if isinstance(key, str) and not is_utf8(key):
                    return path, "a key is not valid UTF-8 (it holds a lone surrogate)"
                entries.append((f"{path}.{key}" if path else str(key), sub))
            stack.extend(reversed(entries))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed([(f"{path}.{i}" if path else str(i), sub) for i, sub in enumerate(item)]))
        else:
            reason = unrepresentable_reason(item)
            if reason is not None:
                return path, reason
    return None
