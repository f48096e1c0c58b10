"""Transitional: :mod:`asyncrefit._wire._framing` under its old name.

Kept while ``asyncrefit.vllm`` (edited in parallel) still imports it; import
:mod:`asyncrefit._wire._framing` in new code. Remove once nothing imports this path.
"""

from .._wire._framing import *  # noqa: F403
