# Scale-out client: one latentd daemon per GPU, sequences spread over them by
# consistent hashing of their ids. The same ring, hash and routing header as the C++
# ShardedClient (clients/cpp/sharded_client.h, hash_ring.h), so that C++ and Python
# processes place every sequence on the same daemon; docs/deployment.md, "Scale-out".
import bisect
import concurrent.futures
import secrets
import threading
import time

import grpc
import numpy as np

from . import health_pb2, health_pb2_grpc, latentd_pb2
from ._wire import ModelWire, StepOutput
from .client import ROUTE_HEADER, LatentdClient, LatentdError  # noqa: F401

_MASK = (1 << 64) - 1
_DECODE_SERVICE = "latentd.v1.DecodeService"
_MESSAGE_SLACK = 64 << 10


def fnv1a64(data):
    """64-bit FNV-1a of bytes."""
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & _MASK
    return h


def fmix64(k):
    """MurmurHash3's 64-bit finalizer (spreads FNV's weak low bits)."""
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _MASK
    k ^= k >> 33
    return k


def route_hash(key):
    """fmix64(fnv1a64(utf-8 bytes of key)): the hash of ring points and keys."""
    return fmix64(fnv1a64(key.encode() if isinstance(key, str) else bytes(key)))


class HashRing:
    """Consistent-hash ring: virtual_nodes points per target, at route_hash("<target>#<v>"),
    sorted by (hash, target); a key belongs to the target of the first point at or after
    its hash, wrapping around. Targets are identified by their strings."""

    DEFAULT_VIRTUAL_NODES = 160

    def __init__(self, targets, virtual_nodes=DEFAULT_VIRTUAL_NODES):
        self.targets = list(targets)
        points = sorted(((route_hash(f"{t}#{v}"), t, i) for i, t in enumerate(self.targets)
                         for v in range(max(1, virtual_nodes))), key=lambda p: (p[0], p[1].encode()))
        self._hashes = [p[0] for p in points]
        self._owners = [p[2] for p in points]

    def __len__(self):
        return len(self.targets)

    def _first(self, key):
        i = bisect.bisect_left(self._hashes, route_hash(key))
        return 0 if i == len(self._hashes) else i

    def owner(self, key):
        """Index of the target owning key (-1 for an empty ring)."""
        if not self._hashes:
            return -1
        return self._owners[self._first(key)]

    def preference(self, key):
        """Every target once, in the order met walking clockwise from key."""
        order, seen = [], set()
        if not self._hashes:
            return order
        start, n = self._first(key), len(self._hashes)
        for i in range(n):
            t = self._owners[(start + i) % n]
            if t not in seen:
                seen.add(t)
                order.append(t)
                if len(order) == len(self.targets):
                    break
        return order


def salted_route(sequence_id, k):
    """The route key of the k-th placement attempt through a proxy: the id for k = 0, else
    "<id>#<16 hex digits of route_hash("<id>#<k>")>" (as the C++ client's SaltedRoute).
    A well-mixed salt: nginx hashes with CRC32, under which keys differing only in a short
    counter land near each other on its ring, often on one daemon."""
    return sequence_id if k == 0 else f"{sequence_id}#{route_hash(f'{sequence_id}#{k}'):016x}"


def missing_result_code(code):
    """The code (an int) of a step whose stream ended with grpc.StatusCode code before
    its result came: UNAVAILABLE for a broken or refused stream, the stream's own code
    for errors that are not about reaching the daemon."""
    keep = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED)
    return (code if code in keep else grpc.StatusCode.UNAVAILABLE).value[0]


_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def _code_of(result):
    return result[0] if isinstance(result, tuple) else result.code


def _same_model(a, b):
    # The layer API's shape too: a batch of layer steps may go to any of the daemons.
    return (a.num_layers, a.num_heads_q, a.num_heads_kv, a.head_dim_qk, a.head_dim_v, a.dtype, a.softmax_scale,
            a.layer_api, a.hidden_size) == \
        (b.num_layers, b.num_heads_q, b.num_heads_kv, b.head_dim_qk, b.head_dim_v, b.dtype, b.softmax_scale,
         b.layer_api, b.hidden_size)


def _model(i):
    return (f"layers {i.num_layers} h_q {i.num_heads_q} h_kv {i.num_heads_kv} "
            f"dtype {latentd_pb2.DType.Name(i.dtype)} scale {i.softmax_scale}")


