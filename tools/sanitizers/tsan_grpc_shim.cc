// ThreadSanitizer support for Debian's uninstrumented gRPC: makes the order between
// starting a batch (StartRead, StartWrite, Finish from any thread) and running its
// completion callback on gRPC's callback thread visible to TSan. Linked only into
// --config=tsan builds, through //third_party:grpc; see docs/testing.md.
//
// gRPC's C++ API starts every batch with grpc_call_start_batch(call, ops, n, tag) and
// runs a callback-API completion by calling tag->functor_run(tag, ok) from inside
// libgrpc. The wrapper below releases on the tag before the batch starts and points
// the functor at a trampoline that acquires on it before running gRPC's own handler
// (CallbackWithSuccessTag::StaticRun, which finalizes the batch and calls the reactor
// back). So everything a thread did before StartRead/StartWrite is ordered before
// the reactor's OnReadDone/OnWriteDone and the batch's finalization, as in gRPC.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>

#include "grpc/grpc.h"
#include "grpcpp/support/callback_common.h"

namespace {

using FunctorRun = void (*)(grpc_completion_queue_functor*, int);

// The address of gRPC's private CallbackWithSuccessTag::StaticRun: an explicit
// instantiation may name a private member, and the friend hands the pointer out.
template <FunctorRun F>
struct StaticRunOf {
  friend FunctorRun CallbackStaticRun() { return F; }
};
FunctorRun CallbackStaticRun();
template struct StaticRunOf<&grpc::internal::CallbackWithSuccessTag::StaticRun>;

void AcquireThenRun(grpc_completion_queue_functor* functor, int ok) {
  __tsan_acquire(functor);
  CallbackStaticRun()(functor, ok);
}

}  // namespace

extern "C" grpc_call_error grpc_call_start_batch(grpc_call* call, const grpc_op* ops, size_t nops,
                                                 void* tag, void* reserved) {
  using Fn = grpc_call_error (*)(grpc_call*, const grpc_op*, size_t, void*, void*);
  static const Fn real = [] {
    void* sym = dlsym(RTLD_NEXT, "grpc_call_start_batch");
    if (sym == nullptr) {
      std::fprintf(stderr, "tsan_grpc_shim: grpc_call_start_batch not found: %s\n", dlerror());
      std::abort();
    }
    return reinterpret_cast<Fn>(sym);
  }();
  if (tag != nullptr) {
    // Callback-API tags are functors whose first member is the handler; async-API tags
    // (CallOpSets) start with a vtable pointer and are left alone.
    auto* functor = static_cast<grpc_completion_queue_functor*>(tag);
    if (functor->functor_run == CallbackStaticRun()) functor->functor_run = &AcquireThenRun;
    __tsan_release(tag);
  }
  return real(call, ops, nops, tag, reserved);
}
