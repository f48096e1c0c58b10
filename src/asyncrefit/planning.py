"""The planner, for advanced use: how parameters are packed into buckets and budgeted.

:class:`~asyncrefit.RefitCoordinator` plans by itself; what is here is for a backend
that must read a plan (a :class:`~asyncrefit.abc.Worker` is handed :class:`Bucket`
records), for tools that plan ahead (how many buckets a budget gives), and for tests.

- :func:`plan_buckets` packs :class:`~asyncrefit.ParamSpec` records into a
  :class:`Plan` of :class:`Bucket` records, each a list of :class:`TensorEntry`
  (a tensor's or a part's place in the bucket's buffer); :func:`validate_worker`
  checks a worker's declared parameters against a plan.
- :class:`ByteBudget` is the byte-weighted FIFO-fair semaphore the coordinator's
  memory budget is made of; :class:`~asyncrefit.BudgetStatistics` its figures.
- :class:`VersionState` is the worker side's pure state machine of its complete and
  pending weight versions (what a custom endpoint keeps).
"""

from ._core._budget import ByteBudget as ByteBudget
from ._core._plan import Bucket as Bucket
from ._core._plan import Plan as Plan
from ._core._plan import TensorEntry as TensorEntry
from ._core._plan import plan_buckets as plan_buckets
from ._core._plan import validate_worker as validate_worker
from ._public import fix_modules as _fix_modules
from ._worker._state import VersionState as VersionState

__all__ = (
    "Bucket",
    "ByteBudget",
    "Plan",
    "TensorEntry",
    "VersionState",
    "plan_buckets",
    "validate_worker",
)

_fix_modules(globals(), __all__)
