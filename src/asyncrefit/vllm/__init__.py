"""vLLM integration: refit a running ``vllm.LLM`` or ``vllm.AsyncLLM``.

Start the engine with :func:`engine_args`, connect to it with :func:`connect_async_llm`
(or :func:`connect_llm`), and give the workers it yields to a
:class:`~asyncrefit.RefitCoordinator`::

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, **engine_args()))
    async with connect_async_llm(engine, pause_mode="keep") as workers:
        async with RefitCoordinator(trainer=model, workers=workers, budget_bytes=...) as refit:
            await refit.push(version=step)

The trainer sends tensors under the checkpoint's (Hugging Face) names; vLLM's own
weight-update session loads them. A LoRA adapter is pushed in memory with its own
versions: declare it with :class:`LoRAAdapter` and give the coordinator
``[w.lora(adapter) for w in workers]`` (see :class:`VLLMAdapterWorker`). Importing
this package does not import vLLM; vLLM imports :mod:`asyncrefit.vllm.worker` into its
worker processes.
"""

from .._exceptions import EngineConfigError as EngineConfigError
from .._exceptions import EngineLoopError as EngineLoopError
from ._channels import ChannelStatistics as ChannelStatistics
from ._connect import VLLMAdapterWorker as VLLMAdapterWorker
from ._connect import VLLMWorker as VLLMWorker
from ._connect import connect_async_llm as connect_async_llm
from ._connect import connect_llm as connect_llm
from ._connect import engine_args as engine_args
from ._lora import LoRAAdapter as LoRAAdapter
from ._ops import PauseMode as PauseMode
from ._wire import BACKEND as BACKEND
from ._wire import EXTENSION as EXTENSION

__all__ = (
    "BACKEND",
    "ChannelStatistics",
    "EXTENSION",
    "EngineConfigError",
    "EngineLoopError",
    "LoRAAdapter",
    "PauseMode",
    "VLLMAdapterWorker",
    "VLLMWorker",
    "connect_async_llm",
    "connect_llm",
    "engine_args",
)
