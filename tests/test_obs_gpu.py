import sys
import threading
import time
import types

import pytest

from oppo_engine.obs.gpu import GpuUtilSampler


def _sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "oppo-gpu-sampler"]


def _fake_pynvml(utils: list[int], mems: list[int], fail_init: bool = False) -> types.ModuleType:
    """A stand-in for pynvml that replays readings and counts init/shutdown pairs."""
    m = types.ModuleType("pynvml")
    m.state = {"inits": 0, "reads": 0}

    class NVMLError(Exception):
        pass

    def init():
        if fail_init:
            raise NVMLError("NVML Shared Library Not Found")
        m.state["inits"] += 1

    def shutdown():
        m.state["inits"] -= 1

    def util(handle):
        i = min(m.state["reads"], len(utils) - 1)
        m.state["reads"] += 1
        return types.SimpleNamespace(gpu=utils[i])

    def mem(handle):
        return types.SimpleNamespace(used=mems[min(m.state["reads"] - 1, len(mems) - 1)])

    m.NVMLError = NVMLError
    m.nvmlInit, m.nvmlShutdown = init, shutdown
    m.nvmlDeviceGetHandleByIndex = lambda i: object()
    m.nvmlDeviceGetUtilizationRates, m.nvmlDeviceGetMemoryInfo = util, mem
    return m


def test_without_nvml_sampler_is_unavailable_and_stop_returns_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([0], [0], fail_init=True))
    s = GpuUtilSampler()
    assert not s.available and "NVML" in s.reason
    with s:
        assert not s.running and _sampler_threads() == []
    assert s.stop() is None and s.result is None


def test_on_this_machine_sampler_never_raises():
    # Real pynvml here: unavailable on CPU machines, live on GPU ones; either way no exception, no thread.
    s = GpuUtilSampler(interval_s=0.01)
    s.start()
    out = s.stop()
    assert (out is None) == (not s.available)
    assert _sampler_threads() == []


def test_sampler_reports_mean_util_and_peak_memory(monkeypatch):
    fake = _fake_pynvml(utils=[10, 30, 50], mems=[100, 700, 300])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    s = GpuUtilSampler(interval_s=0.001)
    assert s.available
    with s:
        deadline = time.monotonic() + 5.0
        while fake.state["reads"] < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
    out = s.result
    assert out is not None and out.num_samples >= 3
    # readings after the third repeat the last one (50, 300)
    assert out.mean_util_pct == pytest.approx((10 + 30 + 50 * (out.num_samples - 2)) / out.num_samples)
    assert out.peak_mem_bytes == 700
    assert fake.state["inits"] == 0  # every nvmlInit was paired with nvmlShutdown
    assert _sampler_threads() == []


def test_start_and_stop_are_idempotent_and_restartable(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml([40], [5]))
    s = GpuUtilSampler(interval_s=0.001)
    assert s.stop() is None  # never started
    s.start()
    thread = s._thread
    s.start()  # second start keeps the same window and thread
    assert s._thread is thread and len(_sampler_threads()) == 1
    first = s.stop()
    assert first is not None and first.mean_util_pct == 40 and first.num_samples >= 1
    assert s.stop() is None and _sampler_threads() == []
    s.start()
    assert s.stop() is not None and _sampler_threads() == []


def test_sampler_survives_a_gpu_lost_mid_window(monkeypatch):
    fake = _fake_pynvml([20], [1])

    def flaky(handle):
        fake.state["reads"] += 1
        if fake.state["reads"] > 2:
            raise fake.NVMLError("GPU is lost")
        return types.SimpleNamespace(gpu=20)

    fake.nvmlDeviceGetUtilizationRates = flaky
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    s = GpuUtilSampler(interval_s=0.001).start()
    deadline = time.monotonic() + 5.0
    while fake.state["reads"] < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    out = s.stop()
    assert out is not None and out.num_samples == 2 and out.mean_util_pct == 20
    assert fake.state["inits"] == 0 and _sampler_threads() == []


def test_invalid_interval_is_rejected():
    with pytest.raises(ValueError, match="interval_s"):
        GpuUtilSampler(interval_s=0)


def test_for_device_maps_a_torch_index_to_nvmls_through_cuda_visible_devices(monkeypatch):
    # NVML numbers GPUs physically: cuda:1 under CUDA_VISIBLE_DEVICES=4,5 is NVML's 5, not 1.
    import torch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert GpuUtilSampler.for_device(torch.device("cuda", 1)).device_index == 5
    assert GpuUtilSampler.for_device(torch.device("cuda", 0)).device_index == 4
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert GpuUtilSampler.for_device(torch.device("cuda", 3)).device_index == 3