class _Target:
    def __init__(self, address):
        self.address = address
        self.client = None
        self.health = None
        self.healthy = False
        self.verified = False
        self.failures = 0
        self.last_error = ""
        self.draining = False      # its GetInfo said so
        self.last_drain_probe = 0.0


class _WorkGate:
    """Batches and uploads enter together; a move waits for them to leave and holds new
    ones back meanwhile (so no row of this client is in flight while it moves)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._active = 0
        self._mover = False

    def __enter__(self):
        with self._cv:
            self._cv.wait_for(lambda: not self._mover)
            self._active += 1

    def __exit__(self, *exc):
        with self._cv:
            self._active -= 1
            self._cv.notify_all()

    def lock(self):
        with self._cv:
            self._cv.wait_for(lambda: not self._mover)
            self._mover = True
            self._cv.wait_for(lambda: self._active == 0)

    def unlock(self):
        with self._cv:
            self._mover = False
            self._cv.notify_all()


class ShardedClient(ModelWire):
    """Sequences spread over several daemons.

    targets: host:port of every daemon (client-side hashing: each sequence goes to the
    daemon its id hashes to, the daemons are health-checked, and a down daemon's
    sequences fail UNAVAILABLE at once), or, with via_proxy=True, the one address of a
    proxy (deploy/nginx) that hashes on the x-latentd-route header.

    decode_batch(steps) is the per-layer call: the steps are split by daemon (by route
    key through a proxy), each group goes out as one message on its own Decode stream,
    all at once, and a StepOutput comes back for every step in order. A step whose daemon
    is down or whose stream broke gets code UNAVAILABLE (14); batch_timeout bounds the
    wait. On UNAVAILABLE, re-create the sequence (create_sequence with the same id puts it
    on a live daemon) and upload its KV again.

    Forks live beside their parent, and re-created sequences where they were placed:
    this client records both. Thread-safe.

    Draining daemons (client-side hashing, move_on_drain): when a daemon reports that it
    drains (health NOT_SERVING, or steps refused UNAVAILABLE while its GetInfo says
    draining), every sequence this client knows there (created, forked, moved or used
    through it) moves to its next live daemon on the ring (export, import, release;
    docs/export-import.md), and decode_batch sends the refused steps again there.
    """

    def __init__(self, targets, via_proxy=False, auth_token=None, tls=False, root_certificates=None,
                 server_name=None, virtual_nodes=HashRing.DEFAULT_VIRTUAL_NODES, connect_timeout=5.0,
                 health_interval=1.0, health_timeout=2.0, unhealthy_after=2, rpc_timeout=30.0,
                 upload_timeout=600.0, batch_timeout=30.0, max_steps_per_message=256, proxy_create_attempts=16,
                 append_chunk_bytes=4 << 20, move_on_drain=True, move_timeout=120.0):
        targets = list(targets)
        if not targets:
            raise ValueError("targets: empty")
        if via_proxy and len(targets) != 1:
            raise ValueError(f"targets: via_proxy takes one target (the proxy), got {len(targets)}")
        if len(set(targets)) != len(targets) or not all(targets):
            raise ValueError("targets: an address is empty or listed twice")
        self.via_proxy = via_proxy
        self.ring = HashRing([] if via_proxy else targets, virtual_nodes)
        self._health_timeout = health_timeout
        self._unhealthy_after = unhealthy_after
        self._rpc_timeout = rpc_timeout
        self._upload_timeout = upload_timeout
        self._batch_timeout = batch_timeout
        self._per_message = max(1, max_steps_per_message)
        self._proxy_attempts = max(1, proxy_create_attempts)
        self._lock = threading.Lock()
        self._placements = {}  # sequence id -> (target index, route key)
        self._known = set()    # sequences this client created, forked, moved or used
        self._moved = 0
        self._move_on_drain = move_on_drain and not via_proxy
        self._move_timeout = move_timeout
        self._health_interval = health_interval or 0
        self._work = _WorkGate()
        self._move_lock = threading.Lock()
        self._ids = iter(range(1, 1 << 63))
        self._ids_lock = threading.Lock()
        self._stop = threading.Event()
        self._health_thread = None
        kw = dict(auth_token=auth_token, tls=tls, root_certificates=root_certificates, server_name=server_name,
                  append_chunk_bytes=append_chunk_bytes, max_reconnect_backoff_ms=1000)
        self._targets = [_Target(t) for t in targets]

        if via_proxy:
            # RPCs without a route key (GetInfo) go round-robin behind the proxy: one that
            # reached a daemon that is down is tried again.
            last = None
            for _ in range(self._proxy_attempts):
                try:
                    client = LatentdClient(targets[0], timeout=connect_timeout, **kw)
                    break
                except grpc.FutureTimeoutError:
                    raise LatentdError(grpc.StatusCode.UNAVAILABLE, f"cannot connect to {targets[0]}") from None
                except LatentdError as e:
                    last = e
                    if e.code != grpc.StatusCode.UNAVAILABLE:
                        raise
            else:
                raise last
            t = self._targets[0]
            t.client, t.healthy, t.verified = client, True, True
            self.info = client.info
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="latentd-batch")
            return

        def connect(address):
            try:
                return LatentdClient(address, timeout=connect_timeout, **kw), None
            except grpc.FutureTimeoutError:
                return None, f"cannot connect to {address}"
            except LatentdError as e:
                return None, str(e)

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(targets)) as ex:
            connected = list(ex.map(connect, targets))
        first = next((c for c, _ in connected if c is not None), None)
        if first is None:
            raise LatentdError(grpc.StatusCode.UNAVAILABLE, "no target reachable: " +
                               "; ".join(f"{a}: {e}" for a, (_, e) in zip(targets, connected)))
        self.info = first.info
        for t, (client, error) in zip(self._targets, connected):
            if client is not None:
                if not _same_model(client.info, self.info):
                    for c, _ in connected:
                        if c is not None:
                            c.close()
                    raise LatentdError(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"targets disagree on the model: {first.target} serves {_model(self.info)}, "
                                       f"{t.address} serves {_model(client.info)}")
                t.client, t.healthy, t.verified = client, True, True
            else:
                t.client = LatentdClient(t.address, info=self.info, **kw)
                t.last_error = error
            t.health = health_pb2_grpc.HealthStub(t.client.channel)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(8, 2 * len(targets)),
                                                           thread_name_prefix="latentd-batch")
        if health_interval and health_interval > 0:
            self._health_thread = threading.Thread(target=self._health_loop, args=(health_interval,),
                                                   name="latentd-health", daemon=True)
            self._health_thread.start()

    # Lifecycle.
    def close(self):
        self._stop.set()
        if self._health_thread is not None:
            self._health_thread.join()
        self._pool.shutdown(wait=True)
        for t in self._targets:
            t.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # Shape and wire format: ModelWire (h_q, h_kv, wire, unwire), of self.info (every
    # daemon serves the same model).

    @property
    def targets(self):
        return [t.address for t in self._targets]

    def client(self, target):
        """The per-daemon LatentdClient (through a proxy, target 0 is the proxy)."""
        return self._targets[target].client

    # Placement.
    def owner(self, key):
        """The daemon key hashes to (index into targets), whatever their health: the same
        in every C++ and Python client given the same targets."""
        return self.ring.owner(key)

    def _placement_locked(self, sequence_id):
        p = self._placements.get(sequence_id)
        if p is not None:
            return p
        return (0 if self.via_proxy else self.ring.owner(sequence_id)), sequence_id

    def locate(self, sequence_id):
        """Where this client sends the sequence's RPCs (always 0 through a proxy)."""
        with self._lock:
            return self._placement_locked(sequence_id)[0]

    def route_key(self, sequence_id):
        with self._lock:
            return self._placement_locked(sequence_id)[1]

    def _usable_locked(self, target):
        return self.via_proxy or (0 <= target < len(self._targets) and self._targets[target].healthy)

    def healthy(self, target):
        with self._lock:
            return self._usable_locked(target)

    def status(self):
        """[(target, healthy, last_error)] for every target."""
        with self._lock:
            return [(t.address, t.healthy, "" if t.healthy else t.last_error) for t in self._targets]

    def _down_error(self, target, sequence_id):
        t = self._targets[target]
        with self._lock:
            why = t.last_error
        return LatentdError(grpc.StatusCode.UNAVAILABLE,
                            f"sequence {sequence_id}: its daemon {t.address} is down ({why}); re-create it "
                            "(create_sequence places it on a live daemon)")

    def _mark_down(self, target, why):
        if self.via_proxy:
            return
        with self._lock:
            t = self._targets[target]
            t.healthy = False
            t.failures = max(t.failures, self._unhealthy_after)
            t.last_error = why

    # Health.
    def _health_loop(self, interval):
        while not self._stop.wait(interval):
            try:
                self.check_health()
            except Exception:  # a failed round is retried at the next interval
                pass

    def check_health(self):
        """Checks every daemon now (also done every health_interval seconds)."""
        if self.via_proxy:
            return
        req = health_pb2.HealthCheckRequest(service=_DECODE_SERVICE)
        futures = [t.health.Check.future(req, timeout=self._health_timeout) for t in self._targets]
        draining = []
        for i, (t, f) in enumerate(zip(self._targets, futures)):
            try:
                resp = f.result()
            except grpc.RpcError as e:
                with self._lock:
                    t.last_error = f"health check: {e.code().name}: {e.details()}"
                    t.failures += 1
                    if e.code() == grpc.StatusCode.UNAVAILABLE or t.failures >= self._unhealthy_after:
                        t.healthy = False
                continue
            if resp.status != health_pb2.HealthCheckResponse.SERVING:
                draining.append(i)
                with self._lock:
                    t.healthy = False
                    t.last_error = "health " + health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
                continue
            why = ""
            if not t.verified:
                # First seen up (it was down at start): it must serve the same model.
                try:
                    info = t.client.get_info(timeout=self._health_timeout)
                    if not _same_model(info, self.info):
                        why = f"serves {_model(info)}, the others {_model(self.info)}"
                except LatentdError as e:
                    why = f"GetInfo: {e}"
            with self._lock:
                if why:
                    t.healthy, t.last_error = False, why
                else:
                    t.verified, t.healthy, t.failures, t.last_error = True, True, 0, ""
        if self._move_on_drain:
            for i in draining:
                self.move_off_draining(i)

    # Draining daemons.
    @property
    def moved_sequences(self):
        """Sequences moved off draining daemons so far."""
        with self._lock:
            return self._moved

    def move_off_draining(self, target):
        """Moves every sequence this client knows on `target` to its next live daemon on
        the ring, if the target says it is draining (GetInfo); returns how many moved."""
        if self.via_proxy or not 0 <= target < len(self._targets):
            return 0
        t = self._targets[target]
        with self._move_lock:
            with self._lock:
                ids = [i for i in self._known if self._placement_locked(i)[0] == target]
                if not ids:
                    return 0
                # A daemon that is gone (not draining) is asked again only after a while.
                if not t.draining and time.monotonic() - t.last_drain_probe < self._health_interval:
                    return 0
                t.last_drain_probe = time.monotonic()
            try:
                info = t.client.get_info(timeout=self._health_timeout)
            except LatentdError:
                return 0
            if not info.draining:
                return 0
            self._mark_down(target, "draining")
            with self._lock:
                t.draining = True
            self._work.lock()  # no batch or upload of this client under way: every row is in
            moved = 0
            try:
                for sid in ids:
                    with self._lock:
                        if sid not in self._known or self._placement_locked(sid)[0] != target:
                            continue
                        to = next((c for c in self.ring.preference(sid) if c != target and self._usable_locked(c)),
                                  None)
                    if to is None:
                        break
                    try:
                        t.client.move_sequence(sid, self._targets[to].client, route=sid, timeout=self._move_timeout)
                    except LatentdError as e:
                        if e.code == grpc.StatusCode.NOT_FOUND:
                            with self._lock:
                                self._known.discard(sid)
                        continue
                    with self._lock:
                        self._placements[sid] = (to, sid)
                        self._moved += 1
                    moved += 1
            finally:
                self._work.unlock()
            return moved

    # Sequence RPCs.
    def _on_sequence(self, sequence_id, fn, timeout):
        with self._lock:
            target, route = self._placement_locked(sequence_id)
            usable = self._usable_locked(target)
        if not usable:
            raise self._down_error(target, sequence_id)
        try:
            return fn(self._targets[target].client, route, timeout)
        except LatentdError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE:
                self._mark_down(target, e.message)
            raise

    def create_sequence(self, sequence_id=""):
        """Empty id: a random one (32 hex digits), chosen here so that it can be hashed.
        Placed on the first live daemon of the id's ring walk (through a proxy: the key's
        daemon, then salted keys (salted_route) while the one tried is down)."""
        sid = sequence_id or secrets.token_hex(16)
        if self.via_proxy:
            with self._lock:
                p = self._placements.get(sid)
            routes = [p[1]] if p else []
            k = 0
            while len(routes) < self._proxy_attempts:
                r = salted_route(sid, k)
                if r not in routes:
                    routes.append(r)
                k += 1
            tried = []
            for route in routes:
                try:
                    got = self._targets[0].client.create_sequence(sid, route=route, timeout=self._rpc_timeout)
                except LatentdError as e:
                    if e.code != grpc.StatusCode.UNAVAILABLE:
                        raise
                    tried.append(f"{route}: {e.message}")
                    continue
                with self._lock:
                    self._placements[sid] = (0, route)
                    self._known.add(sid)
                return got
            raise LatentdError(grpc.StatusCode.UNAVAILABLE,
                               f"create_sequence {sid} through {self._targets[0].address}: {len(routes)} route keys "
                               f"tried, each unavailable ({'; '.join(tried)})")
        with self._lock:
            p = self._placements.get(sid)
            if p is not None and self._usable_locked(p[0]):
                candidates = [p[0]]
            else:
                candidates = [t for t in self.ring.preference(sid) if self._usable_locked(t)]
        if not candidates:
            raise LatentdError(grpc.StatusCode.UNAVAILABLE,
                               f"create_sequence {sid}: every daemon is down ({len(self._targets)} targets)")
        last = None
        for t in candidates:
            try:
                got = self._targets[t].client.create_sequence(sid, route=sid, timeout=self._rpc_timeout)
            except LatentdError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._mark_down(t, e.message)
                last = e
                continue
            with self._lock:
                self._placements[sid] = (t, sid)
                self._known.add(sid)
            return got
        raise last

    def append_kv(self, sequence_id, rows_by_layer):
        with self._lock:
            self._known.add(sequence_id)
        with self._work:
            return self._on_sequence(sequence_id, lambda c, route, timeout: c.append_kv(
                sequence_id, rows_by_layer, route=route, timeout=timeout), self._upload_timeout)

    def append_hidden(self, sequence_id, hidden_by_layer):
        """The layer API's prefill on the sequence's daemon (LatentdClient.append_hidden)."""
        return self._on_sequence(sequence_id, lambda c, route, timeout: c.append_hidden(
            sequence_id, hidden_by_layer, route=route, timeout=timeout), self._upload_timeout)

    def fork_sequence(self, sequence_id, new_sequence_id=""):
        """The fork is created beside its parent and routed there."""
        fork = new_sequence_id or secrets.token_hex(16)
        with self._lock:
            parent = self._placement_locked(sequence_id)
        with self._work:
            got = self._on_sequence(sequence_id, lambda c, route, timeout: c.fork_sequence(
                sequence_id, fork, route=route, timeout=timeout), self._rpc_timeout)
        with self._lock:
            self._placements[got] = parent
            self._known.add(got)
        return got

    def release_sequence(self, sequence_id):
        try:
            freed = self._on_sequence(sequence_id, lambda c, route, timeout: c.release_sequence(
                sequence_id, route=route, timeout=timeout), self._rpc_timeout)
        except LatentdError as e:
            if e.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                with self._lock:
                    self._placements.pop(sequence_id, None)
                    self._known.discard(sequence_id)
            raise
        with self._lock:
            self._placements.pop(sequence_id, None)
            self._known.discard(sequence_id)
        return freed

    def get_sequence(self, sequence_id):
        return self._on_sequence(sequence_id, lambda c, route, timeout: c.get_sequence(
            sequence_id, route=route, timeout=timeout), self._rpc_timeout)

    # Decode.
    def _next_id(self):
        with self._ids_lock:
            return next(self._ids)

    def decode_batch(self, steps):
        """Runs one batch of steps of any sequences; returns their StepOutputs in order.

        Each step is a dict: sequence_id, layer, q [s_q, h_q, 576], kv [s_q, h_kv, 576]
        (float arrays or raw bytes), causal, request_id and timeout_ms (optional); or, for
        a layer step, hidden [s_q, hidden_size] instead of q and kv, and position
        (optional), whose output is the layer's [s_q, hidden_size].
        """
        protos, s_q, seqs = [], {}, {}
        for s in steps:
            rid = s.get("request_id")
            rid = self._next_id() if rid is None else rid
            if rid in s_q:
                raise LatentdError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"decode_batch: request_id {rid} appears twice in one batch")
            if "hidden" in s:
                step, s_q[rid] = self._layer_step_message(rid, s["sequence_id"], s["layer"], s["hidden"],
                                                          s.get("causal", False), s.get("position"),
                                                          s.get("timeout_ms", 0))
            else:
                step, s_q[rid] = self._step_message(rid, s["sequence_id"], s["layer"], s["q"], s["kv"],
                                                    s.get("causal", False), s.get("timeout_ms", 0))
            seqs[rid] = s["sequence_id"]
            protos.append(step)
        origin = {}  # request id -> the daemon it went to (or was refused for)
        with self._work:
            results = self._decode_round(protos, seqs, origin)
        unavailable = [p for p in protos if _code_of(results[p.request_id]) == _UNAVAILABLE]
        if unavailable and self._move_on_drain:
            # Refused by a daemon that may be draining: if it is, its sequences move and
            # the refused steps (which it never ran) go again to their new daemons, once.
            # Another thread (or the health checks) may have moved them already: what
            # counts is that the refusing daemon drains and the sequence lives elsewhere.
            for t in {origin[p.request_id] for p in unavailable}:
                self.move_off_draining(t)
            with self._lock:
                again = []
                for p in unavailable:
                    now = self._placement_locked(p.sequence_id)[0]
                    src = origin[p.request_id]
                    if self._targets[src].draining and now != src and self._usable_locked(now):
                        again.append(p)
            if again:
                with self._work:
                    results.update(self._decode_round(again, seqs, {}))
        out = []
        empty = np.zeros((0,), np.float32)
        for p in protos:
            r = results[p.request_id]
            if isinstance(r, tuple):  # refused here, or no result came
                out.append(StepOutput(p.request_id, empty, empty, r[0], r[1]))
            else:
                out.append(self._step_output(r, s_q[p.request_id]))
        return out

    def _decode_round(self, protos, seqs, origin):
        """One round of a batch: {request_id: StepResult, or (code, message, None) for a
        step refused here or left without a result}; origin[request_id] is the daemon
        each step went to or was refused for."""
        results = {}
        groups = {}  # key -> (target, route, [steps])
        refused = []
        with self._lock:
            for p in protos:
                self._known.add(p.sequence_id)
                target, route = self._placement_locked(p.sequence_id)
                origin[p.request_id] = target
                if not self._usable_locked(target):
                    refused.append((p.request_id, target))
                    continue
                key = route if self.via_proxy else target
                groups.setdefault(key, (target, route, []))[2].append(p)
        for rid, target in refused:
            e = self._down_error(target, seqs[rid])
            results[rid] = (e.code.value[0], e.message, None)

        limit = 64 << 20
        if self.info.max_message_bytes > 0:
            limit = min(limit, self.info.max_message_bytes)
        limit = max(1, limit - _MESSAGE_SLACK)
        deadline = time.monotonic() + self._batch_timeout

        def run(group):
            target, route, group_steps = group
            messages, current, size = [], [], 0
            for p in group_steps:
                n = p.ByteSize() + 16
                if current and (len(current) >= self._per_message or size + n > limit):
                    messages.append(latentd_pb2.DecodeRequest(steps=current))
                    current, size = [], 0
                current.append(p)
                size += n
            messages.append(latentd_pb2.DecodeRequest(steps=current))
            got = []
            code, details = grpc.StatusCode.OK, ""
            client = self._targets[target].client
            try:
                call = client.stub.Decode(iter(messages), metadata=client.metadata(route),
                                          timeout=max(0.001, deadline - time.monotonic()))
                for resp in call:
                    got.extend(resp.results)
            except grpc.RpcError as e:
                code, details = e.code(), e.details()
            return target, route, group_steps, got, code, details

        for target, route, group_steps, got, code, details in self._pool.map(run, groups.values()):
            mine = {p.request_id for p in group_steps}
            for r in got:
                if r.request_id in mine:
                    results[r.request_id] = r
            if code == grpc.StatusCode.UNAVAILABLE:
                self._mark_down(target, details)
            missing = missing_result_code(code)
            where = self._targets[target].address + (f" (route {route})" if self.via_proxy else "")
            for p in group_steps:
                if p.request_id not in results:
                    results[p.request_id] = (missing, f"no result: the Decode stream to {where} ended with "
                                                      f"{code.name}: {details}", None)
        return results
