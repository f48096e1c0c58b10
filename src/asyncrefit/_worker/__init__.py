"""The worker side, once for every backend: what runs where the weights are written.

:mod:`._endpoint` answers the coordinator's requests over a sink; :mod:`._receiver`
is the sink that copies a bucket into a module's own tensors (and
:class:`~asyncrefit.ParameterReceiver`); :mod:`._layout` checks every entry of a
handle before a byte is read; :mod:`._state` keeps the worker's complete and pending
weight versions.
"""
