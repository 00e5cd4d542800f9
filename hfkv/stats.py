"""Memory and state counts of a cache, measured from the tensors it holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from hfkv.states import STATE_NAMES


@dataclass
class LayerStats:
    layer: int
    kv_bytes: int
    dense_bytes: int
    logical_length: int
    # per (batch row, KV head): tokens in each state; "window" is reported separately from "original"
    window: list[list[int]] = field(default_factory=list)
    original: list[list[int]] = field(default_factory=list)
    quantized: list[list[int]] = field(default_factory=list)
    evicted: list[list[int]] = field(default_factory=list)
    compressed: bool = True


@dataclass
class CacheStats:
    """``kv_bytes`` is what the cache holds (storage capacity, metadata included); ``dense_bytes`` what
    DynamicCache would hold for the same logical length. ``compression_ratio = dense / kv``."""

    kv_bytes: int
    dense_bytes: int
    layers: list[LayerStats]

    @property
    def compression_ratio(self) -> float:
        return self.dense_bytes / self.kv_bytes if self.kv_bytes else float("inf")

    def to_dataframe(self):
        """One row per (layer, batch row, KV head) with token counts per state and the layer's bytes."""
        import pandas as pd

        rows = []
        for ls in self.layers:
            for b, heads in enumerate(ls.window):
                for h in range(len(heads)):
                    rows.append(
                        {
                            "layer": ls.layer,
                            "batch": b,
                            "head": h,
                            "window": ls.window[b][h],
                            **{name: getattr(ls, name)[b][h] for name in STATE_NAMES},
                            "layer_kv_bytes": ls.kv_bytes,
                            "layer_dense_bytes": ls.dense_bytes,
                        }
                    )
        return pd.DataFrame(rows)

    def __str__(self) -> str:
        lines = [
            f"CacheStats: kv_bytes={self.kv_bytes:,} dense_bytes={self.dense_bytes:,} "
            f"compression_ratio={self.compression_ratio:.2f}x"
        ]
        for ls in self.layers:
            tot = {n: sum(map(sum, getattr(ls, n))) for n in ("window", *STATE_NAMES)}
            lines.append(
                f"  layer {ls.layer:>3}: len={ls.logical_length:>6} kv={ls.kv_bytes:>12,}B "
                f"dense={ls.dense_bytes:>12,}B " + " ".join(f"{k}={v}" for k, v in tot.items())
            )
        return "\n".join(lines)
