// ThreadSanitizer suppressions for tsan builds, compiled into every binary with the
// abseil shim (no file path to pass around: TSan asks for them by this function).
// Only reports made entirely of gRPC-internal accesses belong here: both stacks inside
// libgrpc, ordered by gRPC's own uninstrumented synchronization. A report with our
// code in either stack is a real bug and must not be suppressed. See docs/testing.md.

extern "C" const char* __tsan_default_suppressions() {
  return
      // recvmsg() on a polling thread fills a slice that an executor thread then
      // memcpy()s out; gRPC hands the slice over through its closure queues (lock-free,
      // uninstrumented), so TSan sees only the two intercepted libc calls. Seen in
      // //tests/integration:decode_test (the client side of a blocking unary call).
      "race:grpc_slice_buffer_copy_first_into_buffer\n";
}
