import dataclasses
import logging

from oppo_engine.obs.metrics import StepMetrics, format_step_summary, log_step

CONTRACT_FIELDS = [
    "wall_s",
    "generation_s",
    "exposed_scoring_s",
    "tokens_generated",
    "rollouts",
    "chunk_size",
    "overcommit",
    "deferred",
    "pages_used",
    "lane_busy",
    "gpu_util",
    "handoffs",
    "deferral_histogram",
    "stale_tokens",
    "length_bias",
    "recomputed_tokens",
    "reused_tokens",
    "swapped_tokens",
    "shared_tokens",
    "retries",
    "graph_forwards",
    "graph_recompiles",
    "graph_fallback",
    "env_calls",
    "env_wait_s",
    "env_latency_s",
    "cpu_s",
]


def _metrics(**kw) -> StepMetrics:
    base = dict(
        wall_s=2.0,
        generation_s=1.5,
        exposed_scoring_s=0.25,
        tokens_generated=1000,
        rollouts=64,
        chunk_size=16,
        overcommit=8,
        deferred=8,
        pages_used=321,
        lane_busy={"actor": 0.9, "reward": 0.5},
        gpu_util=None,
    )
    return StepMetrics(**(base | kw))


def test_step_metrics_field_names_are_the_contract():
    assert [f.name for f in dataclasses.fields(StepMetrics)] == CONTRACT_FIELDS
    assert not hasattr(_metrics(), "__dict__")  # slots


def test_summary_reports_the_step_numbers():
    line = format_step_summary(7, _metrics())
    for part in [
        "step 7",
        "2.000s",
        "0.250s",
        "64 rollouts",
        "1000 tok",
        "500.0 tok/s",
        "C=16",
        "overcommit=8",
        "deferred=8",
        "pages=321",
        "actor=90%",
        "reward=50%",
        "gpu n/a",
    ]:
        assert part in line, part
    line = format_step_summary(0, _metrics(chunk_size=None, gpu_util=87.4, wall_s=0.0, lane_busy={}))
    assert "C=-" in line and "gpu 87%" in line and "0.0 tok/s" in line


def test_log_step_logs_the_summary_at_info_on_the_obs_logger(caplog):
    with caplog.at_level(logging.INFO, logger="oppo_engine.obs"):
        log_step(3, _metrics())
    (rec,) = caplog.records
    assert rec.name == "oppo_engine.obs" and rec.levelno == logging.INFO
    assert rec.getMessage() == format_step_summary(3, _metrics())
