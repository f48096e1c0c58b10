"""Trainer sources beyond a plain module: sharded ranks, other processes, conversions.

- :class:`DTensorSource`: one rank of a sharded trainer (FSDP2, tensor parallel),
  gathered bucket by bucket into the staging slots, cast to the engine's dtype.
- :class:`RankServer` / :class:`RankSource`: a rank in another process serves its
  source; the coordinator drives it through every push.
- :class:`ConvertingSource`: full, engine-named tensors that a conversion function
  makes (from Megatron TP/PP/EP shards, fused ``qkv`` and ``gate_up``), bucket by bucket.
- :class:`CollectiveTrainer`: packs into its own slots and broadcasts them to workers
  that share no memory with it (another node, another GPU), over a dedicated group.
- :class:`CudaSharedParameterTrainer`: zero-copy on one GPU, the parameters living in
  CUDA IPC-shared slabs (one copy per consumer, none on the trainer's side).
"""

from ._collective import CollectiveTrainer as CollectiveTrainer
from ._convert import ConvertingSource as ConvertingSource
from ._cuda_shared import CudaSharedParameterTrainer as CudaSharedParameterTrainer
from ._dtensor import DTensorSource as DTensorSource
from ._rank import RankPush as RankPush
from ._rank import RankServer as RankServer
from ._rank import RankSource as RankSource
from ._rank import rank_path as rank_path

__all__ = (
    "CollectiveTrainer",
    "ConvertingSource",
    "CudaSharedParameterTrainer",
    "DTensorSource",
    "RankPush",
    "RankServer",
    "RankSource",
    "rank_path",
)
