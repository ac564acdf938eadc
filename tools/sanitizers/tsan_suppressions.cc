// ThreadSanitizer suppressions for tsan builds, compiled into every binary with the
// abseil shim (no file path to pass around: TSan asks for them by this function).
// Only gRPC-internal handoffs belong here: memory of gRPC's own objects passed between
// gRPC threads by gRPC's uninstrumented completion queues, executors and refcounts,
// which TSan cannot see. A race between our own threads, or on our own data, is a real
// bug and must not be suppressed. See docs/testing.md.
//
// (Intercepted libc calls made from inside libgrpc, such as sendmsg/recvmsg and memcpy
// on gRPC's slices, are already ignored by ignore_noninstrumented_modules=1 in
// TSAN_OPTIONS.)
//
// race_top matches only the top frame of either access's stack, so these do not hide
// reports in which gRPC code merely appears further down (our callbacks are all called
// from gRPC frames).

extern "C" const char* __tsan_default_suppressions() {
  return
      // When a batch completes, gRPC's callback thread finalizes it
      // (CallOpSet::FinalizeResult: the ops' FinishOp, interceptor hooks, parsing a
      // received message into the reactor's request) before calling the reactor back.
      // The batch was started by whichever thread called StartRead/StartWrite (gRPC's,
      // the engine's or the upload thread), after it was done with that message; the
      // completion reaches the callback thread through gRPC's completion queue, which
      // TSan does not see, so every access on the finalizing side looks unordered.
      // Seen in //tests/integration:errors_test, lifecycle_test, decode_test and the
      // service fuzz regression tests (e.g. AppendKvReactor::Apply reading request_
      // before StartRead, then the parse of the next message into it). Our own
      // callbacks run after FinalizeResult has returned, so they stay checked; the
      // cost is that a message gRPC is parsing or serializing cannot be checked
      // against our accesses (ASan and the fuzzers cover misuse of those).
      "race:grpc::internal::CallOpSet*::FinalizeResult\n"
      // Our StartRead/StartWrite start a batch from any thread; gRPC's per-call
      // bookkeeping read back on completion (Call::client_rpc_info etc.) has the same
      // invisible ordering.
      "race_top:grpc::internal::Call::\n"
      // gRPC calls a reactor's OnReadDone/OnWriteDone (a virtual call: the vptr read)
      // on its callback thread, drops its reference, and once the last one is gone
      // runs OnDone (where reactors delete themselves) on its executor thread; the
      // handoff goes through gRPC's executor queue, so the destructor's vptr write
      // looks unordered with the earlier virtual call. A reactor deleted too early
      // would show the same way here, but ASan reports that as a use-after-free.
      // Seen in //tests/integration:errors_test and abuse_test (AppendKvReactor).
      "race_top:grpc::internal::Callback*Handler*::SetupReactor\n"
      // The same handoff for gRPC's own completion tags: the callback thread reads a
      // tag's function to run it, the executor thread destroys the tag with the call
      // object after OnDone (CallbackWithSuccessTag::Clear). Seen in errors_test.
      "race:grpc::internal::CallbackWithSuccessTag::Clear\n"
      // The callback thread reads a completed tag's function (StaticRun) before the
      // call's last reference goes and gRPC's executor destroys the call object
      // (CallOnDone): ordered by gRPC's refcount and executor queue.
      // Seen in //tests/integration:errors_test.
      "race_top:grpc::internal::CallbackWithSuccessTag::StaticRun\n"
      // The ops of a reactor's Finish batch (their interceptor hooks) are set up on
      // the thread that called Finish and destroyed with the call object when gRPC's
      // executor runs CallOnDone after the last reference is gone: ordered by gRPC's
      // refcount and executor queue. Matched on the destructor of gRPC's own
      // interceptor state, so our OnDone (called further down the same stack) stays
      // checked. Seen in //tests/integration:stress_test (stream churn).
      "race:grpc::internal::InterceptorBatchMethodsImpl::~InterceptorBatchMethodsImpl\n"
      // The same object at the other end of its life: gRPC's server arms each request
      // (Server::CallbackRequest, on its executor thread) with an interceptor state
      // whose constructor writes its vptr and hook flags, and runs the call's server
      // interceptors on another thread once a call arrives, handed over through its
      // completion queue. The constructor is inline in gRPC's headers; its
      // instrumented copy in our binary is what libgrpc++ calls (-rdynamic), so the
      // write is seen and the handoff is not. Matched on the top frame of the write
      // only: what our interceptors do with the call stays checked.
      // Seen in //tests/integration:auth_test (HealthWatchLimit::Intercept, the
      // virtual call to QueryInterceptionHookPoint, server/auth.cc).
      "race_top:grpc::internal::InterceptorBatchMethodsImpl::InterceptorBatchMethodsImpl\n"
      // The same handoff for the Finish batch's status op: Finish stores the status
      // message (CallOpServerSendStatus::ServerSendStatus) on the reactor's thread,
      // and gRPC's executor destroys it with the call object in CallOnDone. Matched on
      // gRPC's own destructor, so our OnDone stays checked.
      // Seen in //tests/integration:errors_test (AppendKvReactor refusing a message).
      "race:grpc::internal::CallOpServerSendStatus::~CallOpServerSendStatus\n"
      // A client's callback unary call: CallbackUnaryCallImpl's constructor sets up
      // its completion tag (the function to run) on the calling thread, and gRPC's
      // callback thread reads it when the call completes (CallbackWithStatusTag::Run),
      // ordered by gRPC's completion queue. Matched on the top frame only, so the
      // user callback Run then calls stays checked.
      // Seen in //tests/integration:abuse_test (the abusers' unary calls).
      "race_top:grpc::internal::CallbackWithStatusTag::Run\n"
      // recvmsg() on a polling thread fills a slice that an executor thread then
      // memcpy()s out (both inside libgrpc). Kept in case a Debian build makes libgrpc
      // look instrumented to ignore_noninstrumented_modules.
      // Seen in //tests/integration:decode_test (the client of a blocking unary call).
      "race:grpc_slice_buffer_copy_first_into_buffer\n"
      // gRPC's own threads (timer, executor) finish without being joined at exit.
      // Seen in //tests/integration:decode_test.
      "thread:grpc_core::Thread::Thread\n";
}
