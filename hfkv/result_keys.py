"""A config as the key of stored results: sweep rows, hold-out evaluations, a calibration study's base.

Such files outlive the code that wrote them, and the resumable sweeps and studies match their rows by the
config they ran. A config field added later must not make every stored row due again, so the key leaves a
later field out at the value that behaves as before it existed (:func:`key_dict`), and a key stored before a
field existed is read as today's code would write the same config (:func:`stored_key`).
:meth:`hfkv.config.TriStateConfig.key_dict` and :meth:`~hfkv.config.TriStateConfig.stored_key` call these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["LATER_FIELDS", "PREDATED_FIELDS", "key_dict", "stored_key"]

#: Config fields added after results keyed by a config were stored, with the value that behaves as before they
#: existed (:func:`key_dict` leaves them out at that value). ``dense_phase`` behaves as before only where the budget
#: never covers the sequence (hfkv.layer.dense); the stored rows where it covered part of it (the testbed's
#: arith_cot above its prompts' length) were run again when it came.
LATER_FIELDS: dict[str, Any] = {
    "stagger": False,
    "run_ahead": True,
    "rotate": False,
    "dense_phase": True,
    "layer_adaptive": False,
    "score_source": "attention",
    "gates": None,
}
#: Fields added before that rule, which :func:`key_dict` writes at every value: rows stored before them ran at
#: this value.
PREDATED_FIELDS: dict[str, Any] = {"carry": 0.0}


class _Config(Protocol):
    """What a key is made of: a :class:`hfkv.config.TriStateConfig`, which imports this module (this one does not
    import it back)."""

    def to_dict(self) -> dict[str, Any]: ...


def key_dict(cfg: _Config) -> dict[str, Any]:
    """``cfg.to_dict()`` as a key of stored results: a field added after such files were written is left out at
    the value that behaves as before it existed (``LATER_FIELDS``), so the files stay valid and the sweeps and
    studies resumable."""
    return stored_key(cfg.to_dict())  # to_dict holds every field: the predated ones are kept as they are


def stored_key(stored: Mapping[str, Any]) -> dict[str, Any]:
    """A config key stored by earlier code (:func:`key_dict`) as today's code writes the same config: a row
    written before a field existed ran at the value that behaved as before it (``PREDATED_FIELDS``), so its
    key gets that value, and a resumed sweep sees it done where today's config is the same."""
    out = dict(stored)
    for name, before in PREDATED_FIELDS.items():
        out.setdefault(name, before)
    for name, inert in LATER_FIELDS.items():
        if name in out and out[name] == inert:
            del out[name]
    return out
