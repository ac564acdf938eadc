// The engine facade the server talks to: model shape, sequences and their KV cache,
// and decode steps submitted from any thread and batched by the scheduler into one
// attention launch. Nothing here blocks on a batch: results come back through
// StepCallback on the engine's own thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/types.h"

namespace latentd::engine {

// Reads one sequence out in bounded pieces (Engine::ExportSequence). Each Next holds
// the KV lock for one piece only, so decoding goes on between pieces; rows appended
// after the export began are not part of it. One thread at a time; must not outlive
// the engine.
class SequenceExporter {
 public:
  virtual ~SequenceExporter() = default;
  // The pool's shape and format and the sequence's lengths when the export began.
  virtual const SequenceExportHeader& header() const = 0;
  // The next rows in order (layer 0 rows 0.., then layer 1, ...): at most max_bytes of
  // them, at least one row. false once every row has been read (chunk untouched).
  // NOT_FOUND (sequence_id) when the sequence was released since the export began,
  // ABORTED when a layer became shorter than the header says (a failed upload rolled
  // it back).
  virtual absl::StatusOr<bool> Next(size_t max_bytes, SequenceExportChunk* chunk) = 0;
  // Rows read so far over every layer, and zlib's crc32 of their bytes in order.
  virtual int64_t total_rows() const = 0;
  virtual uint32_t crc32() const = 0;
};

// Builds one sequence from an export's pieces (Engine::ImportSequence). Every page it
// needs was reserved when it began; rows are written as they are stored (fp8 rows stay
// byte for byte); the sequence exists only after Commit. Destroyed without a
// successful Commit, it gives every page back: nothing is left behind. One thread at a
// time; must not outlive the engine.
class SequenceImporter {
 public:
  virtual ~SequenceImporter() = default;
  // The next rows, in the export's order. INVALID_ARGUMENT naming layer, first_row or
  // rows (with what was expected) for rows out of order, of a partial row, or past the
  // layer's length in the header.
  virtual absl::Status Write(int layer, int64_t first_row, absl::string_view rows) = 0;
  // Checks that every row came (FAILED_PRECONDITION naming rows otherwise) and that
  // total_rows and crc32 are those of what was written (INVALID_ARGUMENT naming them),
  // then creates the sequence and publishes the header's page keys: ALREADY_EXISTS if
  // its id was taken meanwhile, RESOURCE_EXHAUSTED at max_sequences. Once only; after
  // a failure the importer holds nothing.
  virtual absl::StatusOr<SequenceLengths> Commit(int64_t total_rows, uint32_t crc32) = 0;
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  virtual ~Engine() = default;

  virtual EngineInfo Info() const = 0;

  // Empty id: the engine makes an unguessable one. ALREADY_EXISTS for a taken id,
  // INVALID_ARGUMENT for a malformed one, RESOURCE_EXHAUSTED at max_sequences.
  virtual absl::StatusOr<std::string> CreateSequence(absl::string_view sequence_id) = 0;
  // The same, with the content keys of the prefix's full 64-token pages in order
  // (kPageKeyBytes each; clients/ compute them from token ids): every leading page the
  // prefix cache holds is attached by reference (docs/prefix-cache.md). INVALID_ARGUMENT
  // naming page_keys[i] for a key of another size, or page_keys for more keys than the
  // pool has pages.
  virtual absl::StatusOr<CreatedSequence> CreateSequenceWithPrefix(absl::string_view sequence_id,
                                                                   const std::vector<std::string>& page_keys) = 0;
  // Appends n = kv.size() / (h_kv * 576 * 2) rows to one layer. All or nothing:
  // RESOURCE_EXHAUSTED when pages run out. Large uploads are copied in chunks with the
  // KV lock dropped in between, so other clients' steps keep launching. Decoding or
  // appending to the same (sequence, layer) while it uploads is the caller's mistake:
  // the rows then interleave in an undefined order (and a failing upload truncates
  // the layer back to its length before the upload, other rows included), but the
  // cache stays consistent. NOT_FOUND if the sequence is released meanwhile.
  virtual absl::StatusOr<SequenceLengths> AppendKv(absl::string_view sequence_id, int layer,
                                                   absl::string_view kv) = 0;
  // The layer API (EngineOptions::layer_weights): appends the latent rows of
  // n = hidden.size() / (hidden_size * 2) hidden states, computed at positions
  // length .. length + n - 1 of the layer. As AppendKv otherwise; ABORTED when rows
  // were appended to the layer meanwhile, FAILED_PRECONDITION without layer weights.
  virtual absl::StatusOr<SequenceLengths> AppendHidden(absl::string_view sequence_id, int layer,
                                                       absl::string_view hidden) {
    return absl::FailedPreconditionError("hidden: this engine serves the kernel-level API only");
  }
  // RESOURCE_EXHAUSTED at max_sequences (a fork is a sequence like any other).
  virtual absl::StatusOr<std::string> ForkSequence(absl::string_view sequence_id,
                                                   absl::string_view new_sequence_id) = 0;
  // Lengths and pages of one sequence; NOT_FOUND (field sequence_id) for an unknown
  // one. A read: it does not count as use for the idle TTL.
  virtual absl::StatusOr<SequenceInfo> GetSequence(absl::string_view sequence_id) const = 0;
  // Returns the number of pages freed (pages still shared with forks are not freed).
  virtual absl::StatusOr<int64_t> ReleaseSequence(absl::string_view sequence_id) = 0;
  // Releases every sequence idle for longer than ttl (unused since now - ttl); returns
  // how many. Works oldest first in small batches, dropping the KV lock in between, so
  // a large sweep does not stall decoding.
  virtual int ReleaseIdleSequences(absl::Duration ttl) = 0;
  // Moves sequences unused for longer than idle to the host tier (EngineOptions::
  // host_kv_bytes), least recently used first, until none is left or the tier is full;
  // returns how many moved. Each sequence's rows are read with the KV lock held for a
  // bounded piece at a time; one used meanwhile stays where it is. 0 without a tier.
  virtual int OffloadIdleSequences(absl::Duration idle) = 0;

