"""Transitional: :mod:`asyncrefit._wire._messages` under its old name.

Kept while ``asyncrefit.vllm`` and ``asyncrefit._coordinator`` (edited in parallel)
still import it; import :mod:`asyncrefit._wire._messages` in new code. Remove once nothing
imports this path.
"""

from ._wire._messages import *  # noqa: F403
