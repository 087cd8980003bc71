"""A device buffer whose address survives freeing its memory: CUDA virtual memory management (VMM).

The KV arena is released for training every PPO step (``release_memory()``) and rebuilt after it. A CUDA
graph reads the arena at the address it was captured with, so an arena rebuilt by ``torch.empty`` at a new
address would make every captured decode bucket re-capture every step. ``FixedAddressBuffer`` reserves a
virtual address range once (``cuMemAddressReserve``) and maps physical memory into it on ``map()``
(``cuMemCreate`` + ``cuMemMap``), unmapping and releasing it on ``unmap()``: the memory goes back to the
device, the address stays, and the graphs replay as they are (vLLM's "sleep mode" does the same through a
pluggable allocator). The driver is reached with ``ctypes`` (no torch CUDA headers to build against).

Unverified on a GPU until ``bench/device_check.sh`` has run ``tests/test_graph.py -m cuda``. Where the
device or driver lacks VMM (its device attribute says so, or a call at construction fails)
``FixedAddressBuffer.create`` returns ``None`` and the arena falls back to ``torch.empty``; the captured
graphs then see the new address and re-capture (counted). A ``map()`` that finds the device out of memory
empties torch's cache (what the trainer freed stays cached there) and tries once more, then raises
``torch.OutOfMemoryError``.
"""

from __future__ import annotations

import ctypes
import functools

