"""Token byte formats (torch reference): quantize+pack and unpack+dequantize."""

from hfkv.quant.formats import FORMAT_NAMES, INT_BITS, QuantFormat

__all__ = ["FORMAT_NAMES", "INT_BITS", "QuantFormat"]
