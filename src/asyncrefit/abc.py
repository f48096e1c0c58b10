"""The protocols a backend implements, and the records they exchange.

Implement :class:`Worker` to plug an inference engine of your own into
:class:`~asyncrefit.RefitCoordinator`, :class:`TrainerSource` (and its optional
extensions) to feed it from a trainer of your own, :class:`~asyncrefit.transport.Exporter`
and :class:`~asyncrefit.transport.Importer` for a transport of your own. The
coordinator never needs anything else of an object: these protocols are the whole
contract, the types here the records that cross it (see :mod:`asyncrefit.planning` for
the plan a worker is handed). The bundled backends (``asyncrefit.local``,
``asyncrefit.ray``, ``asyncrefit.vllm``, ``asyncrefit.trainer``) implement them too.
"""

from ._gate import WriteGate as WriteGate
from ._protocols import DirectWorker as DirectWorker
from ._protocols import GatedWritingSource as GatedWritingSource
from ._protocols import OrderedSource as OrderedSource
from ._protocols import PushEndingSource as PushEndingSource
from ._protocols import RestoringWorker as RestoringWorker
from ._protocols import SourceInfo as SourceInfo
from ._protocols import TrainerSource as TrainerSource
from ._protocols import TransmittingSource as TransmittingSource
from ._protocols import Worker as Worker
from ._protocols import WritingSource as WritingSource
from ._public import fix_modules as _fix_modules
from ._wire._messages import BucketAck as BucketAck
from .transport._base import Exporter as Exporter
from .transport._base import Handle as Handle
from .transport._base import Importer as Importer
from .transport._base import OrderingExporter as OrderingExporter

__all__ = (
    "BucketAck",
    "DirectWorker",
    "Exporter",
    "GatedWritingSource",
    "Handle",
    "Importer",
    "OrderedSource",
    "OrderingExporter",
    "PushEndingSource",
    "RestoringWorker",
    "SourceInfo",
    "TrainerSource",
    "TransmittingSource",
    "Worker",
    "WriteGate",
    "WritingSource",
)

_fix_modules(globals(), __all__)
