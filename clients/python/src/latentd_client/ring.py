# The doorbell ring at the start of a Decode stream's shared region (the daemon's
# server/ring.h; docs/api.md): steps are published into its submission queue and
# results read off its completion queue through shared memory, no gRPC message per step.
import ctypes
import os
import threading
import time

import numpy as np

HEADER_BYTES = 256
ENTRY_BYTES = 256
MAX_ENTRIES = 4096
MAX_SEQUENCE_ID = 128

# Header words (uint32 indices): written by the client, then by the server.
_SQ_TAIL, _CQ_HEAD, _CLIENT_WAITING = 0, 1, 2
_SQ_HEAD, _CQ_TAIL, _SERVER_WAITING, _CLOSED = 16, 17, 18, 19

# One submission entry; fill a STEP_DTYPE array once per batch layout and update its
# request_id / layer columns per layer (vectorized), then submit_array() it.
STEP_DTYPE = np.dtype([
    ("request_id", "<u8"), ("layer", "<i4"), ("s_q", "<u4"), ("causal", "<u4"), ("sequence_id_bytes", "<u4"),
    ("q_offset", "<u8"), ("kv_offset", "<u8"), ("out_offset", "<u8"), ("lse_offset", "<u8"),
    ("sequence_id", "S128"), ("trace", "<u4"),
    ("layer_step", "<u4"), ("hidden_offset", "<u8"), ("position", "<i8"), ("has_position", "<u4"), ("reserved", "V44"),
])
# One completion entry: code is a google.rpc code (0: out and lse are in the region).
COMPLETION_DTYPE = np.dtype([
    ("request_id", "<u8"), ("code", "<i4"), ("message_bytes", "<u4"), ("message", "S168"),
    ("timing_us", "<i8", (8,)), ("reserved", "V8"),
])
assert STEP_DTYPE.itemsize == ENTRY_BYTES and COMPLETION_DTYPE.itemsize == ENTRY_BYTES


def ring_bytes(entries):
    """Bytes the ring takes at the region's start (tensors go after them)."""
    return (HEADER_BYTES + 2 * entries * ENTRY_BYTES + 4095) // 4096 * 4096