import torch

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
_CUDA_ERROR_OUT_OF_MEMORY = 2


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _DriverError(RuntimeError):
    def __init__(self, message: str, result: int = 0) -> None:
        super().__init__(message)
        self.result = result


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    u64, size_t, p = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.POINTER
    signatures = {
        "cuMemGetAllocationGranularity": [p(size_t), p(_AllocationProp), ctypes.c_int],
        "cuMemAddressReserve": [p(u64), size_t, size_t, u64, u64],
        "cuMemAddressFree": [u64, size_t],
        "cuMemCreate": [p(u64), size_t, p(_AllocationProp), u64],
        "cuMemRelease": [u64],
        "cuMemMap": [u64, size_t, size_t, u64, u64],
        "cuMemUnmap": [u64, size_t],
        "cuMemSetAccess": [u64, size_t, p(_AccessDesc), size_t],
        "cuCtxGetCurrent": [p(ctypes.c_void_p)],
        "cuCtxSetCurrent": [ctypes.c_void_p],
        "cuDevicePrimaryCtxRetain": [p(ctypes.c_void_p), ctypes.c_int],
        "cuDeviceGetAttribute": [p(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    }
    try:
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
    except AttributeError:
        return None
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        raise _DriverError(f"{what} failed (CUresult {result})", result)


class _CudaArrayInterface:
    """What ``torch.as_tensor`` needs to view ``nbytes`` bytes at ``ptr`` as a uint8 tensor (no copy). The
    tensor keeps this object alive, and it keeps ``owner``: the range outlives every tensor over it."""

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class FixedAddressBuffer:
    """``nbytes`` of device memory at one virtual address for life, mapped and unmapped on demand.

    ``map()`` backs the range with fresh physical memory and returns a uint8 tensor over it (contents
    undefined, as ``torch.empty``'s); ``unmap()`` synchronizes the device and gives the memory back to it.
    NOTE: the caller drops every tensor over the range before ``unmap()`` (they would point at unmapped
    memory); the address itself is freed only when the buffer is garbage-collected.
    """

    def __init__(self, lib: ctypes.CDLL, device: torch.device, nbytes: int) -> None:
        self._lib = lib
        self.device = device
        self._prop = _AllocationProp()
        self._prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, device.index)
        granularity = ctypes.c_size_t()
        self._bind_context()
        _check(
            lib.cuMemGetAllocationGranularity(
                ctypes.byref(granularity), ctypes.byref(self._prop), _CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            ),
            "cuMemGetAllocationGranularity",
        )
        g = granularity.value
        self.nbytes = nbytes
        self.size = -(-nbytes // g) * g  # whole granules
        ptr = ctypes.c_ulonglong()
        _check(lib.cuMemAddressReserve(ctypes.byref(ptr), self.size, g, 0, 0), "cuMemAddressReserve")
        self.address = ptr.value
        self._handle: int | None = None

    @classmethod
    def create(cls, device: torch.device, nbytes: int) -> FixedAddressBuffer | None:
        """A buffer on CUDA ``device``, or None where the driver offers no virtual memory management."""
        if device.type != "cuda" or (lib := _driver()) is None:
            return None
        torch.cuda.init()  # the primary context the driver calls use (torch's own)
        device = torch.device(
            "cuda", device.index if device.index is not None else torch.cuda.current_device()
        )
        try:
            supported, attribute = ctypes.c_int(), _CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            _check(lib.cuDeviceGetAttribute(ctypes.byref(supported), attribute, device.index), "attribute")
            if not supported.value:  # some vGPUs and older drivers
                return None
            buffer = cls(lib, device, nbytes)
        except _DriverError:
            return None
        try:
            # The first mapping here, not at the arena's first use: a driver (or a sandbox in front of it)
            # that reserves the range but refuses to map it falls back to plain memory like one without
            # VMM. Out of memory is not a refusal: it is raised.
            buffer.map()
        except _DriverError:
            return None  # its __del__ frees the reserved range
        return buffer

    @property
    def mapped(self) -> bool:
        """Physical memory backs the range."""
        return self._handle is not None

    def map(self) -> torch.Tensor:
        """Back the range with new physical memory; a ``[nbytes]`` uint8 tensor at ``address``."""
        if self._handle is None:
            lib = self._lib
            self._bind_context()
            handle = self._create()
            try:
                _check(lib.cuMemMap(self.address, self.size, 0, handle.value, 0), "cuMemMap")
                access = _AccessDesc(self._prop.location, _CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                result = lib.cuMemSetAccess(self.address, self.size, ctypes.byref(access), 1)
                if result != 0:
                    lib.cuMemUnmap(self.address, self.size)
                    _check(result, "cuMemSetAccess")
            except _DriverError:
                lib.cuMemRelease(handle.value)
                raise
            self._handle = handle.value
        with torch.cuda.device(self.device):
            return torch.as_tensor(_CudaArrayInterface(self.address, self.nbytes, self), device=self.device)

    def _create(self) -> ctypes.c_ulonglong:
        """``cuMemCreate`` of the whole range; out of memory, once more after emptying torch's cache (which
        keeps what the trainer freed for torch's own allocations: torch.empty would empty it and retry)."""
        handle, prop = ctypes.c_ulonglong(), ctypes.byref(self._prop)
        result = self._lib.cuMemCreate(ctypes.byref(handle), self.size, prop, 0)
        if result == _CUDA_ERROR_OUT_OF_MEMORY:
            torch.cuda.synchronize(self.device)
            with torch.cuda.device(self.device):
                torch.cuda.empty_cache()
            result = self._lib.cuMemCreate(ctypes.byref(handle), self.size, prop, 0)
            if result == _CUDA_ERROR_OUT_OF_MEMORY:
                free, total = (x / 2**30 for x in torch.cuda.mem_get_info(self.device))
                raise torch.OutOfMemoryError(
                    f"KV arena: cannot map {self.size / 2**30:.2f} GiB on {self.device} ({free:.2f} of "
                    f"{total:.2f} GiB free); lower kv_cache_bytes (EngineConfig, ScorerService)"
                )
        _check(result, "cuMemCreate")
        return handle

    def unmap(self) -> None:
        """Give the physical memory back to the device (after a device sync); the address stays reserved."""
        if self._handle is None:
            return
        # NOTE: cuMemUnmap does not wait for kernels still reading or writing the range (unlike cudaFree;
        # torch's expandable segments sync first too), and __del__ reaches here without the caller's sync.
        torch.cuda.synchronize(self.device)
        self._bind_context()
        _check(self._lib.cuMemUnmap(self.address, self.size), "cuMemUnmap")
        _check(self._lib.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None

    def _bind_context(self) -> None:
        """Make the device's primary context (torch's) current on this thread for the driver calls."""
        ctx = ctypes.c_void_p()
        _check(self._lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            _check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.device.index), "retain")
            _check(self._lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def __del__(self) -> None:
        try:
            self.unmap()
            self._lib.cuMemAddressFree(self.address, self.size)
        except Exception:  # noqa: BLE001 -- interpreter shutdown: the driver may be gone already
            pass
