"""GPU-backed regions for the SGLang emulator (`--memory-backend cuda`).

kv_cache, weights and cuda_graph are real CUDA allocations made inside `torch_memory_saver.region(tag=...)`,
as SGLang makes them (`--enable-memory-saver`; cuda_graph only with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1, and
with CPU backup, as SGLang captures graphs). Release is `torch_memory_saver.pause(tag)`: the physical memory
is unmapped and NVML sees it come back. Resume is `resume(tag)`: new physical memory at the same addresses,
so without CPU backup the contents are garbage (weights; docs/sglang-conformance.md,
C-MEM-RELEASE-ORDER) and a refit must follow; a disk refit copies the safetensors bytes into the weights
region and the checksum the emulator then serves is
computed over what the GPU holds, read back. A tensor refit (`tensor_refit.py`) copies each pushed bucket
from the trainer's memory (CUDA IPC) into the weights region (`write_weights`); its checksum is computed on
the GPU (`weights_checksum`), when first asked for or at the latest before the region is released.

Every torch_memory_saver call is timed alone (devices synchronised before and after) and logged as one line
`tms {json}`: the floor the agent's phase times are compared with. A delayed unmap (fault
`release_unmap_delay_s`) answers at once and pauses the region from a thread after the delay, as a rank that
is still freeing memory when rank 0 replied.

torch and torch_memory_saver are imported here only, and this module only for `--memory-backend cuda`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from rljob.emulator.memory import REGIONS
from rljob.emulator.weights import WeightsLoadError, set_weights_sink

log = logging.getLogger("sglang.emulator")

PROBE_BYTES = 16 << 20  # hashed to tell whether a region's contents survived pause/resume
# SGLang loads the model, sizes the KV pool from what is left, then captures graphs.
ALLOC_ORDER = ("weights", "kv_cache", "cuda_graph")
REEXEC_ENV = "RLJOB_EMULATOR_TMS_REEXEC"


def preload_library() -> str:
    """The torch_memory_saver hook library for this torch's CUDA major (what SGLang puts in LD_PRELOAD)."""
    from torch_memory_saver.utils import get_binary_path_from_package

    return str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))


