"""Subcommands of the `zerofit` CLI, one module each (see `zerofit.cli`)."""
