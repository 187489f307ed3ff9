"""Refit endpoints (docs/sglang-conformance.md, C-ROUTE-DISK/TENSOR/DIST/SESSION, C-REFIT-*):
disk/tensor/distributed updates, begin/end sessions by version, weight-update groups, /update_weight_version
and /weights_checker. Each returns (HTTP status, JSON body)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import time
from typing import Any

from rljob.emulator import fatal, rendezvous
from rljob.emulator.engine import Engine
from rljob.emulator.parameters import Loaded, Unseen, checkpoint_of
from rljob.emulator.tensor_refit import TensorRefit
from rljob.emulator.weights import LoadedWeights, WeightsLoadError, read_checkpoint
from rljob.trainer.engines.sglang.tensor_hash import hash_bytes, hex16

Reply = tuple[int, dict[str, Any]]

FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)


def _fail(message: str) -> Reply:
    return 400, {"success": False, "message": message}


def _session_required(route: str) -> Reply:
    return _fail(f"{route} must run between begin_weight_update() and end_weight_update()")


class WeightUpdater:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.session_open = False
        self.groups: set[str] = set()
        self._push_digest: Any = None  # sha256 over the pushes of the refit in progress
        self._push_tensors = 0
        self.tensor_pushes = TensorRefit(engine)  # reads (cuda: loads) update_weights_from_tensor pushes

    # --- disk ------------------------------------------------------------------------------------

    async def from_disk(self, body: dict[str, Any]) -> Reply:
        eng = self.engine
        eng.refuse_under_weight_cache("update_weights_from_disk")
        async with _WriterLock(eng, body.get("abort_all_requests", False)):
            eng.require_weights_mapped()
            started = time.monotonic()
            path = body["model_path"]
            try:
                cp = await asyncio.to_thread(read_checkpoint, path)
            except (WeightsLoadError, OSError) as e:
                return _fail(f"Failed to update weights: {e}. Rolling back to the original weights.")
            if eng.load_parameters(cp.tensors, replace=True, layout=checkpoint_of(path)):
                eng.weights = LoadedWeights("disk", path, cp.checksum, tensors=len(cp.tensors))
            eng.model_path = eng.served_model_name = path
            status, reply = self._finish(body, "disk", started, "Succeeded to update model weights.")
            reply["num_paused_requests"] = 0
            return status, reply

    # --- tensor / distributed --------------------------------------------------------------------

    async def from_tensor(self, body: dict[str, Any]) -> Reply:
        eng = self.engine
        if eng.profile.needs_weight_update_session and not self.session_open:
            return _fail(
                "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
            )
        eng.refuse_under_weight_cache("update_weights_from_tensor")
        async with _WriterLock(eng, body.get("abort_all_requests", False)):
            eng.require_weights_mapped()
            started = time.monotonic()
            try:
                payloads = [base64.b64decode(s, validate=True) for s in body["serialized_named_tensors"]]
            except (binascii.Error, ValueError) as e:
                # C-REFIT-TENSOR-B64: only 0.5.6 gets here; later versions refused the body (the route)
                fatal.scheduler_exception("binascii.Error", str(e))
            failure = self.tensor_pushes.apply(
                payloads, body.get("load_format"), final=body.get("weight_version") is not None
            )
            if failure is not None:
                return _fail(failure)
            # the model runner answers "Success" in every version: …/model_executor/model_runner.py:1266,1298
            # @0.5.6, model_runner.py:2187,2219@0.5.15.post1; …/model_executor/model_runner_components/
            # weight_updater.py:354,386@0.5.20, weight_updater.py:373,405@0.5.21, :381,413@0.5.23
            return self._finish(body, "tensor", started, "Success")

    async def from_distributed(self, body: dict[str, Any]) -> Reply:
        eng = self.engine
        if eng.profile.needs_weight_update_session and not self.session_open:
            return _session_required("update_weights_from_distributed")
        if body["group_name"] not in self.groups:
            unknown = (
                f"Group {body['group_name']} not in {sorted(self.groups)}. "
                "Please call `init_weights_update_group` first."
            )
            if eng.profile.distributed_unknown_group_is_fatal:  # C-REFIT-GROUP-UNKNOWN
                fatal.scheduler_exception("AssertionError", unknown)
            return _fail(f"Failed to receive weights: {unknown}")
        if not (len(body["names"]) == len(body["dtypes"]) == len(body["shapes"])):
            return _fail("names, dtypes and shapes must have the same length")
        eng.refuse_under_weight_cache("update_weights_from_distributed")
        async with _WriterLock(eng, body.get("abort_all_requests", False)):
            eng.require_weights_mapped()
            started = time.monotonic()
            # No NCCL here: the broadcast metadata stands in for the received tensors.
            meta = json.dumps([body["names"], body["dtypes"], body["shapes"]]).encode()
            received = [
                Loaded(n, tuple(shape), Unseen(json.dumps([n, d, shape]).encode()))
                for n, d, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True)
            ]
            if eng.load_parameters(received, replace=False):
                self._absorb("distributed", [meta], tensors=len(body["names"]))
            # model_runner.py:1195@0.5.6, model_runner.py:2116@0.5.15.post1,
            # …/model_executor/model_runner_components/weight_updater.py:275@0.5.20
            return self._finish(body, "distributed", started, "Succeeded to update parameter online.")

    def _absorb(self, source: str, payloads: list[bytes], tensors: int | None = None) -> None:
        if self._push_digest is None:
            self._push_digest, self._push_tensors = hashlib.sha256(), 0
        for p in payloads:
            self._push_digest.update(p)
        self._push_tensors += tensors if tensors is not None else len(payloads)
        self.engine.weights = LoadedWeights(
            source, f"<{source}>", self._push_digest.hexdigest(), tensors=self._push_tensors
        )

    def start_new_refit(self) -> None:
        """Called when weights are resumed or a session begins: later pushes make a new checkpoint."""
        self._push_digest = None
        self.tensor_pushes.reset()

    def _finish(self, body: dict[str, Any], source: str, started: float, message: str) -> Reply:
        eng = self.engine
        eng.weight_load_seconds[source] = time.monotonic() - started
        version = body.get("weight_version")
        if version is not None:
            self._push_digest = None  # the version marks the end of this refit's pushes
            eng.parameters.bind(version)  # what the emulator could not see is the trainer's at this version
        if eng.faults.refit_fail:
            return _fail(FLUSH_REFUSED)
        # C-REFIT-FLUSH-FAIL / C-REFIT-FLUSH-RETRACT: every DP rank flushes with the version's predicate
        if body.get("flush_cache", True) and not eng.post_refit_flush(eng.ranks):
            if eng.profile.refit_flush_failure_is_fatal:
                fatal.scheduler_exception("AssertionError", "Cache flush failed after updating weights")
            return _fail(FLUSH_REFUSED)
        # C-REFIT-WV-PAUSED: 0.5.6 returns before recording weight_version when the refit ran paused
        # (tokenizer_manager.py:1299-1316@0.5.6, tokenizer_communicator_mixin.py:418-436,479-495@0.5.6)
        records_version = eng.profile.refit_paused_sets_weight_version or not eng.tokenizer.is_pause
        if version is not None and records_version:
            eng.set_weight_version(version)
            message += f" Weight version updated to {version}."
        return 200, {"success": True, "message": message}

    # --- sessions and groups ---------------------------------------------------------------------

    def begin(self) -> Reply:
        if self.session_open:
            return _fail("a weight-update session is already open")
        self.session_open = True
        self.start_new_refit()
        return 200, {"success": True, "message": "weight-update session opened"}

    def end(self) -> Reply:
        if not self.session_open:
            return _fail("no weight-update session is open")
        self.session_open = False
        return 200, {"success": True, "message": "weight-update session closed"}

    async def init_group(self, body: dict[str, Any]) -> Reply:
        """C-REFIT-GROUP-BLOCK: every TP rank joins group rank 0's store (rendezvous.join) and the call
        answers only once all of them did (…/model_executor/model_runner_components/weight_updater.py:
        100-143@0.5.23, utils/common.py:1752-1790@0.5.6)."""
        eng = self.engine
        ranks = [body["rank_offset"] + tp_rank for tp_rank in range(eng.cfg.tp_size)]
        try:
            await rendezvous.join(
                body["master_address"],
                body["master_port"],
                ranks,
                body["world_size"],
                body["group_name"],
                timeout=eng.cfg.weight_update_group_timeout,
            )
        except rendezvous.RendezvousError as e:
            return _fail(f"Failed to initialize custom process group: {e}.")
        self.groups.add(body["group_name"])
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, body: dict[str, Any]) -> Reply:
        if body["group_name"] not in self.groups:
            return _fail("The group to be destroyed does not exist.")
        self.groups.remove(body["group_name"])
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    # --- version and checker ---------------------------------------------------------------------

    def update_weight_version(self, body: dict[str, Any]) -> Reply:
        if body.get("abort_all_requests", True):
            self.engine.abort(abort_all=True)
        self.engine.parameters.bind(body["new_version"])
        self.engine.set_weight_version(body["new_version"])
        v = body["new_version"]
        return 200, {"success": True, "message": f"Weight version updated to {v}", "new_version": v}

    def weights_checker(self, body: dict[str, Any]) -> Reply:
        """C-ROUTE-CHECKER, C-CHECKER-CHECKSUM, C-CHECKER-RELEASED: every DP rank's scheduler runs the action
        on its model (each TP rank's answer gathered on TP rank 0); an action the version does not know is an
        exception the scheduler catches: success false, 400. The reply: `success`, the ranks' messages joined
        with " | ", and for `checksum` one entry per GPU and the sha256 over their per-GPU checksums."""
        eng = self.engine
        action = str(body.get("action", "checksum"))
        dp = eng.cfg.dp_size
        if (
            action not in eng.profile.checker_actions
        ):  # utils/weight_checker.py:19-28@0.5.6, :71-84@0.5.15.post1
            return 400, {"success": False, "message": " | ".join([f"Unsupported action={action!r}"] * dp)}
        eng.require_weights_mapped()  # every action reads the parameters' memory
        message = " | ".join(["Success."] * dp)
        if action != "checksum":
            return 200, {"success": True, "message": message}
        ranks = checksum_ranks(eng)
        per_engine = hashlib.sha256()
        for (
            rank
        ) in ranks:  # the order the ranks' answers arrived in (managers/tokenizer_control_mixin.py:762-770)
            per_engine.update(rank["per_gpu_checksum"].encode())
        return 200, {
            "success": True,
            "message": message,
            "ranks": ranks,
            "per_engine_checksum": per_engine.hexdigest(),
        }


def checksum_ranks(eng: Engine) -> list[dict[str, Any]]:
    """One `ChecksumInfo` per GPU (utils/weight_checker.py:120-170@0.5.15.post1): each parameter's hash, the
    sha256 over sorted (name, hash), and the GPU's place (`parallelism_info`, a list of one per role from
    0.5.21: managers/io_struct.py:2128-2145@0.5.21). With TP > 1 a rank's hashes stand for its shard's (one
    process holds the whole model here): the whole parameter's hash, rehashed with the rank."""
    hashes = eng.parameters.hashes(eng.weight_version)
    tp, dp = eng.cfg.tp_size, eng.cfg.dp_size
    ranks = []
    for dp_rank in range(dp):
        for tp_rank in range(tp):
            checksums = (
                hashes
                if tp == 1
                else {n: hex16(hash_bytes(f"{h}:{tp_rank}".encode())) for n, h in hashes.items()}
            )
            h = hashlib.sha256()
            for name in sorted(checksums):
                h.update(name.encode())
                h.update(checksums[name].encode())
            info: dict[str, Any] = {
                "tp_rank": tp_rank, "tp_size": tp, "dp_rank": dp_rank, "dp_size": dp,
                "pp_rank": 0, "pp_size": 1, "rank": dp_rank * tp + tp_rank, "size": dp * tp,
            }  # fmt: skip
            place: Any = [{"role": "target", **info}] if eng.profile.checker_roles else info
            ranks.append(
                {"checksums": checksums, "per_gpu_checksum": h.hexdigest(), "parallelism_info": place}
            )
    return ranks


class _WriterLock:
    """Refits while paused skip the lock; otherwise they wait for every in-flight request (§2.4)."""

    def __init__(self, engine: Engine, abort_all: bool) -> None:
        self.engine = engine
        self.tok = engine.tokenizer
        self.abort_all = abort_all
        self.taken = False

    async def __aenter__(self) -> None:
        async with self.tok.pause_cond:  # reads is_pause under is_pause_cond (C-DRAIN-TIMING)
            paused = self.tok.is_pause
        if not paused:
            await self.tok.writer_lock_acquire(self._abort_all if self.abort_all else None)
            self.taken = True

    async def __aexit__(self, *exc: object) -> None:
        if self.taken:
            await self.tok.writer_lock_release()

    def _abort_all(self) -> None:
        self.engine.abort(abort_all=True)
