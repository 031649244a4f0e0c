"""One module per engine: everything the operator, its adapters and the emulator know about it.

Each engine module holds pure data and nothing else: the command line (program, managed flags and
their aliases, defaults), the metric names the adapter queries (fallback chains, newest first) and
the names a release exports, the HTTP surface, and the release the names are pinned to. Adding an
engine is one module here plus its tests."""