  // Export and import (docs/export-import.md). NOT_FOUND for an unknown sequence.
  virtual absl::StatusOr<std::unique_ptr<SequenceExporter>> ExportSequence(absl::string_view sequence_id) = 0;
  // sequence_id: the id to create; empty: header.sequence_id. INVALID_ARGUMENT naming
  // header.<field> ("header.num_heads_kv: expected 1, got 2") for another shape or
  // storage format, ALREADY_EXISTS for a taken id, RESOURCE_EXHAUSTED (header.lengths)
  // when the free pages cannot hold the sequence, or at max_sequences.
  virtual absl::StatusOr<std::unique_ptr<SequenceImporter>> ImportSequence(const SequenceExportHeader& header,
                                                                          absl::string_view sequence_id) = 0;

  // Never blocks. An error return means the step was not accepted (bad field, unknown
  // sequence, full queue, draining) and its callback will not run; OK means StepDone
  // will be called exactly once.
  virtual absl::Status Submit(DecodeStep* step) = 0;
  // Submits n steps as one unit: when n is at most max_batch_size, the scheduler does
  // not form a batch from a part of them while the rest are being queued, so steps that
  // fit one launch run in one launch. statuses[i] is Submit's answer for steps[i].
  // Never blocks.
  virtual void SubmitBatch(DecodeStep* const* steps, int n, absl::Status* statuses) {
    for (int i = 0; i < n; ++i) statuses[i] = Submit(steps[i]);
  }

  // Host memory that steps' tensors will lie in for a while (a same-host client's shared
  // region). Returns the device address of `base` when the backend moves tensors there
  // directly (CUDA: the memory is pinned and mapped; this takes time, about that of
  // touching every page once), 0 when it does not; steps then place their tensors with
  // TensorLocation::InHostRegion({base, address, bytes}, ...), or as plain host bytes
  // for 0. Unregister only when no step using it is in flight.
  virtual uint64_t RegisterHostMemory(void* base, size_t bytes) { return 0; }
  virtual void UnregisterHostMemory(void* base) {}

  // Device memory of another process on this host (a client's tensors on the GPU),
  // given as a CUDA IPC handle: opened for the device, with [offset, offset + bytes)
  // checked to lie inside the allocation. Steps whose tensors lie there place them
  // with TensorLocation::InDeviceRegion({nullptr, address, bytes}, ...): the backend
  // moves them with the device only.
  // INVALID_ARGUMENT for a handle the driver refuses or a range outside the allocation,
  // FAILED_PRECONDITION on the CPU backend. Close only when no step using it is in
  // flight.
  virtual absl::StatusOr<DeviceMemory> OpenDeviceMemory(absl::string_view ipc_handle, uint64_t offset,
                                                        uint64_t bytes) {
    return absl::UnimplementedError("open_cuda_region: not supported by this engine");
  }
  virtual void CloseDeviceMemory(const DeviceMemory& memory) {}

  virtual EngineMetrics Metrics() const = 0;

  // Stops accepting steps (UNAVAILABLE) and waits up to timeout for accepted ones.
  // Returns true when everything accepted has completed.
  virtual bool Drain(absl::Duration timeout) = 0;
};

}  // namespace latentd::engine
