"""SharedRegion: a memory-mapped file under /dev/shm that a sender and a receiver on one host
both map, so a KV payload crosses as two memory copies instead of through TCP on loopback.

The sender creates the file (mode 0600, a random name with its pid) and offers it in its hello;
the receiver maps it only if the name has our form and the file begins with the offer's random
token, which is what proves both ends see the same /dev/shm (the same host, the same container
or pod). The sender unlinks the file as soon as the receiver has answered; the mappings live
until both ends drop them. A sender killed before that leaves its file, and the next region
created on the host removes every file whose pid is gone.

The region holds `SLOTS` equal slots after a one-page head: a payload larger than a slot crosses
in slot-sized chunks, the sender filling one slot while the receiver empties the other.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import re
import secrets
import stat

import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"splitserve-kv-([0-9]{1,10})-[0-9a-f]{32}")
_TOKEN_BYTES = 32
HEAD_BYTES = 4096  # the token, then zeros; slots start page-aligned after it
SLOTS = 2
# A slot smaller than this makes a payload many round trips; larger than this is memory that
# no single chunk needs (a chunk is copied while the other slot is emptied).
MIN_SLOT_BYTES = 64 << 10
MAX_REGION_BYTES = 1 << 30
# Each channel's region by default: two 32 MiB slots, so a payload of up to 64 MiB (a
# 2,048-token prompt of a 135M model is 47 MB) crosses in one round.
DEFAULT_SHARED_MEMORY_BYTES = 64 << 20


def region_bytes_ok(nbytes: int) -> str | None:
    """Why a region of `nbytes` cannot be used, or None."""
    if not HEAD_BYTES + SLOTS * MIN_SLOT_BYTES <= nbytes <= MAX_REGION_BYTES:
        return (f"shared-memory region of {nbytes} bytes is outside "
                f"[{HEAD_BYTES + SLOTS * MIN_SLOT_BYTES}, {MAX_REGION_BYTES}]")
    return None


class SharedRegion:
    """One channel's mapping of the shared file; `slot(i)` is a flat uint8 tensor over slot i."""

    def __init__(self, path: str, nbytes: int, token: bytes, tensor: torch.Tensor):
        self.path = path
        self.nbytes = nbytes
        self.token = token
        self._tensor = tensor  # the whole file, mapped shared; its storage holds the mapping
        self.slot_bytes = (nbytes - HEAD_BYTES) // SLOTS
        self._slots = [
            tensor[HEAD_BYTES + i * self.slot_bytes : HEAD_BYTES + (i + 1) * self.slot_bytes]
            for i in range(SLOTS)
        ]

    @classmethod
    def create(cls, nbytes: int) -> SharedRegion:
        """A new region (sender side). Raises OSError where /dev/shm is missing or full."""
        reason = region_bytes_ok(nbytes)
        if reason is not None:
            raise ValueError(reason)
        _remove_stale()
        path = os.path.join(SHM_DIR, f"splitserve-kv-{os.getpid()}-{secrets.token_hex(16)}")
        token = secrets.token_bytes(_TOKEN_BYTES)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Allocated now, so a full /dev/shm (a container's is often 64 MiB) fails here,
            # with ENOSPC, rather than as SIGBUS on a write into the mapping later.
            os.posix_fallocate(fd, 0, nbytes)
            os.pwrite(fd, token, 0)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        try:
            tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            # Fault every page in now, not during the first payload (a 64 MiB region's first
            # use took 55 ms against 14 after).
            tensor[HEAD_BYTES:].zero_()
        except BaseException:
            os.unlink(path)
            raise
        return cls(path, nbytes, token, tensor)

    @classmethod
    def create_or_none(cls, nbytes: int, owner: str) -> SharedRegion | None:
        """create(), or None (logged) where /dev/shm cannot hold it; None for nbytes <= 0."""
        if nbytes <= 0:
            return None
        try:
            return cls.create(nbytes)
        except (OSError, RuntimeError) as exc:
            logger.warning("kv sender %s: no shared-memory region (%s); payloads go over gloo",
                           owner, exc)
            return None

    @classmethod
    def attach(cls, offer: object) -> tuple[SharedRegion | None, str]:
        """Map the region a sender offered (receiver side): (region, "") or (None, why not).

        Never raises for a bad offer: a peer elsewhere, or a hostile one, is simply declined."""
        if not isinstance(offer, dict):
            return None, "no offer"
        path, nbytes, token = offer.get("path"), offer.get("bytes"), offer.get("token")
        if not isinstance(path, str) or os.path.dirname(path) != SHM_DIR or not _NAME.fullmatch(
            os.path.basename(path)
        ):
            return None, f"offered path {str(path)[:120]!r} is not a splitserve KV region"
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or region_bytes_ok(nbytes):
            return None, f"offered size {str(nbytes)[:40]!r} is out of range"
        try:
            expected = bytes.fromhex(token) if isinstance(token, str) else b""
        except ValueError:
            expected = b""
        if len(expected) != _TOKEN_BYTES:
            return None, "offered token is malformed"
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            return None, f"cannot open {path}: {exc.strerror} (the sender is on another host?)"
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != nbytes:
                return None, f"{path} is not a regular file of {nbytes} bytes"
            if not secrets.compare_digest(os.pread(fd, _TOKEN_BYTES, 0), expected):
                return None, f"{path} does not hold the offered token"
        finally:
            os.close(fd)
        try:
            tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            _touch_pages(tensor)
        except (OSError, RuntimeError) as exc:
            return None, f"cannot map {path}: {exc}"
        return cls(path, nbytes, expected, tensor), ""

    def offer(self) -> dict:
        """What the sender's hello carries."""
        return {"path": self.path, "bytes": self.nbytes, "token": self.token.hex()}

    def unlink(self) -> None:
        """Remove the name (sender side); both mappings stay valid. Idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not remove shared KV region %s: %s", self.path, exc)

    def slot(self, index: int) -> torch.Tensor:
        return self._slots[index]


def _remove_stale() -> None:
    """Remove the regions of senders that died before their receiver answered (SIGKILL during
    a connect): a name whose pid no longer runs."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                logger.info("removed %s, left by a sender that is gone", name)
            except OSError:
                pass
        except (PermissionError, OverflowError):
            pass  # alive, another user's; or not a pid at all


def _touch_pages(tensor: torch.Tensor) -> None:
    """Map every page of a region the sender has already filled (a read per page)."""
    int(tensor[:: mmap.PAGESIZE].sum())


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for contiguous CPU byte tensors of equal length, on this thread alone.

    memmove releases the GIL and uses no worker threads: a channel thread copying a payload
    must not take the cores the engine's own intra-op threads are running on."""
    if dst.numel() != src.numel():
        raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()}")
    if src.numel():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
