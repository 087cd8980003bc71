"""Scale-out under torch.distributed: data-parallel engine groups and remote scorers.

A lane and a service, not branches in the step loop (DESIGN.md, "Scale-out"): gloo on the CPU, NCCL on GPUs.
``ScorerService`` runs frozen scorers on a rank of their own; ``RemoteScorers`` is an actor rank's ``reward=``
for it (``distributed/service.py``, ``distributed/remote.py``, over ``distributed/transport.py``).
"""

from oppo_engine.distributed.group import GroupFailed, PeerCallFailed
from oppo_engine.distributed.remote import RemoteScorers
from oppo_engine.distributed.service import ScorerService
from oppo_engine.distributed.stateless import stateless_group

__all__: list[str] = ["GroupFailed", "PeerCallFailed", "RemoteScorers", "ScorerService", "stateless_group"]
