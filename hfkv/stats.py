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
    mid: list[list[int]] = field(default_factory=list)  # quantized in the precise format (memory budgets)
    quantized: list[list[int]] = field(default_factory=list)
    evicted: list[list[int]] = field(default_factory=list)
    compressed: bool = True

    def totals(self) -> dict[str, int]:
        """Tokens per state summed over batch rows and KV heads (``window`` first, then ``STATE_NAMES``)."""
        return {name: sum(map(sum, getattr(self, name))) for name in ("window", *STATE_NAMES)}

    def _repr_html_(self) -> str:
        from hfkv.inspect import stats_html

        return stats_html([self])


@dataclass
class CacheStats:
    """``kv_bytes`` is what the cache holds (storage capacity, metadata included); ``dense_bytes`` what
    DynamicCache would hold for the same logical length. ``compression_ratio = dense / kv``."""

    kv_bytes: int
    dense_bytes: int
    layers: list[LayerStats]
    # The path compressed layers ran on ("torch" or "triton"; "torch" too where nothing is compressed).
    backend: str = "torch"

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

    def layer_frame(self):
        """One row per layer: bytes, compression and tokens per state summed over rows and heads.

        The per-layer view a plot of "where the memory goes" needs, without re-aggregating
        :meth:`to_dataframe` (whose rows repeat each layer's bytes once per (row, head)).
        """
        import pandas as pd

        rows = [
            {
                "layer": ls.layer,
                "compressed": ls.compressed,
                "tokens": ls.logical_length,
                "kv_bytes": ls.kv_bytes,
                "dense_bytes": ls.dense_bytes,
                "compression": ls.dense_bytes / ls.kv_bytes if ls.kv_bytes else float("inf"),
                **ls.totals(),
            }
            for ls in self.layers
        ]
        columns = ["layer", "compressed", "tokens", "kv_bytes", "dense_bytes", "compression", "window", *STATE_NAMES]
        return pd.DataFrame(rows, columns=columns)

    def _repr_html_(self) -> str:
        from hfkv.inspect import stats_html

        return stats_html(self.layers, kv_bytes=self.kv_bytes, dense_bytes=self.dense_bytes)

    def __str__(self) -> str:
        lines = [
            f"CacheStats: kv_bytes={self.kv_bytes:,} dense_bytes={self.dense_bytes:,} "
            f"compression_ratio={self.compression_ratio:.2f}x backend={self.backend}"
        ]
        for ls in self.layers:
            tot = ls.totals()
            lines.append(
                f"  layer {ls.layer:>3}: len={ls.logical_length:>6} kv={ls.kv_bytes:>12,}B "
                f"dense={ls.dense_bytes:>12,}B " + " ".join(f"{k}={v}" for k, v in tot.items())
            )
        return "\n".join(lines)
