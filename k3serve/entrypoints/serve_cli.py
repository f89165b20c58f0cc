"""``k3serve serve``: until the OpenAI-compatible server lands (the server issue), this runs the offline
generation demo on the given model (default: the package's default model) and says so."""

from __future__ import annotations

import argparse
import sys

from k3serve.entrypoints import generate_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    generate_cli.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    print("k3serve serve: the HTTP server is not built yet; running an offline generation demo instead.",
          file=sys.stderr)
    return generate_cli.run(args)
