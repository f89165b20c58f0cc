"""Command-line entry points (one module per ``k3serve`` subcommand)."""
