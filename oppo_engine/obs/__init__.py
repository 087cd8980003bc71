"""Observability: step metrics, lane timelines (Chrome/Perfetto traces) and GPU utilisation sampling."""

from oppo_engine.obs.gpu import GpuSample, GpuUtilSampler
from oppo_engine.obs.metrics import StepMetrics, format_step_summary, log_step, logger
from oppo_engine.obs.timeline import Span, Timeline

__all__ = [
    "GpuSample",
    "GpuUtilSampler",
    "Span",
    "StepMetrics",
    "Timeline",
    "format_step_summary",
    "log_step",
    "logger",
]
