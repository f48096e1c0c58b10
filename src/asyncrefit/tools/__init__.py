"""The tools behind the ``asyncrefit`` command and ``benchmarks/``: not the library.

``demo`` (train a small transformer, push, verify), ``bench`` and ``plan`` (refit
throughput against memcpy; how a set is bucketed), ``timeline`` (a push's events as
a Chrome trace or a picture) and ``soak`` (many pushes, watching for growth), with the
helpers they and the benchmark scripts share: one check of the workers' parameters
against the trainer's (``_verify``), one description of the machine (``_machine``) and
one table printer (``_table``).

Importing this package imports nothing else; the modules import torch and the
coordinator when they are imported, so the library's core never pulls them in.
"""
