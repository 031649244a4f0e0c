"""What lives as long as the process is frozen out of Python's full collections
(`allocator.freeze_long_lived`); garbage found then is collected, not frozen. In a child process:
a freeze is for good."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

OPERATOR_SOURCE = Path(__file__).resolve().parents[2] / "operator"

FREEZE = textwrap.dedent(
    """
    import gc, json, weakref
    from batchknee.adapters import allocator

    class Node:
        pass

    kept = []  # the fleet's state: lives on
    for i in range(100_000):
        node = Node()
        node.labels = [str(i)]
        kept.append(node)
    a, b = Node(), Node()  # garbage in a reference cycle, before the freeze
    a.other, b.other = b, a
    cycle = weakref.ref(a)
    del a, b
    walked_before = len(gc.get_objects())  # what a full collection walks
    frozen = allocator.freeze_long_lived()
    walked_after = len(gc.get_objects())
    later = [[i] for i in range(1000)]  # made after the freeze: collected as ever
    print(json.dumps({
        "walked_before": walked_before,
        "frozen": frozen,
        "walked_after": walked_after,
        "walked_later": len(gc.get_objects()),
        "cycle_collected": cycle() is None,
        "kept": len(kept),
    }))
    """
)


def test_a_freeze_leaves_a_full_collection_only_what_came_after_and_collects_garbage_first() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FREEZE],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(OPERATOR_SOURCE)},
    )
    seen = json.loads(done.stdout)
    assert seen["walked_before"] > 200_000  # the nodes and their label lists
    assert seen["frozen"] >= 200_000
    assert seen["walked_after"] < 100
    assert 1000 < seen["walked_later"] < 1100  # what came after the freeze
    assert seen["cycle_collected"]  # garbage then was collected, not frozen for good
    assert seen["kept"] == 100_000
