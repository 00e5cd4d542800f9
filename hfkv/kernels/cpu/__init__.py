"""CPU kernels: C++ built on first use (:mod:`.build`) and called through ctypes (:mod:`.paged_decode`)."""
