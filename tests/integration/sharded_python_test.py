# The Python ShardedClient against in-process fake daemons (grpc servers that keep a set
# of sequence ids and answer every step with their own name), for what a real cluster
# does not show readily: a hanging daemon costs one batch deadline and nothing more, a
# daemon down at start is found by the health checks, forks follow their parent, and
# through a proxy every Decode stream carries one route key. The real daemons and nginx
# are cluster_python_test.
import concurrent.futures
import threading
import time
import unittest

import grpc

from latentd_client import LatentdError, ShardedClient, health_pb2, health_pb2_grpc, latentd_pb2, latentd_pb2_grpc
from latentd_client import salted_route

ROUTE = "x-latentd-route"


def info():
    return latentd_pb2.ServerInfo(num_layers=2, num_heads_q=16, num_heads_kv=1, head_dim_qk=576, head_dim_v=512,
                                  page_size=64, dtype=latentd_pb2.BF16, softmax_scale=0.125,
                                  max_message_bytes=64 << 20, backend="fake")


def route_of(context):
    return dict(context.invocation_metadata()).get(ROUTE, "")


class FakeService(latentd_pb2_grpc.DecodeServiceServicer):
    def __init__(self, name):
        self.name = name
        self.lock = threading.Lock()
        self.sequences = set()
        self.streams = []  # (route, [sequence ids])
        self.hang = False
        self.refuse_own_route = False

    def GetInfo(self, request, context):
        return info()

    def CreateSequence(self, request, context):
        with self.lock:
            if self.refuse_own_route and route_of(context) == request.sequence_id:
                context.abort(grpc.StatusCode.UNAVAILABLE, "upstream down (fake)")
            if request.sequence_id in self.sequences:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, "taken")
            self.sequences.add(request.sequence_id)
        return latentd_pb2.CreateSequenceResponse(sequence_id=request.sequence_id)

    def ForkSequence(self, request, context):
        with self.lock:
            if request.sequence_id not in self.sequences:
                context.abort(grpc.StatusCode.NOT_FOUND, "unknown")
            self.sequences.add(request.new_sequence_id)
        return latentd_pb2.ForkSequenceResponse(sequence_id=request.new_sequence_id)

    def GetSequence(self, request, context):
        with self.lock:
            if request.sequence_id not in self.sequences:
                context.abort(grpc.StatusCode.NOT_FOUND, "unknown")
        return latentd_pb2.SequenceInfo(sequence_id=request.sequence_id)

    def Decode(self, request_iterator, context):
        seen, results = [], []
        for req in request_iterator:
            for s in req.steps:
                seen.append(s.sequence_id)
                with self.lock:
                    code = 0 if s.sequence_id in self.sequences else grpc.StatusCode.NOT_FOUND.value[0]
                results.append(latentd_pb2.StepResult(request_id=s.request_id, code=code, message=self.name,
                                                      out=b"\0" * (16 * 512 * 2), lse=b"\0" * (16 * 4)))
        with self.lock:
            self.streams.append((route_of(context), seen))
        if self.hang:
            while context.is_active():
                time.sleep(0.005)
            return
        yield latentd_pb2.DecodeResponse(results=results)


class FakeHealth(health_pb2_grpc.HealthServicer):
    def __init__(self):
        self.status = health_pb2.HealthCheckResponse.SERVING

    def Check(self, request, context):
        return health_pb2.HealthCheckResponse(status=self.status)


class FakeDaemon:
    def __init__(self, name, port=0):
        self.service, self.health = FakeService(name), FakeHealth()
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=16))
        latentd_pb2_grpc.add_DecodeServiceServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()
        self.target = f"127.0.0.1:{self.port}"

    def stop(self):
        self.server.stop(grace=0.1).wait()


def step(sid, rid, layer=0):
    return dict(sequence_id=sid, layer=layer, q=b"\0" * (16 * 576 * 2), kv=b"\0" * (576 * 2), request_id=rid)


