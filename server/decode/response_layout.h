// How a Decode stream's results reach the client. A message's successful byte steps
// get their StepResult laid out in shared response buffers before they run (LayOut), so
// the engine writes out where gRPC sends it from; answered steps are then coalesced
// into one DecodeResponse per write (FillResponse), laid-out results as slices of those
// buffers and the others serialized between them. Ring steps' results are completion
// entries instead (FillCompletion).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "proto/ring.h"
#include "proto/wire.h"
#include "server/decode/step_shape.h"
#include "server/decode/step_slot.h"

namespace latentd::server::decode {

// Lays out the results of the successful byte steps among slots[0, n) in buffers of
// about `cap` bytes each (a buffer stays alive while gRPC holds any result in it, so
// smaller ones give memory back sooner): sets each one's out (host bytes inside its
// part), part and part_tail.
// Region steps and failed ones are left alone.
void LayOut(Slot* const* slots, int n, const StepShape& sh, size_t cap);

// A successful byte step's result inside the response, out included.
size_t ResultBytes(const Slot* s, const StepShape& sh);

// Serializes the first answered slots of done[0, n) into *response, at most `cap`
// bytes of them (at least one result); returns how many it took. Traced ones get their
// timing stamped with `now`. The slots keep their parts: the caller recycles them
// (DropPart) once it has counted them. `parts` is scratch, kept to allocate nothing.
size_t FillResponse(Slot* const* done, size_t n, int64_t cap, absl::Time now, std::vector<grpc::Slice>* parts,
                    grpc::ByteBuffer* response);

// A ring step's completion entry: code, message (cut to ring::kMaxMessage) and, for a
// traced step, its timing stamped with `now`.
void FillCompletion(Slot* s, absl::Time now, ring::CqEntry* c);

}  // namespace latentd::server::decode
