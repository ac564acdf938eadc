// The engine's value types: model shape and options, sequence state, decode steps and
// their callback, metrics. The facade (engine/engine.h), the scheduler and the backends
// all speak them; this header belongs to //engine:types alone.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/tensor_location.h"
#include "kernels/params.h"

namespace latentd::engine {

namespace model {
struct ModelConfig;       // engine/model/config.h
struct AttentionWeights;  // engine/model/weights.h
}  // namespace model

enum class BackendKind { kAuto, kCuda, kCpu };

struct ModelConfig {
  int num_layers = 1;
  int num_heads_q = 16;
  int num_heads_kv = 1;
  kernels::DType dtype = kernels::DType::kBF16;
  float softmax_scale = 0.f;  // 0 = 1/sqrt(576)
  // How the CUDA backend rounds P of a bf16 model for the PV product: split (default,
  // the tighter contract) or once (faster on compute-bound calls, FlashMLA's accuracy
  // class); docs/p-rounding.md. fp16 models and the CPU backend (P in fp32) ignore it.
  kernels::PRounding p_rounding = kernels::PRounding::kSplit;
};

struct EngineOptions {
  ModelConfig model;
  BackendKind backend = BackendKind::kAuto;
  int device = 0;
  // KV pool size: exactly one of these is used, in this order of precedence.
  int64_t kv_pages = 0;
  int64_t kv_bytes = 0;
  double kv_memory_fraction = 0.0;  // of free GPU memory (CUDA) or of physical RAM (CPU)
  // How the pool stores rows: in the model dtype, or quantized to fp8_e4m3
  // (kernels/kv_fp8.h) as they are appended. Clients send 16-bit rows either way.
  kernels::KvDType kv_dtype = kernels::KvDType::kModel;
  int max_batch_size = 64;          // steps per launch
  int max_batch_tokens = 1024;      // query rows (sum of s_q) per launch
  int max_queue = 4096;             // queued steps before submissions are refused
  // How long an idle scheduler waits for more steps before launching; a SubmitBatch of
  // two or more steps (one DecodeRequest) ends it at once.
  absl::Duration batch_window = absl::Microseconds(50);
  // How long the scheduler spins, after a batch, for the next steps before it sleeps:
  // a step submitted within it is picked up without a wake-up (tens of microseconds on
  // a busy host) at the cost of a core while it spins. 0 = sleep at once.
  absl::Duration idle_spin = absl::ZeroDuration();
  int max_s_q = 8;                  // largest s_q a step may carry
  int cpu_threads = 0;              // CPU backend threads, 0 = all
  // Threads that run StepDone callbacks, so the scheduler does not answer each step of
  // a batch itself before staging the next (engine/completion_pool.h); 0 = on the
  // scheduler thread. Steps of one flow complete in order either way, except that steps
  // marked DecodeStep::complete_inline are always answered on the scheduler thread, so
  // they keep their order among themselves but not against the flow's other steps.
  int completion_threads = 4;
  // Live sequences (forks included) before CreateSequence and ForkSequence fail
  // RESOURCE_EXHAUSTED; 0 = unlimited. Bounds the bookkeeping a client can pile up.
  int64_t max_sequences = 0;
  // The host memory tier (docs/operations.md "Host tier"): bytes of host memory (pinned
  // on CUDA) that idle sequences' rows move to under pool pressure, or after
  // offload_idle unused; a step, append or fork of an offloaded sequence brings
  // it back first. 0 = no tier (a full pool refuses with RESOURCE_EXHAUSTED).
  int64_t host_kv_bytes = 0;
  // Tests only: called between two chunks of a large AppendKv, with the KV lock
  // released (to show that other work proceeds meanwhile). Empty in production.
  std::function<void()> on_append_chunk_for_testing;
  // Tests only: called inside SubmitBatch between two steps' pushes (to show that the
  // scheduler waits for the whole message). Empty in production.
  std::function<void()> on_batch_submit_for_testing;
  // How long the scheduler waits for a SubmitBatch under way before forming a batch
  // anyway (queueing a message's steps takes microseconds; this bounds a submitter
  // that was descheduled).
  absl::Duration batch_submit_wait = absl::Milliseconds(2);
  // The attention layer as a service (docs/mla-layer-server.md): the checkpoint's
  // config.json and this rank's attention weights of every layer. With both set, steps
  // and uploads may carry hidden states (DecodeStep::hidden, AppendHidden); the model
  // above must then match them (num_layers, num_heads_q = the rank's heads, h_kv 1,
  // dtype, softmax_scale). Null: the kernel-level API only.
  std::shared_ptr<const model::ModelConfig> layer_config;
  std::shared_ptr<const model::AttentionWeights> layer_weights;
  // Positions [0, layer_max_positions) get a rotary table entry; 0 = config.json's
  // max_position_embeddings (32768 when absent).
  int layer_max_positions = 0;
};

struct EngineInfo {
  ModelConfig model;
  std::string backend;  // "cuda:<device name>" or "cpu"
  int64_t total_pages = 0;
  int64_t free_pages = 0;
  int max_batch_size = 0;
  kernels::KvDType kv_dtype = kernels::KvDType::kModel;  // name: kernels::KvDTypeName
  int64_t kv_bytes_per_token = 0;  // pool bytes one token takes, every layer and KV head
  // The layer API (EngineOptions::layer_weights): whether it is served, the model's
  // hidden size, and the bytes its weights take where the layer math holds them.
  bool layer_api = false;
  int hidden_size = 0;
  int max_positions = 0;
  int64_t weight_bytes = 0;
};

struct SequenceLengths {
  std::string sequence_id;
  std::vector<int64_t> lengths;  // per layer, after the operation
};

// What a client needs to resynchronise with a sequence after losing track of it (a
// reconnect, a failed upload): its rows per layer and the pages behind them.
// What CreateSequence made: the id, and how many leading rows per layer it found in the
// prefix cache (every layer starts that long; the client uploads only the rest).
struct CreatedSequence {
  std::string sequence_id;
  int64_t prefix_tokens = 0;  // a multiple of 64
};

// A page content key on the wire: 16 bytes (kv::PageKey, big-endian hi then lo).
inline constexpr size_t kPageKeyBytes = 16;

struct SequenceInfo {
  std::string sequence_id;
  std::vector<int64_t> lengths;  // rows per layer
  int64_t pages = 0;             // pages its block table holds (shared ones included)
  int64_t shared_pages = 0;      // of those, pages another sequence (a fork) also holds
  absl::Time last_used;          // last create, append or decode step (for the idle TTL)
  bool offloaded = false;        // in the host tier (pages 0 until brought back)
};

// Moving a sequence between engines (docs/export-import.md): what its rows are. An
// export fills every field; an import must name the importing pool's shape and storage
// format exactly (the rows are copied as stored, never converted).
inline constexpr int kExportFormatVersion = 1;
struct SequenceExportHeader {
  int format_version = kExportFormatVersion;
  int num_layers = 0;
  int num_heads_kv = 0;
  int page_size = 0;  // tokens per page (kernels::kPageSize)
  kernels::DType dtype = kernels::DType::kBF16;  // the model dtype
  std::string kv_dtype;   // kernels::KvDTypeName of the pool: "bf16", "fp16" or "fp8_e4m3"
  int64_t row_bytes = 0;  // stored bytes of one token of one layer (every KV head)
  std::string sequence_id;
  std::vector<int64_t> lengths;  // rows per layer
  // Content keys (kPageKeyBytes each) of the leading full pages that hold a published
  // prefix-cache key; an importer publishes them as its own.
  std::vector<std::string> page_keys;
};

// One piece of an export: rows [first_row, first_row + rows) of one layer, as stored.
struct SequenceExportChunk {
  int layer = 0;
  int64_t first_row = 0;
  int64_t rows = 0;
  std::string bytes;  // rows * header.row_bytes
};

// Device memory opened from another process's CUDA IPC handle.
struct DeviceMemory {
  uint64_t address = 0;  // the device address of the requested range's first byte
  uint64_t mapping = 0;  // what the backend opened (the allocation's base), for closing
};

// One decode step. The caller owns every buffer and keeps them (and the step) alive
// until StepDone has been called for it.
struct DecodeStep;

class StepCallback {
 public:
  virtual ~StepCallback() = default;
  // Called exactly once per accepted step, on an engine thread: OK means out and lse
  // were written. Must not block.
  virtual void StepDone(DecodeStep* step, absl::Status status) = 0;
  // Steps of this callback that finished together (of one batch, in the order they
  // were submitted), so a caller answering many steps of one stream takes its locks
  // once. The default calls StepDone for each. Must not block.
  virtual void StepsDone(DecodeStep* const* steps, const absl::Status* statuses, int n) {
    for (int i = 0; i < n; ++i) StepDone(steps[i], statuses[i]);
  }
};

struct DecodeStep {
  uint64_t request_id = 0;
  // The submitter's fairness key (for example one per gRPC stream): each batch shares
  // its query rows fairly between the flows with steps waiting, and steps of one flow
  // launch in the order submitted. 0 = the step's sequence is its own flow.
  uint64_t flow = 0;
  std::string sequence_id;
  int layer = 0;
  int s_q = 1;
  bool causal = false;
  // Where each tensor lies (engine/tensor_location.h). q and kv are of one kind, and so
  // are out and lse: in plain host memory the backend stages them; in a registered host
  // region or a device region the device reads (writes) them in place.
  TensorLocation q;    // [s_q, h_q, 576] raw values in the model dtype
  TensorLocation kv;   // [s_q, h_kv, 576] the new tokens' latent rows
  TensorLocation out;  // [s_q, h_q, 512] model dtype, written on success
  TensorLocation lse;  // [h_q, s_q] float32
  // A layer step (the attention layer as a service): the tokens' hidden states instead
  // of q and kv, and the layer's output instead of out and lse. The caller leaves q, kv,
  // out and lse unset; the engine points them at its own buffers while the step runs
  // and unsets them again before StepDone.
  TensorLocation hidden;     // [s_q, hidden_size] model dtype
  TensorLocation layer_out;  // [s_q, hidden_size] model dtype, written on success
  int64_t position = -1;     // RoPE position of the first token; -1: the layer's length
  absl::Time deadline = absl::InfiniteFuture();
  const std::atomic<bool>* cancelled = nullptr;  // caller gone: drop if not launched
  StepCallback* callback = nullptr;
  // The callback only publishes results where the client polls for them (a doorbell
  // ring's completion queue: memory stores and at most a futex wake), so the scheduler
  // runs it itself when the batch finishes instead of handing it to a completion
  // thread, whose wake-up would sit between the results and the client.
  bool complete_inline = false;
  // Engine bookkeeping. The times are set for every step (a store each): when it was
  // queued, put into a batch, launched (rows appended, inputs staged) and finished
  // (results in out/lse); the server reports them to clients that trace a step.
  absl::Time enqueued_at;
  absl::Time batched_at, launched_at, finished_at;
  // The message (Engine::SubmitBatch) this step came in, or 0 for a lone step: a
  // message's consecutive steps in one flow launch together when they fit one launch.
  uint64_t unit = 0;
  void* engine_private = nullptr;
};

// Whether the device reads the step's q and kv in place, and writes its out and lse in
// place (no staging copy on the host).
inline bool IsLayerStep(const DecodeStep& s) { return s.hidden.set(); }
inline bool InputsDeviceDirect(const DecodeStep& s) { return s.q.device_direct() && s.kv.device_direct(); }
inline bool OutputsDeviceDirect(const DecodeStep& s) { return s.out.device_direct() && s.lse.device_direct(); }

struct EngineMetrics {
  double steps_per_second = 0;  // over the last few seconds
  uint64_t steps_completed = 0;
  uint64_t batches = 0;
  std::vector<uint64_t> batch_size_histogram;  // bucket i: batches of size in [2^i, 2^(i+1))
  double queue_wait_us_p50 = 0, queue_wait_us_p90 = 0, queue_wait_us_p99 = 0;
  double exec_us_p50 = 0, exec_us_p90 = 0, exec_us_p99 = 0;
  int64_t pages_used = 0, pages_free = 0, pages_high_water = 0;
  // The prefix cache: pages_cached are unreferenced pages that keep their rows (counted
  // in pages_free too); hits and misses count pages; saved bytes are the rows attached
  // instead of uploaded, over all layers, in the client's input format.
  int64_t pages_cached = 0, pages_keyed = 0;
  uint64_t prefix_hit_pages = 0, prefix_miss_pages = 0, prefix_evictions = 0, prefix_bytes_saved = 0;
  uint64_t rejected_queue_full = 0, rejected_out_of_pages = 0, rejected_invalid = 0,
           rejected_deadline = 0, dropped_cancelled = 0;
  uint64_t rejected_max_sequences = 0;  // CreateSequence/ForkSequence at max_sequences
  int64_t queued_steps = 0;
  int64_t sequences = 0;
  // Fair sharing: flows with steps waiting now; of the last batch, the flows it served
  // and the most query rows one flow got.
  int64_t waiting_flows = 0;
  int last_batch_flows = 0;
  int last_batch_max_flow_rows = 0;
  // AppendKv copies in chunks, dropping the KV lock in between; chunks copied so far.
  uint64_t append_chunks = 0;
  // Export and import (docs/export-import.md): sequences whose export completed or
  // whose import was committed, their row bytes, and imports that failed or were
  // abandoned (each left nothing behind).
  uint64_t sequences_exported = 0, export_bytes = 0;
  uint64_t sequences_imported = 0, import_bytes = 0, import_failures = 0;
  // The host tier: its size and use, sequences moved out and back (and the time the
  // restores took, summed), offloads refused because the tier was full, restores that
  // failed (the sequence stayed offloaded; the step or call that needed it failed).
  int64_t host_tier_capacity_bytes = 0, host_tier_used_bytes = 0, host_tier_sequences = 0;
  uint64_t host_offloads = 0, host_restores = 0, host_offload_refused = 0, host_restore_failures = 0;
  double host_restore_seconds = 0;
};

}  // namespace latentd::engine
