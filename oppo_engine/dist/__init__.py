"""Scale-out under torch.distributed: data-parallel engine groups and remote scorers.

A lane and a service, not branches in the step loop (DESIGN.md, "Scale-out"): gloo on the CPU, NCCL on GPUs.
"""

from oppo_engine.dist.group import GroupFailed, PeerCallFailed

__all__: list[str] = ["GroupFailed", "PeerCallFailed"]
