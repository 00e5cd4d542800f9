"""``hfkv eval``: lm-eval's own ``run`` command line with the ``hfkv`` model registered.

The options are not re-declared here: lm-eval's ``Run`` subcommand adds its arguments to this
parser, so every lm-eval option (``--tasks --include_path --batch_size --limit --log_samples
--output_path --gen_kwargs --apply_chat_template ...``) passes through unchanged and
``hfkv eval --help`` lists them (with this module's description and examples, not lm-eval's). The
differences from ``lm_eval run``: the default model is ``hfkv`` (with ``--model hf`` the same command runs
the plain Hugging Face model, and ``pretrained=testbed`` / ``smollm2`` name the shipped models for it too:
:func:`resolve_aliases`), and the command line is checked before lm-eval builds tasks or loads a model
(:func:`check_args`: unknown ``model_args`` keys, the cache spec, the model path), with one-line errors.
Building the parser imports only lm-eval's argument definitions (``lm_eval._cli.run``, no torch); the
evaluator, the models and torch load when the command runs.

    hfkv eval --model_args pretrained=testbed,hfkv_config=hfkv@80 --include_path eval/tasks \\
        --tasks testbed --batch_size 4 --output_path hfkv-out/eval

The examples write under the working directory's ``hfkv-out/`` (gitignored), where every hfkv command writes by
default, never into the committed ``eval/results/``; lm-eval itself writes nothing without ``--output_path``.

Also runnable as ``python -m hfkv.evaluation.lm_eval_cli ...`` and under
``accelerate launch -m hfkv.cli eval ...`` (data parallel).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import sys

import yaml

from hfkv import cli_args as ca

DEFAULT_MODEL = "hfkv"
DESCRIPTION = """\
Run lm-eval tasks with the model 'hfkv': lm-eval's Hugging Face model (HFLM) whose every generate call
gets a fresh hfkv cache, built from hfkv_config. The options below are lm-eval's own ('lm-eval run');
--model defaults to hfkv, and --model hf runs the same command without hfkv. The model arguments are
checked before anything is loaded.
"""
EPILOG = """\
hfkv model_args: pretrained=<hub id | path | testbed | smollm2>, hfkv_config=<method spec: preset,
preset@budget, file.yaml, dynamic, static, quanto-int4, ...>, plus cache overrides: any TriStateConfig
field (budget=512,alpha_h=0.8), dotted tier keys (quantized.key=fp8) or hfkv.<field> (hfkv.backend=torch),
and the arguments of lm-eval's HF model (dtype=bfloat16, max_length=..., gguf_file=...). Any other key is
refused. Cache statistics are written to the results JSON under config.hfkv. See docs/lm-eval.md.

examples:
  # the shipped testbed model and its tasks, the hfkv preset at budget 80 (per KV head)
  hfkv eval --model hfkv --model_args pretrained=testbed,hfkv_config=hfkv@80 \\
      --include_path eval/tasks --tasks testbed --batch_size 4 --output_path hfkv-out/eval

  # the same without hfkv (lm-eval's plain HF model; testbed and smollm2 work here too), for the reference score
  hfkv eval --model hf --model_args pretrained=testbed \\
      --include_path eval/tasks --tasks testbed --batch_size 4 --output_path hfkv-out/eval

  # a hub model on GSM8K at budget 1024, with an override
  hfkv eval --model hfkv \\
      --model_args pretrained=HuggingFaceTB/SmolLM2-360M-Instruct,hfkv_config=hfkv@1024,alpha_h=0.8 \\
      --tasks gsm8k --batch_size 8 --output_path hfkv-out/eval
