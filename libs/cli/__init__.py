"""tandem.cli: the one ``tandem`` command (run, dev up, demo, bench, ...), the local stack
(``stack.py``, ``stack.toml``) and the benchmarks (``tandem.cli.bench``).

It may import any service; nothing imports it: no service and not ``tandem.common``.
Heavy imports (torch, diffusers) happen inside the command functions.
"""
