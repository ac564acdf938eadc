# The latentd Python client: a thin wrapper over the generated gRPC stubs that moves
# numpy arrays to and from the server's wire format (raw bf16/fp16 values), uploads
# prefixes in chunks and runs decode steps over a Decode stream.
import hashlib
import itertools
import mmap
import os
import queue
import socket
import struct
import threading

import grpc
import numpy as np

from . import health_pb2, health_pb2_grpc, latentd_pb2, latentd_pb2_grpc
from ._wire import HEAD_DIM_QK, HEAD_DIM_V, ModelWire, StepOutput, from_wire, to_wire  # noqa: F401
from .ring import DoorbellRing, ring_bytes

# Request metadata naming the sequence an RPC is about; a proxy in front of several
# daemons (deploy/nginx) hashes on it. Set on every sequence RPC.
ROUTE_HEADER = "x-latentd-route"



PAGE_TOKENS = 64


def page_keys(token_ids, salt=b""):
    """Prefix-cache keys of the full 64-token pages of `token_ids` (docs/prefix-cache.md).

    A hash chain: key i is the first 16 bytes of SHA-256(key i-1 + the page's ids as
    little-endian int64), after SHA-256(b"latentd.page_key.v1" + len(salt) as
    little-endian uint64 + salt). The C++ client's PageKeys computes the same bytes.
    """
    if isinstance(salt, str):
        salt = salt.encode()
    parent = hashlib.sha256(b"latentd.page_key.v1" + struct.pack("<Q", len(salt)) + salt).digest()[:16]
    ids = [int(t) for t in token_ids]
    keys = []
    for p in range(len(ids) // PAGE_TOKENS):
        page = struct.pack("<%dq" % PAGE_TOKENS, *ids[p * PAGE_TOKENS:(p + 1) * PAGE_TOKENS])
        parent = hashlib.sha256(parent + page).digest()[:16]
        keys.append(parent)
    return keys

class LatentdError(Exception):
    """An RPC or step failed; .code is the grpc.StatusCode, .message the server's text."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def fp8_kv_roundtrip(kv, dtype):
    """What a daemon started with --kv_dtype=fp8_e4m3 stores for 16-bit rows kv [..., 576]
    (float values in the server dtype), as float32: the 512 latent values through e4m3
    with one power-of-two scale per 128 (docs/fp8-kv-cache.md), the rope values as sent.
    Pass rows through it before reference_decode when checking such a daemon."""
    kv = np.asarray(kv, dtype=np.float32)
    lat = kv[..., :HEAD_DIM_V].reshape(kv.shape[:-1] + (4, 128))
    finite = np.isfinite(lat)
    amax = np.max(np.where(finite, np.abs(lat), 0.0), axis=-1, keepdims=True).astype(np.float32)
    m, k = np.frexp(amax)  # amax = m * 2^k, m in [0.5, 1)
    e = np.where(m <= 0.875, k - 9, k - 8)  # smallest e with amax <= 448 * 2^e
    lo = -119 if dtype != latentd_pb2.FP16 else -22
    e = np.where(amax > 0, np.clip(e, lo, 7), 0).astype(np.int32)
    y = np.abs(np.where(finite, lat, 0.0)) * np.ldexp(np.float32(1), -e).astype(np.float32)
    y = np.where(np.isinf(lat), np.float32(448), y).astype(np.float32)
    _, ky = np.frexp(y)
    step = np.ldexp(np.float32(1), np.maximum(ky - 1, -6) - 3).astype(np.float32)  # 2^-9 below 2^-6
    qv = np.minimum(np.rint(y / step) * step, np.float32(448))  # round to nearest even, saturate
    deq = (np.copysign(qv, lat) * np.ldexp(np.float32(1), e)).astype(np.float32)
    deq = np.where(np.isnan(lat), np.float32(0), deq)
    out = kv.copy()
    out[..., :HEAD_DIM_V] = from_wire(to_wire(deq, dtype), dtype).reshape(deq.shape[:-2] + (HEAD_DIM_V,))
    return out


def reference_decode(q, kv, softmax_scale, causal=False):
    """Naive float64 MLA decode for checking results.

    q: [s_q, h_q, 576], kv: [n, h_kv, 576] (every row of the layer, the step's own rows
    last). Returns out [s_q, h_q, 512] and lse [h_q, s_q].
    """
    q = np.asarray(q, dtype=np.float64)
    kv = np.asarray(kv, dtype=np.float64)
    s_q, h_q, _ = q.shape
    n, h_kv, _ = kv.shape
    group = h_q // h_kv
    out = np.zeros((s_q, h_q, HEAD_DIM_V))
    lse = np.full((h_q, s_q), -np.inf)
    for h in range(h_q):
        k = kv[:, h // group, :]
        for i in range(s_q):
            visible = n - s_q + i + 1 if causal else n
            if visible <= 0:
                continue
            s = softmax_scale * (k[:visible] @ q[i, h])
            m = s.max()
            p = np.exp(s - m)
            out[i, h] = (p @ k[:visible, :HEAD_DIM_V]) / p.sum()
            lse[h, i] = m + np.log(p.sum())
    return out, lse


class LatentdClient(ModelWire):
    """Connects to a latentd daemon and fetches its ServerInfo (model shape, dtype).

    With info= (a ServerInfo read from another daemon of the same model) the client
    neither waits for the connection nor asks: its RPCs fail UNAVAILABLE while the
    server is unreachable (ShardedClient's daemons that are down at start).
    max_reconnect_backoff_ms shortens gRPC's wait between reconnection attempts.
    own_connection (default) gives the client a TCP connection of its own: gRPC otherwise
    shares one among every channel of the process to the same target, so two clients
    would queue behind each other's messages in one HTTP/2 connection.

    The sequence RPCs take route= (the x-latentd-route value; default the sequence id,
    a fork's parent id for fork_sequence) and timeout= (seconds; default none).
    """

    def __init__(self, target="127.0.0.1:50051", auth_token=None, tls=False, root_certificates=None,
                 server_name=None, timeout=10.0, append_chunk_bytes=4 << 20, info=None,
                 max_reconnect_backoff_ms=None, own_connection=True):
        options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", 64 << 20)]
        if own_connection:
            options.append(("grpc.use_local_subchannel_pool", 1))
        if max_reconnect_backoff_ms:
            options += [("grpc.max_reconnect_backoff_ms", max_reconnect_backoff_ms),
                        ("grpc.initial_reconnect_backoff_ms", min(100, max_reconnect_backoff_ms)),
                        ("grpc.min_reconnect_backoff_ms", min(100, max_reconnect_backoff_ms))]
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if tls:
            creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self.stub = latentd_pb2_grpc.DecodeServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._chunk = append_chunk_bytes
        self._ids = itertools.count(1)
        self.target = target
        if info is not None:
            self.info = info
            return
        grpc.channel_ready_future(self.channel).result(timeout=timeout)
        self.info = self.get_info()

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # Shapes and wire conversion for this server: ModelWire (h_q, h_kv, wire, unwire).

    def metadata(self, route=None):
        """The call metadata: the bearer token, and the route header when route is set."""
        return self._metadata + (((ROUTE_HEADER, route),) if route else ())

    def _call(self, method, request, route=None, timeout=None):
        try:
            return method(request, metadata=self.metadata(route), timeout=timeout)
        except grpc.RpcError as e:
            raise LatentdError(e.code(), e.details()) from None

    def get_info(self, timeout=None):
        return self._call(self.stub.GetInfo, latentd_pb2.GetInfoRequest(), timeout=timeout)

    def health(self, service="", timeout=5.0):
        """'SERVING' or 'NOT_SERVING' (grpc.health.v1) of the server, or of one service
        ("latentd.v1.DecodeService")."""
        resp = self._call(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def create_sequence(self, sequence_id="", route=None, timeout=None):
        return self._call(self.stub.CreateSequence, latentd_pb2.CreateSequenceRequest(sequence_id=sequence_id),
                          route or sequence_id, timeout).sequence_id

    def create_sequence_with_prefix(self, page_keys, sequence_id="", route=None, timeout=None):
        """CreateSequence with prefix reuse: `page_keys` from page_keys(token_ids, salt).

        Returns (sequence_id, prefix_tokens): every layer already holds prefix_tokens rows
        (whole pages the server had cached); append the prompt's rows from there on.
        """
        req = latentd_pb2.CreateSequenceRequest(sequence_id=sequence_id, page_keys=list(page_keys))
        resp = self._call(self.stub.CreateSequence, req, route or sequence_id, timeout)
        return resp.sequence_id, resp.prefix_tokens

    def fork_sequence(self, sequence_id, new_sequence_id="", route=None, timeout=None):
        req = latentd_pb2.ForkSequenceRequest(sequence_id=sequence_id, new_sequence_id=new_sequence_id)
        return self._call(self.stub.ForkSequence, req, route or sequence_id, timeout).sequence_id

    def release_sequence(self, sequence_id, route=None, timeout=None):
        req = latentd_pb2.ReleaseSequenceRequest(sequence_id=sequence_id)
        return self._call(self.stub.ReleaseSequence, req, route or sequence_id, timeout).pages_freed

    def get_sequence(self, sequence_id, route=None, timeout=None):
        """Lengths per layer and pages held (SequenceInfo): to resync after a broken stream."""
        req = latentd_pb2.GetSequenceRequest(sequence_id=sequence_id)
        return self._call(self.stub.GetSequence, req, route or sequence_id, timeout)

    def append_kv(self, sequence_id, rows_by_layer, route=None, timeout=None):
        """Uploads prefill rows: {layer: array [n, h_kv, 576]} (float or raw bytes).

        Returns the AppendKvResponse (tokens_appended, per-layer lengths).
        """
        return self._append(sequence_id, rows_by_layer, "kv", self.h_kv * HEAD_DIM_QK * 2, route, timeout)

    def append_hidden(self, sequence_id, hidden_by_layer, route=None, timeout=None):
        """The layer API's prefill: {layer: hidden states [n, hidden_size]} (float or raw
        bytes); the daemon computes and appends their latent rows at the layer's next
        positions. Returns the AppendKvResponse."""
        if not self.hidden_size:
            raise ValueError("the daemon does not serve the layer API (ServerInfo.layer_api is false)")
        return self._append(sequence_id, hidden_by_layer, "hidden", self.hidden_size * 2, route, timeout)

    def _append(self, sequence_id, by_layer, field, row_bytes, route, timeout):
        """One AppendKv stream: each layer's bytes in chunks of whole rows, in `field`."""
        chunk = max(row_bytes, self._chunk // row_bytes * row_bytes)

        def messages():
            first = True
            for layer, values in by_layer.items():
                data = self._raw(values)
                for start in range(0, max(len(data), 1), chunk):
                    yield latentd_pb2.AppendKvRequest(sequence_id=sequence_id if first else "", layer=layer,
                                                      **{field: bytes(data[start:start + chunk])})
                    first = False

        return self._call(self.stub.AppendKv, messages(), route or sequence_id, timeout)

    def export_sequence(self, sequence_id, max_chunk_bytes=0, route=None, timeout=None):
        """Yields the sequence's SequenceChunk messages (docs/export-import.md): the header
        first, its stored rows layer by layer, last=True with the totals at the end. A
        draining daemon answers too. Raises LatentdError if the stream fails part-way."""
        req = latentd_pb2.ExportSequenceRequest(sequence_id=sequence_id, max_chunk_bytes=max_chunk_bytes)
        try:
            yield from self.stub.ExportSequence(req, metadata=self.metadata(route or sequence_id), timeout=timeout)
        except grpc.RpcError as e:
            raise LatentdError(e.code(), e.details()) from None

    def import_sequence(self, chunks, sequence_id="", route=None, timeout=None):
        """Creates a sequence from an export's chunks (any iterable, consumed as sent),
        under sequence_id or else the header's id. All or nothing on the server: a
        stream that fails or ends early leaves nothing there. Returns the
        ImportSequenceResponse (sequence_id, lengths, rows, bytes)."""
        first = [True]

        def messages():
            for c in chunks:
                if first[0] and sequence_id:
                    c = latentd_pb2.SequenceChunk.FromString(c.SerializeToString())
                    c.sequence_id = sequence_id
                first[0] = False
                yield c

        return self._call(self.stub.ImportSequence, messages(), route or sequence_id or None, timeout)

    def move_sequence(self, sequence_id, to, route=None, timeout=None):
        """Moves a sequence to client `to` under the same id: exported here and imported
        there chunk by chunk, then released here. If either side fails, nothing is left
        on `to` and the sequence stays here (LatentdError). Returns the
        ImportSequenceResponse."""
        resp = to.import_sequence(self.export_sequence(sequence_id, route=route, timeout=timeout),
                                  route=route or sequence_id, timeout=timeout)
        try:
            self.release_sequence(sequence_id, route=route, timeout=timeout)
        except LatentdError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:
                raise
        return resp

    def open_session(self, route=None):
        """A Decode stream; route: its x-latentd-route (through a proxy the whole stream
        goes to that key's daemon, so it should carry that sequence's steps only)."""
        return DecodeSession(self, route)

    def decode(self, steps):
        """Runs steps on one Decode stream and returns their StepOutputs in order.

        Each step is a dict: sequence_id, layer, q [s_q, h_q, 576], kv [s_q, h_kv, 576],
        causal (optional); or, for a layer step, hidden [s_q, hidden_size] instead of q and
        kv, and position (optional), whose .out is the layer's output [s_q, hidden_size].
        Failed steps have .code != 0 and a .message. The stream's route is the first
        step's sequence.
        """
        with self.open_session(steps[0]["sequence_id"] if steps else None) as session:
            ids = [session.submit(**s) for s in steps]
            session.close_send()
            got = {r.request_id: r for r in session.results()}
        missing = [i for i in ids if i not in got]
        if missing:
            raise LatentdError(grpc.StatusCode.UNAVAILABLE, f"stream ended without results for {len(missing)} steps")
        return [got[i] for i in ids]


def _collect_fd(name, ticket):
    """The descriptor the daemon offers under ticket on its handoff socket (docs/api.md):
    send the ticket, receive one byte, b'k' with the descriptor or b'n' without."""
    address = "\0" + name[1:] if name.startswith("@") else name
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(address)
            s.sendall(ticket)
            answer, fds, _, _ = socket.recv_fds(s, 1, 1)
        except OSError as e:
            raise LatentdError(grpc.StatusCode.UNAVAILABLE, f"data plane socket {name}: {e}") from None
    if answer == b"k" and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    raise LatentdError(grpc.StatusCode.PERMISSION_DENIED,
                       "data plane socket: no region offered under this ticket (a ticket works once)")


class SharedRegion:
    """A Decode stream's shared-memory region (same-host data plane), mapped here.

    Steps name byte offsets into it (DecodeSession.submit_region) instead of carrying
    q/kv, and the server writes out/lse there: array() views it without copying."""

    def __init__(self, answer, nbytes):
        """answer: the stream's SharedRegion message. The memory file comes from the
        daemon's handoff socket for the answer's one-time ticket, or (from a daemon run
        with --data_plane_proc_paths) from its path."""
        fd = _collect_fd(answer.handoff_socket, answer.ticket) if answer.ticket else os.open(
            answer.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self.mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file
        self.nbytes = nbytes

    def array(self, offset, shape, dtype):
        """A numpy view of the region at offset (no copy): e.g. (s_q, h_q, 576) '<u2'."""
        count = int(np.prod(shape))
        return np.frombuffer(self.mmap, dtype=dtype, count=count, offset=offset).reshape(shape)

    def close(self):
        self.mmap.close()


class DecodeSession:
    """One Decode stream: submit() steps from one thread, iterate results() in another
    (or after close_send()). Results may arrive in any order across sequences."""

    _END = object()

    def __init__(self, client, route=None):
        self._client = client
        self._requests = queue.Queue()
        self._s_q = {}
        self._lock = threading.Lock()
        self._responses = client.stub.Decode(self._request_iter(), metadata=client.metadata(route))

    def _request_iter(self):
        while True:
            item = self._requests.get()
            if item is self._END:
                return
            yield item

    def _region_answer(self, request, nbytes):
        """Sends a request that opens the stream's region and returns the server's answer,
        the stream's first response (it must name a region of nbytes)."""
        self._requests.put(request)
        try:
            resp = next(self._responses)
        except StopIteration:
            raise LatentdError(grpc.StatusCode.UNAVAILABLE, "stream ended before the region's answer") from None
        except grpc.RpcError as e:
            raise LatentdError(e.code(), e.details()) from None
        if resp.region.bytes != nbytes:
            raise LatentdError(grpc.StatusCode.INTERNAL, "the first response is not the region's answer")
        return resp

    def open_region(self, nbytes, ring_entries=0):
        """Asks the server for a shared region of nbytes and maps it (same host and user
        as the daemon only). Call before any submit and before results(); the region
        lives until the stream ends. ring_entries > 0 also puts a doorbell ring of that
        many entries at its start (self.ring, a DoorbellRing; tensors go after
        ring.nbytes): steps then go through shared memory with no message per step."""
        resp = self._region_answer(
            latentd_pb2.DecodeRequest(open_region_bytes=nbytes, region_ring_entries=ring_entries), nbytes)
        self.region = SharedRegion(resp.region, nbytes)
        self.ring = DoorbellRing(self.region, ring_entries) if ring_entries else None
        return self.region

    def open_cuda_region(self, tensor, ring_entries=0):
        """Offers a CUDA tensor's memory (torch, on the server's GPU or one it reaches) as
        this stream's region, through CUDA IPC: the server's GPU then reads q/kv from it
        and writes out/lse into it, with no host copy anywhere. Steps' offsets
        (submit_region) are bytes from tensor.data_ptr(). Call before any submit and
        before results(); finish writing the tensor (e.g. torch.cuda.synchronize())
        before submitting steps that read it. CUDA daemon only. ring_entries > 0 also
        opens a doorbell ring (self.ring) in a host file of its own: its steps' offsets
        name the tensor's bytes from 0 on."""
        storage = tensor.untyped_storage()
        # (device, handle, storage bytes, storage offset in the allocation, ...)
        shared = storage._share_cuda_()
        handle, alloc_offset = shared[1], shared[3]
        if len(handle) == 66:
            # Recent torch prefixes its cudaMalloc handles with a version and a kind byte.
            handle = handle[2:]
        start = alloc_offset + (tensor.data_ptr() - storage.data_ptr())
        nbytes = tensor.numel() * tensor.element_size()
        region = latentd_pb2.CudaRegion(ipc_handle=handle, offset=start, bytes=nbytes)
        resp = self._region_answer(
            latentd_pb2.DecodeRequest(open_cuda_region=region, region_ring_entries=ring_entries), nbytes)
        self.region = tensor
        if ring_entries:
            if resp.region.ring_bytes != ring_bytes(ring_entries) or not (resp.region.path or resp.region.ticket):
                raise LatentdError(grpc.StatusCode.INTERNAL, "the region's answer holds no ring of the size asked for")
            self.ring_file = SharedRegion(resp.region, resp.region.ring_bytes)
            self.ring = DoorbellRing(self.ring_file, ring_entries)
        return tensor

    def submit_region(self, steps):
        """Sends steps whose tensors are in the region, as one DecodeRequest (a model
        runner's layer batch: one launch, results back together). Each step is a dict:
        sequence_id, layer, s_q, q_offset, kv_offset, out_offset, lse_offset, causal
        (optional). Their results carry no out/lse: read them from the region once the
        step's StepOutput has arrived. Returns the request ids in order."""
        c = self._client
        ids, pb = [], []
        for st in steps:
            rid = next(c._ids)
            ids.append(rid)
            if "hidden_offset" in st:  # a layer step: hidden in, the layer's output at out_offset
                region = latentd_pb2.RegionTensors(s_q=st["s_q"], layer_step=True, hidden_offset=st["hidden_offset"],
                                                   out_offset=st["out_offset"])
                if st.get("position") is not None:
                    region.position = st["position"]
            else:
                region = latentd_pb2.RegionTensors(s_q=st["s_q"], q_offset=st["q_offset"],
                                                   kv_offset=st["kv_offset"], out_offset=st["out_offset"],
                                                   lse_offset=st["lse_offset"])
            pb.append(latentd_pb2.DecodeStep(request_id=rid, sequence_id=st["sequence_id"], layer=st["layer"],
                                             causal=st.get("causal", False), region=region))
        with self._lock:
            for rid in ids:
                self._s_q[rid] = 0  # results in place
        self._requests.put(latentd_pb2.DecodeRequest(steps=pb))
        return ids

    def submit_many(self, steps):
        """Sends several steps as one DecodeRequest (a model runner's layer batch: one
        launch, results back together). Each step is a dict of submit()'s arguments.
        Returns the request ids in order."""
        c = self._client
        ids, pb = [], []
        for st in steps:
            rid = st.get("request_id") or next(c._ids)
            ids.append(rid)
            if "hidden" in st:
                step, s_q = c._layer_step_message(rid, st["sequence_id"], st["layer"], st["hidden"],
                                                  st.get("causal", False), st.get("position"), st.get("timeout_ms", 0))
            else:
                step, s_q = c._step_message(rid, st["sequence_id"], st["layer"], st["q"], st["kv"],
                                            st.get("causal", False), st.get("timeout_ms", 0))
            with self._lock:
                self._s_q[rid] = s_q
            pb.append(step)
        self._requests.put(latentd_pb2.DecodeRequest(steps=pb))
        return ids

    def submit(self, sequence_id, layer, q=None, kv=None, causal=False, request_id=None, timeout_ms=0, hidden=None,
               position=None):
        """One step: q and kv (the kernel-level API), or hidden and optionally position (the
        layer API). Returns its request id."""
        c = self._client
        rid = next(c._ids) if request_id is None else request_id
        if hidden is not None:
            step, s_q = c._layer_step_message(rid, sequence_id, layer, hidden, causal, position, timeout_ms)
        else:
            step, s_q = c._step_message(rid, sequence_id, layer, q, kv, causal, timeout_ms)
        with self._lock:
            self._s_q[rid] = s_q
        self._requests.put(latentd_pb2.DecodeRequest(steps=[step]))
        return rid

    def close_send(self):
        self._requests.put(self._END)

    def cancel(self):
        self._responses.cancel()

    def results(self):
        """Yields StepOutput until the server ends the stream (raises LatentdError if it
        ends with an error other than a cancellation requested here)."""
        c = self._client
        try:
            for resp in self._responses:
                for r in resp.results:
                    with self._lock:
                        s_q = self._s_q.pop(r.request_id, 1)  # 0: a region step, its results in the region
                    yield c._step_output(r, s_q)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise LatentdError(e.code(), e.details()) from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close_send()