class ShardedPythonTest(unittest.TestCase):
    def setUp(self):
        self.fakes = [FakeDaemon(f"fake-{i}") for i in range(3)]

    def tearDown(self):
        for f in self.fakes:
            f.stop()

    def client(self, **kw):
        args = dict(health_interval=0, connect_timeout=10, health_timeout=5, batch_timeout=20)
        args.update(kw)
        return ShardedClient([f.target for f in self.fakes], **args)

    def test_placement_batches_and_forks(self):
        with self.client() as c:
            ids = [f"s-{i}" for i in range(30)]
            for sid in ids:
                c.create_sequence(sid)
                self.assertIn(sid, self.fakes[c.owner(sid)].service.sequences)
            self.assertTrue(all(f.service.sequences for f in self.fakes))
            outs = c.decode_batch([step(sid, i) for i, sid in enumerate(ids)])
            self.assertEqual([o.request_id for o in outs], list(range(30)))
            for sid, o in zip(ids, outs):
                self.assertTrue(o.ok, o.message)
                self.assertEqual(o.message, f"fake-{c.locate(sid)}")
                self.assertEqual(o.out.shape, (1, 16, 512))
            for f in self.fakes:
                self.assertEqual(len(f.service.streams), 1)
            fork = c.fork_sequence("s-0", "s-0-fork-xyz")
            self.assertEqual(c.locate(fork), c.locate("s-0"))
            self.assertEqual(c.route_key(fork), "s-0")
            self.assertIn(fork, self.fakes[c.locate("s-0")].service.sequences)
            with self.assertRaises(LatentdError) as e:
                c.decode_batch([step("s-1", 5), step("s-2", 5)])
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            sid = c.create_sequence()
            self.assertEqual(len(sid), 32)

    def test_hanging_daemon_costs_the_deadline_only(self):
        with self.client(batch_timeout=1.0) as c:
            ids = [f"h-{i}" for i in range(30)]
            for sid in ids:
                c.create_sequence(sid)
            stuck = c.locate(ids[0])
            self.fakes[stuck].service.hang = True
            start = time.monotonic()
            outs = c.decode_batch([step(sid, i) for i, sid in enumerate(ids)])
            took = time.monotonic() - start
            self.assertGreaterEqual(took, 0.9)
            self.assertLess(took, 10)
            for sid, o in zip(ids, outs):
                want = grpc.StatusCode.DEADLINE_EXCEEDED.value[0] if c.locate(sid) == stuck else 0
                self.assertEqual(o.code, want, o.message)
            self.fakes[stuck].service.hang = False

    def test_down_daemon_fails_unavailable_and_recreates_elsewhere(self):
        with self.client() as c:
            ids = [f"d-{i}" for i in range(30)]
            for sid in ids:
                c.create_sequence(sid)
            dead = c.locate(ids[0])
            self.fakes[dead].stop()
            # Without a health check: the broken stream fails its steps and marks it down.
            outs = c.decode_batch([step(sid, i) for i, sid in enumerate(ids)])
            for sid, o in zip(ids, outs):
                self.assertEqual(o.code, 14 if c.locate(sid) == dead else 0, o.message)
            self.assertFalse(c.healthy(dead))
            start = time.monotonic()
            outs = c.decode_batch([step(ids[0], 1)])
            self.assertEqual(outs[0].code, 14)
            self.assertIn("re-create", outs[0].message)
            self.assertLess(time.monotonic() - start, 1)
            with self.assertRaises(LatentdError) as e:
                c.get_sequence(ids[0])
            self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
            c.create_sequence(ids[0])
            moved = c.locate(ids[0])
            self.assertEqual(moved, c.ring.preference(ids[0])[1])
            self.assertIn(ids[0], self.fakes[moved].service.sequences)
            self.assertTrue(c.decode_batch([step(ids[0], 2)])[0].ok)

    def test_down_at_start_found_by_health_checks(self):
        port = self.fakes[2].port
        self.fakes[2].stop()
        with self.client(connect_timeout=1, health_interval=0.05) as c:
            self.assertFalse(c.healthy(2))
            self.assertTrue(c.status()[2][2])
            self.fakes[2] = FakeDaemon("fake-2", port)
            deadline = time.time() + 10
            while not c.healthy(2) and time.time() < deadline:
                time.sleep(0.05)
            self.assertTrue(c.healthy(2), c.status())
            self.fakes[2].health.status = health_pb2.HealthCheckResponse.NOT_SERVING
            deadline = time.time() + 10
            while c.healthy(2) and time.time() < deadline:
                time.sleep(0.05)
            self.assertFalse(c.healthy(2))
            self.assertIn("NOT_SERVING", c.status()[2][2])

    def test_through_a_proxy_one_stream_per_route_key(self):
        proxy = self.fakes[0]
        with ShardedClient([proxy.target], via_proxy=True, batch_timeout=20) as c:
            steps = []
            for i in range(5):
                sid = f"p-{i}"
                c.create_sequence(sid)
                steps += [step(sid, 2 * i, 0), step(sid, 2 * i + 1, 1)]
            c.fork_sequence("p-0", "p-0-fork")
            steps.append(step("p-0-fork", 100))
            proxy.service.streams.clear()
            self.assertTrue(all(o.ok for o in c.decode_batch(steps)))
            self.assertEqual(len(proxy.service.streams), 5)
            for route, seqs in proxy.service.streams:
                self.assertTrue(all(c.route_key(s) == route for s in seqs), (route, seqs))
            proxy.service.refuse_own_route = True
            c.create_sequence("moved")
            self.assertEqual(c.route_key("moved"), salted_route("moved", 1))
            self.assertTrue(c.decode_batch([step("moved", 1)])[0].ok)
            proxy.stop()
            outs = c.decode_batch([step("p-1", 1), step("p-2", 2)])
            self.assertEqual([o.code for o in outs], [14, 14])


if __name__ == "__main__":
    unittest.main(verbosity=2)
