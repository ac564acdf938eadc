# The Python client's consistent-hash ring against the table the C++ client checks too
# (clients/cpp/testdata/ring_table.txt, //clients/cpp:hash_ring_test): both place every
# sequence on the same daemon. Plus the FNV-1a test vectors and the ring's properties.
import collections
import os
import unittest

from latentd_client import HashRing, route_hash, salted_route
from latentd_client.sharded import fnv1a64

RUNFILES = os.path.join(os.environ.get("TEST_SRCDIR", "."), os.environ.get("TEST_WORKSPACE", "latentd"))
TABLE = os.path.join(RUNFILES, "clients/cpp/testdata/ring_table.txt")


def key(field):
    return "" if field == "<empty>" else field


class RingTest(unittest.TestCase):
    def test_fnv1a_known_values(self):
        self.assertEqual(fnv1a64(b""), 0xCBF29CE484222325)
        self.assertEqual(fnv1a64(b"a"), 0xAF63DC4C8601EC8C)
        self.assertEqual(fnv1a64(b"foobar"), 0x85944171F73967E8)

    def test_table_shared_with_cpp(self):
        rings, checked = {}, 0
        with open(TABLE) as f:
            for line in f:
                line = line.rstrip("\n")
                if not line or line.startswith("#"):
                    continue
                w = line.split(" ")
                if w[0] == "ring":
                    rings[w[1]] = HashRing(w[3:], int(w[2]))
                elif w[0] == "hash":
                    self.assertEqual(f"{route_hash(key(w[1])):016x}", w[2], line)
                    checked += 1
                elif w[0] == "owner":
                    self.assertEqual(str(rings[w[1]].owner(key(w[2]))), w[3], line)
                    checked += 1
                elif w[0] == "preference":
                    self.assertEqual(",".join(map(str, rings[w[1]].preference(key(w[2])))), w[3], line)
                    checked += 1
                elif w[0] == "salted":
                    self.assertEqual(salted_route(key(w[1]), int(w[2])), w[3], line)
                    checked += 1
                else:
                    self.fail(f"unknown line: {line}")
        self.assertGreater(checked, 100)

    def test_spread_order_and_minimal_movement(self):
        three = HashRing(["127.0.0.1:50051", "127.0.0.1:50052", "127.0.0.1:50053"])
        n = 30000
        count = collections.Counter(three.owner(f"seq-{i}") for i in range(n))
        for t in range(3):
            self.assertTrue(n / 3 * 0.75 < count[t] < n / 3 * 1.25, count)
        a, b = HashRing(["x:1", "y:1", "z:1"]), HashRing(["z:1", "x:1", "y:1"])
        for i in range(1000):
            self.assertEqual(a.targets[a.owner(f"k{i}")], b.targets[b.owner(f"k{i}")])
        four, fewer = HashRing(["h:1", "h:2", "h:3", "h:4"]), HashRing(["h:1", "h:2", "h:4"])
        for i in range(3000):
            k = f"seq-{i}"
            before, after = four.targets[four.owner(k)], fewer.targets[fewer.owner(k)]
            if before != "h:3":
                self.assertEqual(before, after, k)
            else:
                self.assertEqual(after, four.targets[four.preference(k)[1]], k)
        self.assertEqual(HashRing([]).owner("x"), -1)


if __name__ == "__main__":
    unittest.main(verbosity=2)