"""
MODEL_ARGS_HELP = (
    "model arguments, key=val,key2=val2: for hfkv pretrained=<model>, hfkv_config=<method spec>, cache "
    "overrides and lm-eval's HF model arguments (listed below)"
)


class _IntoParser:
    """Stands in for argparse's subparsers so lm-eval's ``Run`` adds its arguments to our parser.

    lm-eval's own description, usage line and examples (``lm-eval run --model hf ...``) are not taken:
    ``hfkv eval --help`` shows this module's."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        p = self.parser
        p.description = DESCRIPTION
        p.epilog = EPILOG
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lm_eval._cli.run import Run  # light: the model and lm-eval's evaluator load in run()

    Run(_IntoParser(parser))
    for action in parser._actions:
        if action.dest == "model":
            action.help = f"lm-eval model name (default: {DEFAULT_MODEL}; 'hf' runs the plain Hugging Face model)"
        elif action.dest == "model_args":
            action.help = MODEL_ARGS_HELP


def _model_from_yaml(path: str | None) -> str | None:
    if not path:
        return None

    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    return data.get("model") if isinstance(data, dict) else None


def _tokenizer_for_synthetic_tasks(ns: argparse.Namespace) -> None:
    """RULER's tasks generate their data with the tokenizer named by ``tokenizer`` / ``pretrained``; the model
    aliases ``testbed`` and ``smollm2`` are not loadable names, so their tokenizer's folder is passed instead."""
    from hfkv.loading import SMOLLM2, TESTBED  # deferred: hfkv.loading imports torch; hfkv eval --help must not

    args = ns.model_args if isinstance(getattr(ns, "model_args", None), dict) else {}
    meta = ns.metadata if isinstance(getattr(ns, "metadata", None), dict) else {}
    if "tokenizer" in args or "tokenizer" in meta or args.get("pretrained") not in (TESTBED, SMOLLM2):
        return
    from hfkv.evaluation.ruler import tokenizer_path  # deferred: imports lm-eval's models, torch and transformers

    ns.metadata = {**meta, "tokenizer": tokenizer_path(args["pretrained"])}


def _is_plain_hflm(model: str) -> bool:
    """Whether ``model`` is lm-eval's Hugging Face model (``hf`` and its aliases) or another subclass of it
    that is not hfkv's: those take ``pretrained=`` as HFLM does."""
    from lm_eval.api.registry import get_model  # optional: the [eval] extra
    from lm_eval.models.huggingface import HFLM  # optional: the [eval] extra

    from hfkv.evaluation.lm_eval_model import HFKVLM  # deferred: imports lm-eval's models and torch

    try:
        cls = get_model(model)
    except (KeyError, ValueError, ImportError):
        return False
    return isinstance(cls, type) and issubclass(cls, HFLM) and not issubclass(cls, HFKVLM)


def resolve_aliases(ns: argparse.Namespace) -> None:
    """``--model hf --model_args pretrained=testbed`` (or ``smollm2``): the shipped model's files, as the ``hfkv``
    model resolves them (:func:`hfkv.evaluation.lm_eval_model.resolve_pretrained`, ``add_bos_token=True`` for
    the testbed included), so the documented reference run needs no hub. Other models' arguments are untouched."""
    from hfkv.evaluation.lm_eval_model import resolve_pretrained  # deferred: imports lm-eval's models and torch
    from hfkv.loading import SMOLLM2, TESTBED  # deferred: hfkv.loading imports torch; hfkv eval --help must not

    args = getattr(ns, "model_args", None)
    if not isinstance(args, dict) or args.get("pretrained") not in (TESTBED, SMOLLM2):
        return
    model = getattr(ns, "model", None) or _model_from_yaml(getattr(ns, "config", None)) or "hf"
    if not _is_plain_hflm(model):
        return
    rest = {k: v for k, v in args.items() if k != "pretrained"}
    pretrained, rest = resolve_pretrained(args["pretrained"], rest)
    ns.model_args = {"pretrained": pretrained, **rest}


