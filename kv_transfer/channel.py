"""KVChannel: one end of the 2-rank process group that carries payloads for one (prefill, decode) pair.

Also fixes the store key scheme both ends rendezvous through, so it is written down once.
"""

from __future__ import annotations

import collections
import datetime
import os
import time

import torch
import torch.distributed as dist

from kv_transfer.shared_memory import SLOTS, SharedRegion, copy_bytes

RECEIVER_RANK = 0
SENDER_RANK = 1
PAYLOAD_TAG = 0x4B56  # any constant works; a distinctive one makes gloo error messages greppable
# Below this a payload goes over gloo even where a shared region exists: the region's token and
# acknowledgement cost more than the copy saves (1 MiB: 0.72x gloo's rate, 2 MiB: 1.16x, by
# `python -m bench.kv_transfer_rate --sizes-mib 1 2 4 8`).
SHARED_MIN_BYTES = 2 << 20

# Store key scheme (the decode worker hosts the store):
#   kv/peers            counter; `add(1)` hands each arriving sender a channel index
#   kv/arrivals         queue of hello messages (JSON), popped by the receiver's accept thread
#   kv/<i>/verdict      receiver's answer to hello <i> (JSON: ok / error, heartbeat period)
#   kv/<i>/bell         queue of header frames: the doorbell that says "a frame is coming"
#   kv/<i>/closed       set by the receiver when channel <i> ends, so an idle sender notices
#   kv/<i>/pg/...       the process group's own rendezvous keys (PrefixStore)
PEERS_COUNTER = "kv/peers"
ARRIVALS_QUEUE = "kv/arrivals"


def channel_key(index: int, name: str) -> str:
    return f"kv/{index}/{name}"


class KVChannelError(RuntimeError):
    """A channel failed; only transfers on that channel are affected.

    `request_key` names the transfer that was in flight when the failure hit, if any, so a
    decode worker can fall back (e.g. recompute the prompt) instead of waiting for it.
    """

    def __init__(self, message: str, *, peer_id: str | None = None, request_key: str | None = None):
        super().__init__(message)
        self.peer_id = peer_id
        self.request_key = request_key


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"KV endpoint must look like 'host:port', got {endpoint!r}")
    return host.strip("[]"), int(port)


def split_endpoints(advertised: str) -> list[str]:
    """A tensor-parallel decode worker advertises one endpoint per rank, comma-separated, in
    rank order; a single-rank worker advertises one."""
    return [part.strip() for part in advertised.split(",") if part.strip()]


def tensor_parallel_mismatch(decode_tp: int, prefill_tp: int) -> str:
    return (
        f"tensor-parallel degree mismatch: decode worker has TP={decode_tp}, prefill worker "
        f"TP={prefill_tp}; KV moves rank to rank, so both need the same --tensor-parallel-size "
        "(re-sharding KV between unequal degrees is not supported)"
    )


