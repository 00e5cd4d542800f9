"""The hand-off between a compressing layer's ``update()`` and the attention call that follows it.

transformers never passes the cache to the attention function, so a compressing layer announces itself in
``update()`` here and the attention dispatch of the same layer (hfkv.attention.interface) takes it. Anything else
— DynamicCache, StaticCache, no cache, sliding layers kept uncompressed, the ``full`` preset — leaves nothing here,
and the model's own attention runs unchanged. Kept below both so that the layer does not import the attention floor
(docs/architecture.md, "Floors").

A ``threading.local`` rather than a ``ContextVar``: both keep two threads' generations apart, but Dynamo traces
attribute reads of a thread-local (``torch.compile(fullgraph=True)`` of a forward) and not ``ContextVar.get``.
"""

from __future__ import annotations

import threading
from typing import Any

_LOCAL = threading.local()  # .layer: the layer whose update() ran last and whose attention call has not happened yet


def set_pending(layer: Any) -> None:
    _LOCAL.layer = layer


def pending() -> Any:
    return getattr(_LOCAL, "layer", None)
