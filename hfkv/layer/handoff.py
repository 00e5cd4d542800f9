"""The hand-off between a compressing layer's ``update()`` and the ``"hfkv"`` attention function.

transformers never passes the cache to the attention function, so a compressing layer announces itself in
``update()`` here and the attention function of the same layer (hfkv.attention.interface) takes it; a layer's
``get_mask_sizes()`` asks here for the mask it needs. Kept below both so that the layer does not import the
attention floor (docs/architecture.md, "Floors").
"""

from __future__ import annotations

import contextvars
from typing import Any

# The layer whose update() ran last and whose attention call has not happened yet.
_PENDING: contextvars.ContextVar[Any] = contextvars.ContextVar("hfkv_pending_layer", default=None)
# Set by a compressing layer's get_mask_sizes(): the next mask must be SDPA's boolean mask in logical
# coordinates, "skippable" (None where it is plain causal without padding) or "materialised".
_MASK_REQUEST: contextvars.ContextVar[str | None] = contextvars.ContextVar("hfkv_mask_request", default=None)


def set_pending(layer: Any) -> None:
    _PENDING.set(layer)


def pending() -> Any:
    return _PENDING.get()


def request_logical_mask(skippable: bool = False) -> None:
    """Ask for a boolean mask in logical coordinates; ``skippable``: None is fine where it is plain causal."""
    _MASK_REQUEST.set("skippable" if skippable else "materialised")


def take_mask_request() -> str | None:
    """The pending mask request ("skippable", "materialised" or None), cleared."""
    request = _MASK_REQUEST.get()
    if request:
        _MASK_REQUEST.set(None)
    return request
