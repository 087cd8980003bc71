"""Background NVML sampler of GPU utilisation and memory over a window (a step, a benchmark run)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any


@dataclass(frozen=True, slots=True)
class GpuSample:
    """Summary of one sampling window."""

    mean_util_pct: float  # mean of NVML's utilisation.gpu readings (percent of time a kernel ran)
    peak_mem_bytes: int  # largest device memory in use seen, all processes
    num_samples: int
    duration_s: float


class GpuUtilSampler:
    """Samples NVML every `interval_s` on a daemon thread between `start()` and `stop()`.

    Without NVML, a driver or the device (CPU machines), `available` is False, `reason` says why,
    and start/stop do nothing: `stop()` returns None, never raises. NVML's utilisation counter is
    itself averaged over its own period (1/6 s to 1 s by GPU), so windows much shorter than that
    read coarse values.

        with GpuUtilSampler() as s:
            run_step()
        print(s.result)
    """

    def __init__(self, device_index: int = 0, interval_s: float = 0.05) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.device_index = device_index
        self.interval_s = interval_s
        self.result: GpuSample | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._utils: list[int] = []
        self._peak_mem = 0
        self._t0 = 0.0
        self._nvml: Any = None
        self.reason = ""
        self.available = self._probe()

    @classmethod
    def for_device(cls, device: Any, interval_s: float = 0.05) -> GpuUtilSampler:
        """A sampler of the CUDA ``device`` (a ``torch.device``; no index: the current one). NVML numbers
        the GPUs physically and ignores ``CUDA_VISIBLE_DEVICES``: ``cuda:0`` under
        ``CUDA_VISIBLE_DEVICES=4,5`` is NVML's device 4. Where the mapping cannot be read (a MIG or UUID
        list torch cannot resolve), the torch index stands in."""
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            index = torch.cuda._get_nvml_device_index(torch.device("cuda", index))
        except Exception:  # noqa: BLE001 - NVML's own failure shows in `reason` at the probe
            pass
        return cls(index, interval_s)

    def _probe(self) -> bool:
        """Check once that NVML loads and the device exists; every init is paired with a shutdown."""
        try:
            import pynvml

            pynvml.nvmlInit()
            try:
                pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
            finally:
                pynvml.nvmlShutdown()
        except Exception as e:  # noqa: BLE001 - any NVML failure means "no GPU metrics", not an error
            self.reason = f"NVML unavailable: {type(e).__name__}: {e}"
            return False
        self._nvml = pynvml
        return True

    @property
    def running(self) -> bool:
        """True between a `start()` and the matching `stop()`."""
        return self._thread is not None

    def start(self) -> GpuUtilSampler:
        """Begin a new window; a no-op when already running or NVML is unavailable."""
        if not self.available or self.running:
            return self
        self._stop.clear()
        self._utils, self._peak_mem = [], 0
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="oppo-gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> GpuSample | None:
        """End the window, join the thread and return its summary (None if not running or no samples)."""
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._thread = None
        n = len(self._utils)
        self.result = None
        if n:
            duration = time.perf_counter() - self._t0
            self.result = GpuSample(sum(self._utils) / n, self._peak_mem, n, duration)
        return self.result

    def _run(self) -> None:
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except Exception:  # noqa: BLE001 - the window simply has no samples
            return
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(self.device_index)
            # NOTE: sample before the first wait so even a window shorter than interval_s has a reading.
            while True:
                self._utils.append(int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
                self._peak_mem = max(self._peak_mem, int(nvml.nvmlDeviceGetMemoryInfo(handle).used))
                if self._stop.wait(self.interval_s):
                    break
        except Exception:  # noqa: BLE001 - a GPU lost mid-window ends sampling; stop() reports what was read
            pass
        finally:
            nvml.nvmlShutdown()

    def __enter__(self) -> GpuUtilSampler:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
