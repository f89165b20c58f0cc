"""The ``k3serve`` command line.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules are imported only when their subcommand runs, so ``k3serve --help`` stays fast. Errors meant
for the user are raised as ``CLIError`` (or ``ValueError``/``FileNotFoundError`` from validation) and
printed as one line with a non-zero exit, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from k3serve.core.process import die_with_parent

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("k3serve.entrypoints.serve_cli", "serve a model (default: the package's built-in model)"),
    "generate": ("k3serve.entrypoints.generate_cli", "generate text from a prompt with a model, offline"),
    "tokenize": ("k3serve.tokenizer.cli", "count or encode text files with the Kimi tokenizer"),
    "route": ("k3serve.router.cli", "KV-cache-aware router across replicas, and its trace simulator"),
    "plan": ("k3serve.plan.cli", "plan a Kimi K3 deployment on a GPU type"),
    "bench": ("k3serve.bench.cli", "load-generate against an OpenAI-compatible server"),
    "sweep": ("k3serve.sweep.cli", "measure a grid of serve configurations; Pareto front of throughput vs latency"),
    "verify": ("k3serve.verify.cli", "pre-flight checks of an endpoint against the Kimi K3 serving contract"),
    "spec": ("k3serve.entrypoints.spec_cli", "speculative decoding: train an eagle3 draft head for a model"),
    "params": ("k3serve.entrypoints.params_cli", "count a model config's total and active parameters"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every subcommand's help: descriptions as written, and "(default: X)" only where it says something
    the help text does not (no default of None, no True/False for a flag, never twice)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is argparse.SUPPRESS or isinstance(default, bool) or default == []
                or action.nargs == 0 or "default" in text.lower()):
            return text
        return super()._get_help_string(action)


class RawHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """``HelpFormatter`` for parsers that lay out their own description and epilog."""


def _use_formatter(parser: argparse.ArgumentParser) -> None:
    raw = issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter)
    parser.formatter_class = RawHelpFormatter if raw else HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _use_formatter(sub)


class CLIError(Exception):
    """An error whose message is shown to the user as one line."""


def _load(name: str):
    module_name, _ = SUBCOMMANDS[name]
    return importlib.import_module(module_name)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3serve", description="Serve Kimi K3-class models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (_, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # only the chosen subcommand's module is imported (its flags are needed to parse)
        if name == wanted:
            try:
                _load(name).add_arguments(p)
            except ModuleNotFoundError as e:
                if e.name and e.name.startswith("k3serve"):
                    raise CLIError(f"'k3serve {name}' is not available in this build") from None
                raise
    _use_formatter(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    die_with_parent()  # a replica (router/launch.py) goes when its launcher goes
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        return int(_load(args.command).run(args) or 0)
    except (CLIError, ValueError, FileNotFoundError, KeyError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"k3serve: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
