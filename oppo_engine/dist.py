"""Deprecated: ``oppo_engine.dist`` is now ``oppo_engine.distributed`` (the name ``torch.distributed`` uses;
``dist/`` is the folder that packaging tools give to build output and skip). This alias, submodules
included (``oppo_engine.dist.group`` is ``oppo_engine.distributed.group``), stays for one release and warns
when imported. It is a module, not a package: its submodules are entries in ``sys.modules``.
"""

from __future__ import annotations

import sys
import warnings

from oppo_engine import distributed
from oppo_engine.distributed import (
    GroupFailed,
    PeerCallFailed,
    RemoteScorers,
    ScorerService,
    group,
    protocol,
    remote,
    service,
    stateless,
    stateless_group,
    transport,
)

warnings.warn(
    "oppo_engine.dist is renamed oppo_engine.distributed; the old name goes in the next release",
    FutureWarning,
    stacklevel=2,
)

# NOTE: `import oppo_engine.dist.group` imports this module first, then finds the submodule here.
for _module in (group, protocol, remote, service, stateless, transport):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module
del _module

__all__ = [
    "GroupFailed", "PeerCallFailed", "RemoteScorers", "ScorerService", "distributed", "stateless_group",
]  # fmt: skip