def check_args(ns: argparse.Namespace) -> None:
    """Refuse a bad command line before lm-eval builds tasks or loads a model (:class:`hfkv.cli_args.UsageError`):
    lm-eval's own option checks, an unknown ``--model``, for ``--model hfkv`` its ``model_args``
    (:func:`hfkv.evaluation.lm_eval_model.check_model_args`: unknown keys, the cache spec and overrides, the
    model path), and for lm-eval's HF models (``--model hf``) the ``pretrained=`` path. Unknown task names are
    lm-eval's to find; that error is turned into a ``--tasks`` one in run()."""
    from lm_eval.api.registry import model_registry  # optional: the [eval] extra

    from hfkv.evaluation.lm_eval_model import check_model_args  # deferred: imports lm-eval's models and torch

    try:
        from lm_eval.config.evaluate_config import EvaluatorConfig  # optional: the [eval] extra
    except ImportError:  # an lm-eval without it checks its options in ns.func
        cfg = ns
    else:
        quiet = copy.copy(ns)
        quiet.model_args = copy.deepcopy(getattr(ns, "model_args", None))
        logging.disable(logging.WARNING)  # lm-eval warns (--limit) and prints a --config: once is enough
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                cfg = EvaluatorConfig.from_cli(quiet)
        except (ValueError, TypeError) as exc:
            option = "--tasks" if "task" in str(exc).lower() and not getattr(ns, "tasks", None) else None
            raise ca.UsageError(option, str(exc)) from None
        except OSError as exc:  # an unreadable --config file
            raise ca.UsageError("--config", str(exc)) from None
        finally:
            logging.disable(logging.NOTSET)
    if not getattr(cfg, "tasks", None):
        raise ca.UsageError(
            "--tasks", "no task given; name lm-eval tasks or groups, e.g. --tasks testbed --include_path eval/tasks"
        )
    model = getattr(cfg, "model", None) or "hf"
    if model not in model_registry:
        known = sorted(model_registry.keys())
        raise ca.UsageError(
            "--model", f"{model!r} is not an lm-eval model{ca.did_you_mean(model, known)}; models: {', '.join(known)}"
        )
    model_args = getattr(cfg, "model_args", None) or {}
    if not isinstance(model_args, dict):
        from lm_eval.utils import simple_parse_args_string  # optional: the [eval] extra

        model_args = simple_parse_args_string(str(model_args))
    if model != DEFAULT_MODEL:
        pretrained = model_args.get("pretrained")
        if isinstance(pretrained, str) and _is_plain_hflm(model):  # a missing directory, smollm2 without its wheel
            ca.check_model("--model_args pretrained", pretrained, model_args.get("gguf_file"))
        return
    try:
        check_model_args(model_args)
    except (ValueError, FileNotFoundError) as exc:
        raise ca.UsageError("--model_args", str(exc)) from None
    pretrained = model_args.get("pretrained")
    if isinstance(pretrained, str):
        ca.check_model("--model_args pretrained", pretrained, model_args.get("gguf_file"))


def run(args: argparse.Namespace) -> int:
    import hfkv.evaluation.lm_eval_model  # noqa: F401  (registers the "hfkv" model)

    ns = argparse.Namespace(**{k: v for k, v in vars(args).items() if not k.startswith("_")})
    if not getattr(ns, "model", None) and not _model_from_yaml(getattr(ns, "config", None)):
        ns.model = DEFAULT_MODEL
    check_args(ns)  # before lm-eval builds tasks or loads the model
    _tokenizer_for_synthetic_tasks(ns)  # reads the aliases: before they are resolved
    resolve_aliases(ns)
    try:
        ns.func(ns)
    except ValueError as exc:
        if str(exc).startswith("Tasks not found"):  # lm-eval matches task names before it loads the model
            raise ca.UsageError(
                "--tasks", f"{exc}; `lm-eval ls tasks` lists them (local task folders need --include_path)"
            ) from None
        raise
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hfkv.evaluation.lm_eval_cli ...`` = ``hfkv eval ...`` (same checks and errors)."""
    return ca.command_main("eval", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
