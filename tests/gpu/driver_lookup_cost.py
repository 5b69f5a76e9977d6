"""What C125 (csrc/tma_encode.cuh) saves per call, counted from below: the host µs of one
cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled") (CUTLASS's wrapper makes one
per TMA descriptor; our forward encodes four, the backward five to seven), beside one
cuTensorMapEncodeTiled of a Q-like bf16 tile (what remains per descriptor) and one
torch.empty(1) on the GPU (a known host cost, for scale). Medians of 7 runs of 2,000.

    python3 tests/gpu/driver_lookup_cost.py
"""
import ctypes
import statistics
import time

import torch


def loaded_library(stem):
    """The path of the already-loaded shared library whose name starts with `stem` (torch
    loads its own libcudart; a second copy would be another runtime)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/" in path and path.rsplit("/", 1)[-1].startswith(stem):
                return path
    raise RuntimeError(f"{stem} is not loaded in this process")


def median_us(fn, n=2000, runs=7):
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def main():
    torch.empty(1, device="cuda")           # the runtime and driver are up
    cudart = ctypes.CDLL(loaded_library("libcudart.so"))
    fn, found = ctypes.c_void_p(), ctypes.c_int(-1)
    get = cudart.cudaGetDriverEntryPointByVersion
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint,
                    ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_int)]

    def lookup():
        err = get(b"cuTensorMapEncodeTiled", ctypes.byref(fn), 12000, 0, ctypes.byref(found))
        assert err == 0 and found.value == 0 and fn.value, (err, found.value)

    lookup()
    encode = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)(fn.value)
    q = torch.empty(2, 16, 8192, 128, device="cuda", dtype=torch.bfloat16)
    storage = (ctypes.c_uint8 * 192)()      # a CUtensorMap is 128 bytes, 64-byte aligned
    map_address = (ctypes.addressof(storage) + 63) // 64 * 64
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    dims = (u64 * 4)(128, 8192, 16, 2)
    strides = (u64 * 3)(128 * 2, 8192 * 128 * 2, 16 * 8192 * 128 * 2)
    box, elem = (u32 * 4)(64, 128, 1, 1), (u32 * 4)(1, 1, 1, 1)
    BF16, SWIZZLE_128B, L2_256B = 9, 3, 3   # CUtensorMapDataType, ...Swizzle, ...L2promotion

    def encode_once():
        err = encode(map_address, BF16, 4, q.data_ptr(), ctypes.addressof(dims),
                     ctypes.addressof(strides), ctypes.addressof(box), ctypes.addressof(elem),
                     0, SWIZZLE_128B, L2_256B, 0)
        assert err == 0, err

    encode_once()
    noop = ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0)
    rows = {
        "ctypes call of a Python no-op (the probe's own overhead)": noop,
        "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)": lookup,
        "cuTensorMapEncodeTiled, bf16 4-d, 128B swizzle": encode_once,
        "torch.empty(1) on the GPU": lambda: torch.empty(1, device="cuda"),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cudart {loaded_library('libcudart.so')}")
    print("| host call | µs |\n|---|---|")
    for name, f in rows.items():
        print(f"| {name} | {median_us(f):.2f} |", flush=True)


if __name__ == "__main__":
    main()