def backend_name(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class KVChannel:
    """The process group of one channel and the payload send/recv on it.

    Owned by exactly one thread (the channel thread that opened it); torch.distributed
    backends are not meant to be driven from several threads for one peer. Every wait is
    bounded by `timeout_s`; after any error the channel is unusable and must be closed.
    """

    def __init__(
        self,
        store: dist.Store,
        index: int,
        rank: int,
        device: torch.device,
        timeout_s: float,
        region: SharedRegion | None = None,
    ):
        self.device = device
        # With a region (both ends on one host, CPU), payload bytes cross through it and the
        # group carries only chunk tokens and acknowledgements.
        self.region = region
        self._tokens = [torch.zeros(2, dtype=torch.int64) for _ in range(SLOTS)]
        self._received = torch.zeros(2, dtype=torch.int64)
        self.rank = rank
        self.peer_rank = SENDER_RANK if rank == RECEIVER_RANK else RECEIVER_RANK
        self.timeout_s = timeout_s
        prefix = dist.PrefixStore(channel_key(index, "pg"), store)
        if device.type == "cuda":
            self._group = _nccl_group(prefix, rank, device, timeout_s)
        else:
            # Construction is a rendezvous with the peer and gives up after timeout_s.
            self._group = dist.ProcessGroupGloo(prefix, rank, 2, timedelta(timeout_s))
        # One byte from sender to receiver proves the data path now, and makes NCCL build its
        # communicator here (it is lazy) instead of during the first request's transfer.
        probe = torch.ones(1, dtype=torch.uint8, device=device)
        if rank == SENDER_RANK:
            self.send(probe)
        else:
            self.recv(probe)

    @property
    def transport(self) -> str:
        return "shared memory" if self.region is not None else backend_name(self.device)

    def send(self, payload: torch.Tensor) -> None:
        """Send a contiguous payload to the peer; returns once the peer has it all (gloo)."""
        if not payload.numel():
            return
        if self.uses_region(payload):
            self._send_shared(_as_bytes(payload))
        else:
            self._wait(self._group.send([_as_bytes(payload)], self.peer_rank, PAYLOAD_TAG), "send")

    def recv(self, payload: torch.Tensor) -> None:
        """Receive exactly `payload.nbytes` bytes from the peer into `payload` in place."""
        if not payload.numel():
            return
        if self.uses_region(payload):
            self._recv_shared(_as_bytes(payload))
        else:
            self._wait(self._group.recv([_as_bytes(payload)], self.peer_rank, PAYLOAD_TAG), "recv")

    def uses_region(self, payload: torch.Tensor) -> bool:
        """Whether `payload` crosses the shared region (else gloo). Both ends decide alike:
        each knows the payload's size from its header."""
        return self.region is not None and payload.nbytes >= SHARED_MIN_BYTES

    # Through the shared region: chunk i goes into slot i % SLOTS; the sender then sends the
    # token (i, length) and the receiver, once it has copied the chunk out, sends it back. The
    # sender waits for that before it refills the slot, and for every chunk before it returns,
    # so a returned send means the peer has the whole payload, as on the wire. A gloo send only
    # completes once the peer has posted its recv, so the sender posts its tokens without
    # waiting on them: it would otherwise wait on the receiver, blocked in sending an ack.

    def _send_shared(self, data: torch.Tensor) -> None:
        slot_bytes = self.region.slot_bytes
        posted: collections.deque = collections.deque()  # (chunk, its token's send)

        def settle_oldest() -> None:
            chunk, work = posted.popleft()
            self._expect_token(chunk, "ack")
            self._wait(work, "send")  # done: the ack came after the token

        for chunk, start in enumerate(range(0, data.numel(), slot_bytes)):
            if len(posted) == SLOTS:
                settle_oldest()
            piece = data[start : start + slot_bytes]
            copy_bytes(self.region.slot(chunk % SLOTS)[: piece.numel()], piece)
            token = self._tokens[chunk % SLOTS]
            token[0], token[1] = chunk, piece.numel()
            posted.append((chunk, self._group.send([token], self.peer_rank, PAYLOAD_TAG)))
        while posted:
            settle_oldest()

    def _recv_shared(self, data: torch.Tensor) -> None:
        slot_bytes = self.region.slot_bytes
        token = self._tokens[0]
        for chunk, start in enumerate(range(0, data.numel(), slot_bytes)):
            piece = data[start : start + slot_bytes]
            self._expect_token(chunk, "chunk", piece.numel())
            copy_bytes(piece, self.region.slot(chunk % SLOTS)[: piece.numel()])
            token[0], token[1] = chunk, piece.numel()
            self._wait(self._group.send([token], self.peer_rank, PAYLOAD_TAG), "send")

    def _expect_token(self, chunk: int, what: str, length: int | None = None) -> None:
        self._wait(self._group.recv([self._received], self.peer_rank, PAYLOAD_TAG), "recv")
        got_chunk, got_length = int(self._received[0]), int(self._received[1])
        if got_chunk != chunk or (length is not None and got_length != length):
            raise KVChannelError(
                f"shared-memory {what} out of step: got chunk {got_chunk} of {got_length} "
                f"bytes, expected chunk {chunk}" + (f" of {length}" if length is not None else "")
            )

    def close(self) -> None:
        # abort() tears sockets down without a handshake: right for a dead peer, harmless for
        # a live one that has already stopped using the channel.
        group, self._group = self._group, None
        self.region = None  # the mapping goes with the last reference
        if group is not None and hasattr(group, "abort"):
            try:
                group.abort()
            except RuntimeError:
                pass

    def _wait(self, work: dist.Work, what: str) -> None:
        if self._group is None:
            raise KVChannelError(f"payload {what} on a closed channel")
        try:
            # gloo: blocks this thread until done. A peer killed mid-transfer is only noticed
            # here, by the timeout: gloo does not fail a pending recv when the socket closes.
            work.wait(timedelta(self.timeout_s))
        except RuntimeError as exc:
            raise KVChannelError(f"payload {what} failed: {exc}") from exc
        if self.device.type == "cuda":
            self._wait_cuda(what)

    def _wait_cuda(self, what: str) -> None:
        # NCCL's wait() only orders streams; poll an event so the CPU learns of completion (the
        # receiver hands the buffer to on_kv) and can give up after timeout_s.
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        deadline = time.monotonic() + self.timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                self.close()
                raise KVChannelError(f"payload {what} timed out after {self.timeout_s}s on CUDA")
            time.sleep(50e-6)


def _as_bytes(payload: torch.Tensor) -> torch.Tensor:
    # Moving bytes keeps the wire dtype-agnostic (bf16, fp8) and costs no copy.
    if not payload.is_contiguous():
        raise ValueError("KV payload must be contiguous")
    return payload.reshape(-1).view(torch.uint8)


def _nccl_group(store: dist.Store, rank: int, device: torch.device, timeout_s: float):
    """A 2-rank NCCL group on `device`. Not exercised on CPU-only CI (see the gpu test)."""
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise RuntimeError("this torch build has no NCCL; use a CPU device for gloo")
    # NCCL's default error handling tears the whole process down when an op times out; a decode
    # worker must survive one dead prefill peer, so ask for communicator abort only (unless the
    # operator chose otherwise). Read when the group is created.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    torch.cuda.set_device(device)
    options = dist.ProcessGroupNCCL.Options()
    # Our own deadline (timeout_s) fires first and aborts; the watchdog is only a backstop.
    options._timeout = timedelta(2 * timeout_s)
    return dist.ProcessGroupNCCL(store, rank, 2, options)
