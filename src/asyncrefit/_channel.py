"""Transitional: :mod:`asyncrefit._wire._channel` under its old name.

Kept while ``asyncrefit.vllm`` and ``asyncrefit._coordinator`` (edited in parallel)
still import it; import :mod:`asyncrefit._wire._channel` in new code. Remove once nothing
imports this path.
"""

from ._wire._channel import *  # noqa: F403
