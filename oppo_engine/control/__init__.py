"""Online controllers of the two overlaps: chunk size C (intra-step) and overcommit Δ (inter-step).

Pure Python, no torch: they decide from the numbers the scheduler measures, so they are tested with fake
clocks and synthetic reward curves.
"""

from oppo_engine.control.chunk import (
    OFF,
    Arm,
    ChunkControl,
    ChunkRecord,
    ChunkSizeController,
    SwitchProfile,
    predicted_seconds_per_token,
)
from oppo_engine.control.delta import DeltaControl, DeltaController, DeltaRecord, fit_slope

__all__ = [
    "OFF",
    "Arm",
    "ChunkControl",
    "ChunkRecord",
    "ChunkSizeController",
    "DeltaControl",
    "DeltaController",
    "DeltaRecord",
    "SwitchProfile",
    "fit_slope",
    "predicted_seconds_per_token",
]
