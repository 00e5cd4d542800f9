"""``hfkv eval``: lm-eval's own ``run`` command line with the ``hfkv`` model registered.

The options are not re-declared here: lm-eval's ``Run`` subcommand adds its arguments to this
parser, so every lm-eval option (``--tasks --include_path --batch_size --limit --log_samples
--output_path --gen_kwargs --apply_chat_template ...``) passes through unchanged and
``hfkv eval --help`` lists them. The only difference from ``lm_eval run`` is the default model,
``hfkv`` (with ``--model hf`` the same command runs the plain Hugging Face model).

    hfkv eval --model_args pretrained=testbed,hfkv_config=hfkv@80 --include_path eval/tasks \\
        --tasks testbed --batch_size 4 --output_path eval/results/lm_eval

Also runnable as ``python -m hfkv.evaluation.lm_eval_cli ...`` and under
``accelerate launch -m hfkv.cli eval ...`` (data parallel).
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_MODEL = "hfkv"
EPILOG = """\
hfkv model_args: pretrained=<hub id | path | testbed | smollm2>, hfkv_config=<method spec: preset,
preset@budget, file.yaml, dynamic, static, quanto-int4, ...>, plus cache overrides: any TriStateConfig
field (budget=512,alpha_h=0.8), dotted tier keys (quantized.key=fp8) or hfkv.<field> (hfkv.backend=torch).
Cache statistics are written to the results JSON under config.hfkv. See docs/lm-eval.md.
"""


class _IntoParser:
    """Stands in for argparse's subparsers so lm-eval's ``Run`` adds its arguments to our parser."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        p = self.parser
        p.description = (p.description or "") + "\n\n" + (kwargs.get("description") or "")
        p.epilog = EPILOG + "\n" + (kwargs.get("epilog") or "")
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from lm_eval._cli.run import Run  # light: the model and lm-eval's evaluator load in run()

    Run(_IntoParser(parser))
    for action in parser._actions:
        if action.dest == "model":
            action.help = f"Model name (default: {DEFAULT_MODEL}; 'hf' runs the plain Hugging Face model)"


def _model_from_yaml(path: str | None) -> str | None:
    if not path:
        return None
    import yaml

    with open(path, encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    return data.get("model") if isinstance(data, dict) else None


def _tokenizer_for_synthetic_tasks(ns: argparse.Namespace) -> None:
    """RULER's tasks generate their data with the tokenizer named by ``tokenizer`` / ``pretrained``; the model
    aliases ``testbed`` and ``smollm2`` are not loadable names, so their tokenizer's folder is passed instead."""
    from hfkv.loading import SMOLLM2, TESTBED

    args = ns.model_args if isinstance(getattr(ns, "model_args", None), dict) else {}
    meta = ns.metadata if isinstance(getattr(ns, "metadata", None), dict) else {}
    if "tokenizer" in args or "tokenizer" in meta or args.get("pretrained") not in (TESTBED, SMOLLM2):
        return
    from hfkv.evaluation.ruler import tokenizer_path

    ns.metadata = {**meta, "tokenizer": tokenizer_path(args["pretrained"])}


def run(args: argparse.Namespace) -> int:
    import hfkv.evaluation.lm_eval_model  # noqa: F401  (registers the "hfkv" model)

    ns = argparse.Namespace(**{k: v for k, v in vars(args).items() if not k.startswith("_")})
    if not getattr(ns, "model", None) and not _model_from_yaml(getattr(ns, "config", None)):
        ns.model = DEFAULT_MODEL
    _tokenizer_for_synthetic_tasks(ns)
    ns.func(ns)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hfkv eval", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
