"""Subcommands of the `batchknee` CLI."""
