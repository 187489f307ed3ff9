"""The trainer side of the GPU handoff.

handoff = Handoff()
with handoff.train(timeout=3600) as lease:   # asks for the GPU, returns once the agent granted it
    ...                                      # train: the GPU memory the engine released is yours
    lease.publish(version, path)             # hands the GPU back with the new weights' version

handoff.report_rollout(samples=256)          # before train(): the samples this rollout generated,
                                             # the job's cost per rollout (status) divides by them

with handoff.refit_window(timeout=600) as window:  # tensor/distributed refit only
    window.push_tensors([...])                     # forwarded to the engine by the agent

Distributed (NCCL) refit: the engine's side of the weight-update group joins the trainer's rendezvous, so
`init_group` only starts it and returns; the trainer then creates its own process group as rank 0 and
waits for the engine to be in it:

with handoff.refit_window(timeout=600) as window:
    window.init_group(addr, port, rank_offset=1, world_size=1 + engine_tp_size)  # returns at once
    group = init_process_group(backend="nccl", init_method=f"tcp://{addr}:{port}", rank=0, ...)
    window.wait_group(timeout=600)                 # the engine joined (raises if its side failed)
    window.push_distributed(names, dtypes, shapes) # then broadcast the tensors over `group`
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rljob.trainer.client import AgentClient, AgentError, AgentUnavailable
from rljob.trainer.engines import UpdateCodec, update_codec
from rljob.trainer.engines import digest as codec_digest
from rljob.trainer.engines import packing as codec_packing

POLL_S = 25.0  # each long-poll; the agent caps waits at 30 s


class LeaseError(RuntimeError):
    pass


@dataclass
class Lease:
    """The GPU lease: valid until `publish` (or until the `train()` block exits)."""

    _client: AgentClient
    epoch: int | None
    published: str | None = None
    by_local_rank_0: bool = False  # another process of this pod (LOCAL_RANK 0) publishes for the pod

    def publish(
        self, version: str, path: str | None = None, digest: codec_digest.Digest | None = None
    ) -> None:
        """`digest`: what the engine must hold once it loaded `path` (rljob.trainer.engines.digest's
        checkpoint_digest, or digest_named_tensors of the tensors saved there); the agent holds the engine's
        checksum against it after
        the refit. Without one the weights are not verified against the trainer (the status says so)."""
        if self.published is not None:
            raise LeaseError(f"already published {self.published}: a lease publishes once")
        if self.by_local_rank_0:
            self.published = str(version)  # the pod's one publish is LOCAL_RANK 0's
            return
        body: dict[str, Any] = {"version": str(version)}
        if path is not None:
            body["path"] = str(path)
        if digest is not None:
            body["digest"] = digest.wire()
        self._client.call("POST", "/v1/trainer/publish", body)
        self.published = str(version)


@dataclass
class _Held:
    path: str
    body: dict[str, Any]
    report: codec_packing.PushReport | None = None
    keepalive: Any = None  # a bucket buffer: referenced until the engine answered its push


@dataclass
class RefitSession:
    """A tensor/distributed refit window. The final push must carry the version, so each push is held
    back until the next one (or the end of the window) shows whether it was the last."""

    _client: AgentClient
    version: str
    source: str
    _buffers: Callable[[], codec_packing.BucketBuffers] | None = field(default=None, repr=False)
    pushes: int = 0
    _held: _Held | None = field(default=None, repr=False)
    _group_pending: bool = field(default=False, repr=False)  # init_group sent, the engine not in it yet
    architectures: list[str] = field(default_factory=list)  # the engine's (the window says): the digest's
    engine: str | None = None  # the engine the pushes go to (the window says): the form they are packed in
    digest: codec_digest.Digest | None = field(
        default=None, repr=False
    )  # of this window's pushes, sent when it closes
    _unseen: str | None = field(default=None, repr=False)  # why some push is not in the digest
    _by_hand: str | None = field(default=None, repr=False)  # pushes whose tensors the SDK cannot see
    _given: bool = field(default=False, repr=False)  # add_digest was called for them
    _hashing: list[tuple[codec_digest.PendingDigest, codec_packing.PushReport]] = field(
        default_factory=list, repr=False
    )

    def add_digest(self, digest: codec_digest.Digest) -> None:
        """The digest of tensors pushed by hand (push_tensors, push_distributed), e.g. digest_named_tensors
        of the tensors serialized: sent with the window's close, with push_named_tensors' own."""
        self._given = True
        self._merge(digest)

    def _merge(self, digest: codec_digest.Digest) -> None:
        if self.digest is None:
            self.digest = codec_digest.Digest()
        self.digest.merge(digest)

    def push_tensors(self, serialized_named_tensors: list[str], load_format: str | None = None) -> None:
        """One bucket: one serialized payload per TP rank, in the format the engine reads (base64). The
        SDK cannot see its tensors: give their digest with `add_digest`, or the weights are not verified
        against the trainer."""
        self._by_hand = self._by_hand or "pushes serialized by hand (push_tensors) without add_digest"
        body: dict[str, Any] = {"serializedNamedTensors": list(serialized_named_tensors)}
        if load_format is not None:
            body["loadFormat"] = load_format
        self._hold(_Held("/v1/trainer/refit/tensor", body))

    def push_update(self, update_info: dict[str, Any]) -> None:
        """One bucket in the form of an engine that takes update objects (its names, dtypes, shapes, sizes
        and IPC handles: trainer/engines/<name>/packing.py), built by hand: give its digest with
        `add_digest`, or the weights are not verified against the trainer."""
        self._by_hand = self._by_hand or "updates built by hand (push_update) without add_digest"
        self._hold(_Held("/v1/trainer/refit/tensor", {"updateInfo": dict(update_info)}))

    def push_named_tensors(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        bucket_bytes: int | None = None,
        tp_size: int = 1,
        digest: bool = True,
        config: Any = None,
    ) -> codec_packing.PushReport:
        """Push CUDA tensors, e.g. `model.state_dict().items()`: packed into flat buckets of at most
        `bucket_bytes` (default 2 GiB; one dtype per bucket), one payload per TP rank in the format the
        engine reads (rljob.trainer.engines.packing), sent one bucket at a
        time through the agent, each packed while the previous one is in flight. The buckets are a ring of
        buffers per device (2 with TP=1, else 3) kept by the Handoff and reused by every later refit
        (`Handoff.free_refit_buffers()` gives them back). The tensors may be changed or
        freed once this returns; the last bucket goes out, with the version, when the window closes.
        Needs torch (imported here only). The returned report's `send_seconds` completes at that point.

        With `digest` (default) the tensors are hashed as the engine's weights checksum will hash them
        (rljob.trainer.engines.digest): on a side CUDA stream, started here after the work queued on the
        current stream, while the buckets are packed and sent; work queued on the current stream after this
        returns runs after the hash; the window's close waits for it and carries the digest (the agent holds
        what the engine holds against it; `report.digest_seconds`, complete then: starting it and waiting for
        it). `config`: the model's (`model.config`, or its config.json dict) for its architecture and tied
        embeddings; by default the engine's architecture as the agent reports it, and embeddings tied when
        embed_tokens and lm_head share their storage."""
        if self._buffers is None:
            raise LeaseError("this refit session has no bucket buffers (open it with Handoff.refit_window)")
        if self.source != "tensor":
            raise LeaseError(f"the open refit window takes {self.source} pushes, not tensors")
        codec = update_codec(self.engine)
        if codec is not None:
            return self._push_updates(codec, named_tensors, bucket_bytes, digest, config)
        size = bucket_bytes or codec_packing.DEFAULT_BUCKET_BYTES
        named, plans = codec_packing.prepare(named_tensors, size, tp_size)
        buffers, report = self._buffers(), codec_packing.PushReport()
        hashing = None
        if digest:
            hashing = self._start_digest(named, config)
            report.digest_seconds += hashing.seconds
            self._hashing.append((hashing, report))
        else:
            self._unseen = self._unseen or "push_named_tensors(digest=False)"
        try:
            self._push_buckets(named, plans, buffers, size, tp_size, report)
        finally:
            if hashing is not None:
                hashing.release()  # the caller may change the tensors once this returns
        return report

    def _push_updates(
        self,
        codec: UpdateCodec,
        named_tensors: Iterable[tuple[str, Any]],
        bucket_bytes: int | None,
        digest: bool,
        config: Any,
    ) -> codec_packing.PushReport:
        """An engine that takes one update object per bucket (trainer/engines UpdateCodec): its digest from
        a CPU copy of the tensors (the engine's checksum hashes one), then each bucket packed and pushed; a
        bucket's buffer is kept until its push answered (the last one until the window closes)."""
        named = list(named_tensors)
        report = codec_packing.PushReport()
        if digest:
            if config is not None:
                layout = codec.layout_from_config(config)
            else:
                layout = codec.layout(self.architectures[0] if self.architectures else None, _tied(named))
            d = codec.digest_named_tensors(named, layout)
            report.digest_seconds += d.seconds
            self._merge(d)
        else:
            self._unseen = self._unseen or "push_named_tensors(digest=False)"
        for bucket in codec.buckets(named, bucket_bytes or codec.default_bucket_bytes):
            self._hold(_Held("/v1/trainer/refit/tensor", {"updateInfo": bucket.info}, report, bucket.buffer))
        return report

    def _push_buckets(
        self,
        named: list[tuple[str, Any]],
        plans: list[codec_packing.BucketPlan],
        buffers: codec_packing.BucketBuffers,
        size: int,
        tp_size: int,
        report: codec_packing.PushReport,
    ) -> None:
        # Bucket k is packed and serialized while push k-1 is in flight: the sender thread waits on the
        # agent and the engine meanwhile. The ring of buffers makes that safe (packing module docstring).
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rljob-refit-push") as sender:
            for plan in plans:
                in_flight = None
                if self._held is not None:  # another bucket follows: the held push is not the last
                    held, self._held = self._held, None
                    in_flight = sender.submit(self._post, held, False)
                try:
                    bucket = codec_packing.pack_and_serialize(named, plan, buffers, size, tp_size, report)
                finally:
                    if in_flight is not None:
                        in_flight.result()  # its error first: the engine's answer says more than ours
                body = {"serializedNamedTensors": bucket.payloads, "loadFormat": codec_packing.LOAD_FORMAT}
                self._held = _Held("/v1/trainer/refit/tensor", body, report, bucket.buffer)

    def _start_digest(self, named: list[tuple[str, Any]], config: Any) -> codec_digest.PendingDigest:
        if config is not None:
            layout = codec_digest.ModelLayout.from_config(config)
        else:
            tied = _tied(named)
            layout = codec_digest.ModelLayout(self.architectures[0] if self.architectures else None, tied)
        return codec_digest.start_digest_named_tensors(named, layout)

    def _join_digests(self) -> None:
        """The hashes push_named_tensors started, waited for (one sync per device each) and merged; one
        that failed makes the digest unavailable, saying why (the window still closes)."""
        hashing, self._hashing = self._hashing, []
        for pending, report in hashing:
            waited = time.perf_counter()
            try:
                d = pending.result()
            except Exception as e:
                d = codec_digest.Digest(
                    unavailable=f"hashing the pushed tensors failed: {e.__class__.__name__}: {e}"
                )
            report.digest_seconds += time.perf_counter() - waited
            self._merge(d)

    def push_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
    ) -> None:
        """Metadata of one NCCL broadcast; the trainer sends the tensors itself as group rank 0. Waits for
        a group started by `init_group` first."""
        if self._group_pending:
            self.wait_group()
        self._by_hand = self._by_hand or "distributed pushes without add_digest"
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "groupName": group_name}
        self._hold(_Held("/v1/trainer/refit/distributed", body))

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Start the engine's join of the weights group and return at once. The engine's ranks join the
        rendezvous that the trainer hosts as group rank 0 at master_address:master_port, so its reply comes
        only after the trainer's own init_process_group; call that next, then `wait_group`."""
        self._client.call(
            "POST",
            "/v1/trainer/refit/group",
            {
                "masterAddress": master_address,
                "masterPort": master_port,
                "rankOffset": rank_offset,
                "worldSize": world_size,
                "groupName": group_name,
                "backend": backend,
            },
        )
        self._group_pending = True

    def wait_group(self, timeout: float | None = None) -> None:
        """Block until the engine's side of the group is up; LeaseError if it failed or the window closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"the engine did not join the weight-update group within {timeout}s")
            window = self._client.call("GET", "/v1/trainer/refit", query={"wait": f"{max(0.1, left):g}"})
            if not window.get("open"):
                self._group_pending = False
                raise LeaseError("the refit window closed while the weight-update group was pending")
            group = window.get("group")
            if group == "Ready":
                self._group_pending = False
                return
            if group == "Failed":
                self._group_pending = False
                raise LeaseError(
                    f"the engine could not join the weight-update group: {window.get('groupError')}"
                )

    def _hold(self, held: _Held) -> None:
        self._send_held(last=False)
        self._held = held

    def _send_held(self, *, last: bool) -> None:
        held = self._held
        if held is None:
            return
        self._held = None
        self._post(held, last)

    def _post(self, held: _Held, last: bool) -> None:
        started = time.perf_counter()
        self._client.call("POST", held.path, {**held.body, "last": last})
        if held.report is not None:
            held.report.send_seconds.append(time.perf_counter() - started)
        self.pushes += 1

    def _finish(self) -> None:
        if self._held is None:
            raise LeaseError("the refit window closed without any push: nothing carries the version")
        self._send_held(last=True)

    def close_body(self) -> dict[str, Any]:
        """The window's close: its pushes' digest (waited for here), or why there is none."""
        self._join_digests()
        why = self._unseen or (self._by_hand if not self._given else None)
        if self.digest is not None and (why is None or self.digest.unavailable):
            return {"digest": self.digest.wire()}
        why = why or "no digest of the pushed tensors"
        return {"digest": {"unavailable": f"the trainer's pushes are not all in its digest: {why}"}}


def _tied(named: list[tuple[str, Any]]) -> bool:
    """embed_tokens and lm_head share their storage (tied embeddings)."""
    tensors = dict(named)
    embed, head = tensors.get("model.embed_tokens.weight"), tensors.get("lm_head.weight")
    return embed is not None and head is not None and embed.data_ptr() == head.data_ptr()


class Handoff:
    """One per trainer process. Under torchrun with several processes per pod (spec.trainer.processesPerPod,
    LOCAL_RANK set), every rank may use `train()`: LOCAL_RANK 0 makes the pod's one lease request and its
    one publish; the other ranks wait until the agent shows the lease granted (or already returned by
    rank 0's publish) and their `publish` only records the version. They must enter `train()` before rank 0
    publishes, which a training step's collectives ensure."""

    def __init__(self, agent_url: str | None = None, local_rank: int | None = None) -> None:
        self.client = AgentClient(agent_url)
        self._bucket_buffers: codec_packing.BucketBuffers | None = None
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank

    def _buffers(self) -> codec_packing.BucketBuffers:
        if self._bucket_buffers is None:
            self._bucket_buffers = codec_packing.BucketBuffers()
        return self._bucket_buffers

    def free_refit_buffers(self) -> int:
        """Give back the bucket buffers push_named_tensors keeps between refits (the next refit allocates
        them again, and its handles are new: a cold refit). Returns the bytes freed."""
        if self._bucket_buffers is None:
            return 0
        freed = self._bucket_buffers.nbytes
        self._bucket_buffers.free()
        return freed

    def state(self, since: int | None = None, wait: float = 0.0, stage: str | None = None) -> dict[str, Any]:
        """The agent's state (camelCase AgentState); long-polls past revision `since` when `wait` > 0, and
        with `stage` until a revision in that stage (or Failed)."""
        polls = since is not None and wait > 0
        query = {"since": since, "wait": f"{wait:g}", "stage": stage} if polls else None
        return dict(self.client.call("GET", "/v1/trainer/state", query=query))

    def wait_for_stage(self, stage: str, timeout: float | None = None) -> dict[str, Any]:
        """Block until the agent reports `stage` (e.g. "Serving"); raises on Failed or timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        st = self._first_state(deadline)
        while st["stage"] != stage:
            if st["stage"] == "Failed":
                raise LeaseError(f"agent failed: {st.get('fatal')}")
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"agent stage is {st['stage']}, not {stage}, after {timeout}s")
            # Answered in `stage` (or Failed), not on each revision on the way: an agent of an older image
            # ignores `stage` and answers each, which the loop reads as before.
            st = self.state(since=st["revision"], wait=left, stage=stage)
        return st

    def _first_state(self, deadline: float | None) -> dict[str, Any]:
        """Containers of a pod start in any order: wait for the agent to listen, not just fail."""
        while True:
            try:
                return self.state()
            except AgentUnavailable:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def report_rollout(self, samples: int) -> None:
        """Count `samples` completed samples (generations kept for training) in this rollout. Call it
        before `train()`: the operator reads the count as the drain starts, for the cost per rollout
        (the iteration's GPU-seconds divided by the samples, docs/profiling.md). Calls add up."""
        self.client.call("POST", "/v1/trainer/rollout", {"samples": int(samples)})

    @contextmanager
    def train(self, timeout: float | None = None) -> Iterator[Lease]:
        """Ask for the GPU, wait for the lease, yield it. Leaving without `publish` returns the lease as
        abandoned (the agent records why) and raises. On a rank other than LOCAL_RANK 0: no request, no
        publish, no abandon (rank 0's); it waits for the pod's lease and yields it."""
        if self.local_rank != 0:
            yield Lease(self.client, self._wait_pods_lease(timeout), by_local_rank_0=True)
            return
        self.client.call("POST", "/v1/trainer/request", {})
        lease = Lease(self.client, self._wait_lease(timeout))
        try:
            yield lease
        except BaseException as e:
            if lease.published is None:
                self._abandon(f"trainer step failed: {e.__class__.__name__}: {e}")
            raise
        if lease.published is None:
            self._abandon("the train() block exited without publishing")
            raise LeaseError("train() block exited without lease.publish(version, path)")

    def _wait_lease(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"GPU lease not granted within {timeout}s")
            status = self.client.call("GET", "/v1/trainer/lease", query={"wait": f"{max(0.1, left):g}"})
            if status.get("granted"):
                epoch = status.get("epoch")
                return int(epoch) if epoch is not None else None
            st = self.state()
            if st["stage"] == "Failed":
                raise LeaseError(f"agent failed while waiting for the lease: {st.get('fatal')}")

    def _wait_pods_lease(self, timeout: float | None) -> int | None:
        """The grant epoch of the pod's lease once the agent shows it held, or returned by a publish made
        since this call (rank 0 was quicker)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        st = self._first_state(deadline)
        before = st["trainer"].get("publishedEpoch")
        while True:
            trainer = st["trainer"]
            if trainer.get("leaseHeld"):
                return int(st["epoch"])
            published = trainer.get("publishedEpoch")
            if published is not None and published != before:
                return int(published)
            if st["stage"] == "Failed":
                raise LeaseError(f"agent failed while waiting for the lease: {st.get('fatal')}")
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"the pod's GPU lease was not granted within {timeout}s")
            st = self.state(since=st["revision"], wait=left)

    def _abandon(self, reason: str) -> None:
        with contextlib.suppress(AgentError):  # no lease held any more: nothing to return
            self.client.call("POST", "/v1/trainer/abandon", {"reason": reason[:1024]})

    @contextmanager
    def refit_window(self, timeout: float | None = None) -> Iterator[RefitSession]:
        """Wait for the agent to open a tensor/distributed refit window; the final push carries the version
        when the block exits; an exception closes the window with the error (the refit fails)."""
        version, source, archs, engine = self._wait_window(timeout)
        session = RefitSession(
            self.client, version, source, _buffers=self._buffers, architectures=archs, engine=engine
        )
        try:
            yield session
            session._finish()
        except BaseException as e:
            self.client.call(
                "POST", "/v1/trainer/refit/close", {"error": f"{e.__class__.__name__}: {e}"[:1024]}
            )
            raise
        self.client.call("POST", "/v1/trainer/refit/close", session.close_body())

    def _wait_window(self, timeout: float | None) -> tuple[str, str, list[str], str | None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"no refit window opened within {timeout}s")
            window = self.client.call("GET", "/v1/trainer/refit", query={"wait": f"{max(0.1, left):g}"})
            if window.get("open"):
                archs = list(window.get("architectures") or [])
                engine = window.get("engine")
                return str(window["version"]), str(window["source"]), archs, str(engine) if engine else None