def preload_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the hook library in LD_PRELOAD."""
    env = dict(os.environ if base is None else base)
    current = env.get("LD_PRELOAD", "")
    if "torch_memory_saver" not in current:
        lib = preload_library()
        env["LD_PRELOAD"] = f"{lib}:{current}" if current else lib
    return env


def _ensure_preload() -> None:
    """Preload mode needs the hook in LD_PRELOAD at process start. The emulator program re-executes itself
    with it (once); anything else gets the exact variable to set."""
    if "torch_memory_saver" in os.environ.get("LD_PRELOAD", ""):
        return
    program = sys.argv[0].replace(os.sep, "/") if sys.argv else ""
    if not program.endswith("rljob/emulator/__main__.py") or os.environ.get(REEXEC_ENV):
        raise RuntimeError(
            "torch_memory_saver hook mode 'preload' needs LD_PRELOAD="
            f"{preload_library()} at process start (or --memory-saver-hook-mode torch)"
        )
    env = preload_env()
    env[REEXEC_ENV] = "1"
    log.info("re-executing with LD_PRELOAD=%s (torch_memory_saver preload hook)", env["LD_PRELOAD"])
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


class CudaRegionBackend:
    """`RegionBackend` over real GPUs 0..gpus-1 of this process. Sizes are per GPU."""

    def __init__(
        self,
        *,
        gpus: int,
        sizes: dict[str, int],
        memory_saver: bool = True,
        graph_in_saver: bool = False,
        hook_mode: str = "preload",
    ) -> None:
        if memory_saver and hook_mode == "preload":
            _ensure_preload()
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
            raise RuntimeError(
                f"--memory-backend cuda needs {gpus} CUDA device(s); torch sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
            )
        self._torch: Any = torch
        self.gpus = gpus
        self.sizes = {r: int(sizes.get(r, 0)) for r in REGIONS}
        # Which regions torch_memory_saver manages; the others are plain allocations that never move.
        self._saved = {r: memory_saver and (r != "cuda_graph" or graph_in_saver) for r in REGIONS}
        self._tms: Any = None
        if memory_saver:
            from torch_memory_saver import torch_memory_saver

            torch_memory_saver.hook_mode = hook_mode  # before its first use
            self._tms = torch_memory_saver
        self.hook_mode = hook_mode
        self._lock = threading.Lock()
        self._tms_lock = threading.Lock()  # delayed unmaps run in threads: one TMS call at a time
        self._paused = dict.fromkeys(REGIONS, False)  # what the engine asked for
        self._unmapped = dict.fromkeys(REGIONS, False)  # what the GPU has: set once pause really ran
        self._pending: dict[str, threading.Thread] = {}
        self._probe: dict[str, str | None] = dict.fromkeys(REGIONS)
        self._checksums: dict[int, str] = {}  # weights_checksum by byte count, for the current contents
        self._checksum_due: int | None = None  # tensor pushes wrote this many bytes; not yet checksummed
        self.timings: list[dict[str, Any]] = []
        started = time.perf_counter()
        self._tensors: dict[str, list[Any]] = {
            r: [self._allocate(r, g) for g in range(gpus)] for r in ALLOC_ORDER
        }
        self._sync()
        self._event("allocate", None, time.perf_counter() - started, bytes=sum(self.sizes.values()) * gpus)
        if self.sizes["cuda_graph"]:
            self._probe["cuda_graph"] = self._digest("cuda_graph")
        set_weights_sink(self._load_weights)

    # --- allocation and helpers ------------------------------------------------------------------

    def _allocate(self, region: str, gpu: int) -> Any:
        torch = self._torch
        size = self.sizes[region]
        device = torch.device("cuda", gpu)
        with torch.cuda.device(gpu):
            if self._saved[region] and size:
                # SGLang captures graphs with CPU backup; weights and KV have none.
                with self._tms.region(tag=region, enable_cpu_backup=region == "cuda_graph"):
                    t = torch.empty(size, dtype=torch.uint8, device=device)
            else:
                t = torch.empty(size, dtype=torch.uint8, device=device)
            if region == "cuda_graph" and size:
                n = min(size, PROBE_BYTES)
                t[:n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device=device))
        return t

    def _sync(self) -> None:
        for g in range(self.gpus):
            self._torch.cuda.synchronize(g)

    def _digest(self, region: str, gpu: int = 0) -> str:
        """Checksum of the region's first PROBE_BYTES, computed on the GPU: a readback and sha256 of them
        cost ~25 ms inside the resume call the agent times, which SGLang does not spend."""
        from rljob.emulator.tensor_refit import device_checksum

        t = self._tensors[region][gpu]
        return device_checksum([t[: min(t.numel(), PROBE_BYTES)]])

    def log_event(self, op: str, tag: str | None, seconds: float, **fields: Any) -> None:
        self._event(op, tag, seconds, **fields)

    def _event(self, op: str, tag: str | None, seconds: float, **fields: Any) -> None:
        rec = {"op": op, "tag": tag, "seconds": round(seconds, 6), "at": round(time.time(), 6), **fields}
        self.timings.append(rec)
        log.info("tms %s", json.dumps(rec))

    # --- busy GPUs for NVML -----------------------------------------------------------------------

    def drive_busy(self, busy_seconds: Callable[[int], float], tick_s: float = 0.02) -> None:
        """Keep each GPU as busy as the emulated decode says (`busy_seconds(gpu)`, cumulative), so that
        NVML's utilization, which the agent's nvml probe reads, sees it: every tick, one spin kernel
        (torch.cuda._sleep) per GPU for the busy time the emulated tokens cost during the previous tick.
        The kernel touches no memory, so released regions stay untouched; each tick waits for its kernels,
        so a synchronize elsewhere (a release's) waits at most one tick."""
        thread = threading.Thread(
            target=self._busy_loop, args=(busy_seconds, tick_s), name="gpu-busy", daemon=True
        )
        thread.start()

    def _spin_cycles_per_second(self) -> float:
        torch = self._torch
        with torch.cuda.device(0):
            torch.cuda._sleep(1_000_000)  # warm up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cycles = 50_000_000
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            return cycles / max(1e-6, start.elapsed_time(end) / 1000.0)

    def _busy_loop(self, busy_seconds: Callable[[int], float], tick_s: float) -> None:
        torch = self._torch
        rate = self._spin_cycles_per_second()
        log.info("gpu-busy: spin kernel at %.3g cycles/s, tick %.0f ms", rate, tick_s * 1000)
        rates = [rate] * self.gpus  # per GPU, corrected from each tick's timed kernel (clocks change)
        streams = [torch.cuda.Stream(device=g) for g in range(self.gpus)]
        last = [busy_seconds(g) for g in range(self.gpus)]
        while True:
            started = time.monotonic()
            timed: list[tuple[int, int, Any, Any]] = []
            for g, stream in enumerate(streams):
                now = busy_seconds(g)
                owed, last[g] = min(now - last[g], tick_s), now
                cycles = int(owed * rates[g])
                if cycles <= 0:
                    continue
                with torch.cuda.device(g), torch.cuda.stream(stream):
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record(stream)
                    torch.cuda._sleep(cycles)
                    end.record(stream)
                timed.append((g, cycles, begin, end))
            for g, cycles, begin, end in timed:
                end.synchronize()
                took = begin.elapsed_time(end) / 1000.0
                if took > 0.002:  # long enough to measure: follow the clock
                    rates[g] = 0.7 * rates[g] + 0.3 * cycles / took
            time.sleep(max(0.0, tick_s - (time.monotonic() - started)))

    # --- RegionBackend ---------------------------------------------------------------------------

    def pause(self, region: str, *, unmap_delay_s: float = 0.0) -> None:
        if region == "weights" and self._checksum_due is not None and not self._unmapped["weights"]:
            self.weights_checksum(self._checksum_due)  # the evidence must be read while it is there
        with self._lock:
            self._paused[region] = True
            if not self._saved[region] or not self.sizes[region]:
                return  # not in a torch_memory_saver region: stays resident (SGLang without the saver)
            if unmap_delay_s > 0:
                th = threading.Thread(
                    target=self._delayed_pause, args=(region, unmap_delay_s), name=f"unmap-{region}"
                )
                th.daemon = True
                self._pending[region] = th
                th.start()
                self._event("pause_deferred", region, 0.0, delay=unmap_delay_s)
                return
        self._do_pause(region)

    def _delayed_pause(self, region: str, delay: float) -> None:
        time.sleep(delay)
        self._do_pause(region, delay)

    def _do_pause(self, region: str, delay: float = 0.0) -> None:
        with self._tms_lock:
            self._sync()  # also makes the CUDA context current in a delayed-unmap thread
            started = time.perf_counter()
            self._tms.pause(region)
            self._sync()
            seconds = time.perf_counter() - started
        self._unmapped[region] = True
        self._event("pause", region, seconds, bytes=self.sizes[region] * self.gpus, delay=delay)

    def resume(self, region: str) -> None:
        with self._lock:
            pending = self._pending.pop(region, None)
        if pending is not None:
            pending.join()  # a delayed unmap still to come: let it happen, then map again
        if not self._unmapped[region]:
            self._paused[region] = False
            return
        with self._tms_lock:
            self._sync()
            started = time.perf_counter()
            self._tms.resume(region)
            self._sync()
            seconds = time.perf_counter() - started
        self._unmapped[region] = False
        self._paused[region] = False
        kept = None
        if self._probe[region] is not None:
            kept = self._digest(region) == self._probe[region]
        self._event("resume", region, seconds, bytes=self.sizes[region] * self.gpus, contents_kept=kept)

    def is_paused(self, region: str) -> bool:
        return self._paused[region]

    def resume_fits(self, regions: list[str]) -> bool:
        return True  # the driver answers: torch_memory_saver exits the scheduler where it cannot map

    def used_bytes(self, gpu: int) -> int:
        free, total = self._torch.cuda.mem_get_info(gpu)
        return int(total - free)

    def total_bytes(self, gpu: int) -> int:
        return int(self._torch.cuda.mem_get_info(gpu)[1])

    def region_bytes(self, gpu: int) -> dict[str, int]:
        return {r: 0 if self._unmapped[r] else self.sizes[r] for r in REGIONS}

    # --- disk loads (launch and update_weights_from_disk) -----------------------------------------

    def _load_weights(self, blobs: list[bytes]) -> Iterator[Any]:
        """Copy the files' bytes to the start of the weights region on every GPU; yield GPU 0's copy read
        back (what gets hashed). Raises WeightsLoadError when they do not fit or the region is released."""
        torch = self._torch
        total = sum(len(b) for b in blobs)
        if total > self.sizes["weights"]:
            raise WeightsLoadError(
                f"checkpoint of {total} bytes does not fit the weights region ({self.sizes['weights']} bytes)"
            )
        if self._paused["weights"] or self._unmapped["weights"]:
            raise WeightsLoadError("the weights region is released")
        started = time.perf_counter()
        for g in range(self.gpus):
            dst, off = self._tensors["weights"][g], 0
            for b in blobs:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only bytes: only read here
                    src = torch.frombuffer(b, dtype=torch.uint8)
                dst[off : off + len(b)].copy_(src)
                off += len(b)
        self._sync()
        copy_s = time.perf_counter() - started
        started = time.perf_counter()
        back = self._tensors["weights"][0][:total].cpu()
        for g in range(1, self.gpus):
            if not torch.equal(self._tensors["weights"][g][:total].cpu(), back):
                raise WeightsLoadError(f"GPU {g} holds other bytes than GPU 0 after the load")
        readback_s = time.perf_counter() - started
        self._probe["weights"] = self._digest("weights")
        self._checksums.clear()
        self._checksum_due = None
        self._event("weights_load", "weights", copy_s, bytes=total, readback_seconds=round(readback_s, 6))
        return self._timed_hash(back.numpy(), [len(b) for b in blobs])

    def _timed_hash(self, arr: Any, lengths: list[int]) -> Iterator[Any]:
        """Yields the read-back bytes file by file; the caller hashes between yields, which is timed."""
        started, off = time.perf_counter(), 0
        for n in lengths:
            yield arr[off : off + n]
            off += n
        self._event("weights_hash", "weights", time.perf_counter() - started, bytes=off)

    # --- tensor refits (tensor_refit.py) ---------------------------------------------------------

    def write_weights(self, gpu: int, offset: int, sources: list[Any]) -> int:
        """Copy the bytes of `sources` (CUDA tensors, e.g. opened from IPC handles) one after the other into
        GPU `gpu`'s weights region from `offset`; returns the bytes written once the copies finished."""
        torch = self._torch
        if self._paused["weights"] or self._unmapped["weights"]:
            raise WeightsLoadError("the weights region is released")
        dst = self._tensors["weights"][gpu]
        total = sum(int(s.numel()) * s.element_size() for s in sources)
        if offset + total > self.sizes["weights"]:
            raise WeightsLoadError(
                f"pushed tensors reach byte {offset + total} of the weights region "
                f"({self.sizes['weights']} bytes)"
            )
        at = offset
        with torch.cuda.device(gpu):
            for s in sources:
                src = s.reshape(-1).view(torch.uint8)  # a copy only for a non-contiguous tensor
                n = int(src.numel())
                dst[at : at + n].copy_(src)
                at += n
            torch.cuda.synchronize(gpu)
        if offset < PROBE_BYTES:
            self._probe["weights"] = None  # known again when the checksum is computed
        self._checksums.clear()
        return total

    def weights_view(self, gpu: int, start: int, end: int) -> Any:
        """Bytes `start` to `end` of GPU `gpu`'s weights region (what a pushed parameter holds, hashed on the
        GPU when /weights_checker asks: parameters.py). The next refit's pushes write the region again from
        its start."""
        return self._tensors["weights"][gpu][start:end]

    def checksum_due(self, nbytes: int) -> None:
        self._checksum_due = nbytes

    def weights_checksum(self, nbytes: int) -> str:
        """`tensor_refit.device_checksum` of the first `nbytes` of GPU 0's weights region, computed on the
        GPU (timed, logged as `weights_checksum`); also records the contents probe for the next resume."""
        from rljob.emulator.tensor_refit import device_checksum

        if nbytes in self._checksums:
            return self._checksums[nbytes]
        if self._unmapped["weights"]:
            raise WeightsLoadError("the weights region is released: its checksum is gone")
        self._sync()
        started = time.perf_counter()
        value = device_checksum([self._tensors["weights"][0][:nbytes]])
        seconds = time.perf_counter() - started
        self._checksums[nbytes] = value
        if self._checksum_due == nbytes:
            self._checksum_due = None
        self._probe["weights"] = self._digest("weights")
        self._event("weights_checksum", "weights", seconds, bytes=nbytes, checksum=value)
        return value
