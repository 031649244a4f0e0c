"""Subcommands of the `batchknee` CLI."""


class UsageError(Exception):
    """A user mistake: printed as one line naming the option, exit status 2, no traceback."""
