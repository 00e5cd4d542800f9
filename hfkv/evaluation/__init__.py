"""Measuring caches: teacher-forced fidelity, lm-eval integration (`hfkv eval`) and benchmarks (`hfkv bench`)."""
