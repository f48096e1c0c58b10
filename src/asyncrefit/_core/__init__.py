"""The coordinator side: what runs in the process that awaits ``push``.

:mod:`._coordinator` (:class:`RefitCoordinator`: lifecycle, membership, re-planning,
settling) asks :mod:`._discovery` for the workers' devices and the sources'
descriptions, plans with :mod:`._topology` and :mod:`._plan` under the budget of
:mod:`._budget`, and runs one :class:`._push.Push` per push, whose
:class:`._recorder.PushRecorder` keeps its clock, events and :mod:`._report`. The pure
state machines :mod:`._ledger` (who is in, who holds which slot) and :mod:`._slots`
never await; :mod:`._adapters` turns foreign objects (Ray actor handles) into workers
and sources.
"""