_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class DoorbellRing:
    """Drives a ring from one thread. Keep the DecodeSession (its stream) open while the
    ring is used; close() before the region is unmapped."""

    def __init__(self, region, entries, spin_us=1000):
        if entries < 1 or entries > MAX_ENTRIES or entries & (entries - 1):
            raise ValueError(f"ring entries: {entries}; expected a power of two from 1 to {MAX_ENTRIES}")
        if _SYS_FUTEX is None:
            raise OSError("doorbell ring: futex syscall number unknown on this machine")
        self.entries = entries
        self.nbytes = ring_bytes(entries)
        self.spin_s = spin_us / 1e6
        buf = region.mmap
        self._hdr = np.frombuffer(buf, dtype="<u4", count=HEADER_BYTES // 4, offset=0)
        self._sq = np.frombuffer(buf, dtype=STEP_DTYPE, count=entries, offset=HEADER_BYTES)
        self._cq = np.frombuffer(buf, dtype=COMPLETION_DTYPE, count=entries, offset=HEADER_BYTES + entries * ENTRY_BYTES)
        self._sq_tail_word = ctypes.c_uint32.from_buffer(buf, _SQ_TAIL * 4)
        self._cq_tail_word = ctypes.c_uint32.from_buffer(buf, _CQ_TAIL * 4)
        self._tail = 0  # steps published
        self._head = 0  # completions read
        # Acquiring and releasing a lock is a locked read-modify-write, a full memory
        # fence on x86: it orders a store of ours before the load of the other side's
        # waiting flag (the futex handshake needs that; Python has no fence of its own).
        self._fence = threading.Lock()

    def close(self):
        """Drops the views of the region (so that it can be unmapped)."""
        self._hdr = self._sq = self._cq = None
        self._sq_tail_word = self._cq_tail_word = None

    @property
    def outstanding(self):
        return (self._tail - self._head) & 0xFFFFFFFF

    @property
    def closed(self):
        return bool(self._hdr[_CLOSED])

    def _futex(self, word, op, val, timeout_s=None):
        ts = None
        if timeout_s is not None:
            ts = ctypes.byref(_Timespec(int(timeout_s), int((timeout_s % 1) * 1e9)))
        _libc.syscall(_SYS_FUTEX, ctypes.byref(word), op, val, ts, None, 0)

    def steps(self, n):
        """A zeroed STEP_DTYPE array of n entries to fill."""
        return np.zeros(n, dtype=STEP_DTYPE)

    def set_sequence_ids(self, steps, sequence_ids):
        ids = [s.encode() if isinstance(s, str) else bytes(s) for s in sequence_ids]
        if any(len(s) > MAX_SEQUENCE_ID for s in ids):
            raise ValueError("sequence id over 128 bytes")
        steps["sequence_id"] = ids
        steps["sequence_id_bytes"] = [len(s) for s in ids]

    def submit_array(self, steps):
        """Publishes a STEP_DTYPE array as one batch (the server submits what it takes at
        once together, like one DecodeRequest)."""
        n = len(steps)
        if self._hdr[_CLOSED]:
            raise ConnectionError("doorbell ring: the server closed it (its Decode stream ended or it is draining)")
        if n > self.entries - self.outstanding:
            raise BufferError(f"doorbell ring: {n} steps with {self.outstanding} outstanding is over its "
                              f"{self.entries} entries")
        start = self._tail % self.entries
        first = min(n, self.entries - start)
        self._sq[start:start + first] = steps[:first]
        if first < n:
            self._sq[:n - first] = steps[first:]
        self._tail = (self._tail + n) & 0xFFFFFFFF
        self._hdr[_SQ_TAIL] = self._tail
        with self._fence:
            pass
        if self._hdr[_SERVER_WAITING]:
            self._futex(self._sq_tail_word, _FUTEX_WAKE, 1)

    def submit(self, steps):
        """Publishes dicts (sequence_id, layer, s_q, q_offset, kv_offset, out_offset,
        lse_offset, request_id, causal and trace optional) as one batch. A layer step
        (the layer API) gives hidden_offset and out_offset instead of the four tensor
        offsets, and optionally position."""
        arr = self.steps(len(steps))
        for i, st in enumerate(steps):
            layer_step = "hidden_offset" in st
            for k in ("request_id", "layer", "s_q", "q_offset", "kv_offset", "out_offset", "lse_offset"):
                arr[i][k] = st.get(k, 0) if layer_step or k == "request_id" else st[k]
            arr[i]["causal"] = 1 if st.get("causal") else 0
            arr[i]["trace"] = 1 if st.get("trace") else 0
            arr[i]["layer_step"] = 1 if layer_step else 0
            arr[i]["hidden_offset"] = st.get("hidden_offset", 0)
            arr[i]["has_position"] = 1 if st.get("position") is not None else 0
            arr[i]["position"] = st.get("position") or 0
        self.set_sequence_ids(arr, [st["sequence_id"] for st in steps])
        self.submit_array(arr)

    def wait(self, n, timeout=None):
        """Returns the next n completions (a COMPLETION_DTYPE array, copied out of the
        ring). Raises TimeoutError, or ConnectionError once the server has closed the
        ring and nothing more will come."""
        deadline = None if timeout is None else time.monotonic() + timeout
        parts, got = [], 0
        active = time.monotonic()
        hdr = self._hdr
        while got < n:
            tail = int(hdr[_CQ_TAIL])
            avail = (tail - self._head) & 0xFFFFFFFF
            if avail:
                take = min(avail, n - got)
                start = self._head % self.entries
                first = min(take, self.entries - start)
                parts.append(self._cq[start:start + first].copy())
                if first < take:
                    parts.append(self._cq[:take - first].copy())
                self._head = (self._head + take) & 0xFFFFFFFF
                hdr[_CQ_HEAD] = self._head
                got += take
                active = time.monotonic()
                continue
            now = time.monotonic()
            if hdr[_CLOSED] and int(hdr[_SQ_HEAD]) == self._head and int(hdr[_CQ_TAIL]) == self._head:
                raise ConnectionError("doorbell ring: the server closed it with steps not taken")
            if deadline is not None and now >= deadline:
                raise TimeoutError(f"doorbell ring: {got} of {n} completions")
            if now - active < self.spin_s:
                continue
            hdr[_CLIENT_WAITING] = 1
            with self._fence:
                pass
            if int(hdr[_CQ_TAIL]) == tail:
                left = 0.005 if deadline is None else max(1e-6, min(0.005, deadline - now))
                self._futex(self._cq_tail_word, _FUTEX_WAIT, tail, left)
            hdr[_CLIENT_WAITING] = 0
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
