"""`python -m batchknee.devcluster.in_netns CMD [ARG...]`: CMD in a private network namespace of
its own where the machine allows one, else CMD as it is, with a note why (see `devcluster.netns`).
A module of its own: `netns` is imported by the package, and `-m` must not run it a second time."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from batchknee.devcluster import netns


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--inside"]:
        if len(args) < 2:
            print("usage: python -m batchknee.devcluster.in_netns CMD [ARG...]", file=sys.stderr)
            return 2
        netns.set_up_and_exec(args[1:])
    if not args:
        print("usage: python -m batchknee.devcluster.in_netns CMD [ARG...]", file=sys.stderr)
        return 2
    netns.exec_inside(args)
    os.execvp(args[0], args)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
