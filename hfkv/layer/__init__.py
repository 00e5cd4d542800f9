"""The compressing cache layer and the parts it is made of (docs/architecture.md, "The layer").

``TriStateLayer`` is imported on first use (PEP 562): ``hfkv.attention`` imports ``hfkv.layer.handoff`` alone, which
must not pull in the layer, its storage and kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hfkv.lazy import lazy_names

__all__ = ["TriStateLayer"]

if TYPE_CHECKING:
    from hfkv.layer.layer import TriStateLayer

__getattr__, __dir__ = lazy_names(__name__, {"TriStateLayer": "hfkv.layer.layer"}, globals(), __all__)
