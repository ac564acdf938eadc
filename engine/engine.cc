// The engine: sequences and their KV pages, and the scheduler loop that batches every
// caller's decode steps into one launch (continuous batching, rows shared fairly
// between flows, FIFO within a flow and per (sequence, layer), at most one step per
// (sequence, layer) per batch, while the previous batch computes).
#include "engine/engine.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/hash/hash.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine/attention_backend.h"
#include "engine/batch.h"
#include "engine/completion_pool.h"
#include "engine/fair_queue.h"
#include "engine/kv/host_tier.h"
#include "engine/layer_stage.h"
#include "engine/model/config.h"
#include "engine/metrics.h"
#include "engine/step_queue.h"
#include "kernels/params.h"
#include "zlib.h"

namespace latentd::engine {
namespace {

using kernels::kHeadDimQK;
using kernels::kHeadDimV;

// AppendKv copies at most this much per hold of the KV lock: about a millisecond of
// memcpy, so a 60 MiB upload delays other clients' batches by that, not by the whole
// copy. Rounded down to whole pages (at least one).
constexpr size_t kAppendChunkBytes = size_t{1} << 20;
// ReleaseIdleSequences releases at most this many sequences per hold of the KV lock.
constexpr int kIdleReleaseBatch = 256;

// zlib's crc32 takes 32-bit lengths.
uint32_t Crc32(uint32_t crc, absl::string_view bytes) {
  while (!bytes.empty()) {
    const size_t n = std::min<size_t>(bytes.size(), size_t{1} << 30);
    crc = static_cast<uint32_t>(::crc32(crc, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(n)));
    bytes.remove_prefix(n);
  }
  return crc;
}

std::string KeyBytes(const kv::PageKey& key) {
  std::string b(kPageKeyBytes, '\0');
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(key.hi >> (56 - 8 * i));
  for (int i = 0; i < 8; ++i) b[8 + i] = static_cast<char>(key.lo >> (56 - 8 * i));
  return b;
}

kv::PageKey KeyOf(absl::string_view k) {
  kv::PageKey key;
  for (int b = 0; b < 8; ++b) key.hi = key.hi << 8 | static_cast<uint8_t>(k[b]);
  for (int b = 8; b < 16; ++b) key.lo = key.lo << 8 | static_cast<uint8_t>(k[b]);
  return key;
}

// Ids from a client go into messages escaped and shortened.
std::string QuoteId(absl::string_view id) {
  std::string s = absl::StrCat("'", absl::CHexEscape(id.substr(0, 64)), "'");
  if (id.size() > 64) s += "...";
  return s;
}

class EngineImpl final : public Engine {
 public:
  EngineImpl(const EngineOptions& o, std::unique_ptr<AttentionBackend> backend, std::unique_ptr<LayerStage> layer,
             std::unique_ptr<kv::HostTier> tier)
      : o_(o),
        backend_(std::move(backend)),
        layer_(std::move(layer)),
        kv_(backend_->kv_config(), backend_->storage()),
        tier_(std::move(tier)),
        queue_(o.max_queue),
        fair_(o.max_queue),
        // Room for every step that can be accepted at once (queued, in the two batches,
        // refused at launch), so Push never waits in practice.
        done_pool_(std::make_unique<CompletionPool>(
            o.completion_threads, o.max_queue + 2 * o.max_batch_size,
            [this](DecodeStep* const* s, const absl::Status* st, int n) { RunCompletions(s, st, n); })) {
    for (auto& b : batches_) b.entries.reserve(o.max_batch_size);
    inline_steps_.resize(o.max_batch_size);
    inline_statuses_.resize(o.max_batch_size);
    incoming_.reserve(o.max_queue);
    failed_.reserve(o.max_queue);
    // Pinned on CUDA, so offloads and restores copy at the link's speed.
    if (tier_ != nullptr && tier_->arena_bytes() > 0) backend_->RegisterHostMemory(tier_->arena(), tier_->arena_bytes());
    scheduler_ = std::thread([this] {
      pthread_setname_np(pthread_self(), "latentd-sched");  // for top -H and debuggers
      Loop();
    });
  }

  ~EngineImpl() override {
    stop_.store(true);
    queue_.Wake();
    scheduler_.join();
    done_pool_.reset();  // runs what the scheduler handed it, then stops its threads
    if (tier_ != nullptr && tier_->arena_bytes() > 0) {
      if (kv::KvStorage* storage = backend_->storage()) (void)storage->Synchronize();
      backend_->UnregisterHostMemory(tier_->arena());
    }
  }

  EngineInfo Info() const override {
    EngineInfo info;
    info.model = o_.model;
    info.backend = backend_->Name();
    info.max_batch_size = o_.max_batch_size;
    info.kv_dtype = backend_->kv_config().kv_dtype;
    info.kv_bytes_per_token = backend_->kv_config().token_bytes();
    if (layer_ != nullptr) {
      info.layer_api = true;
      info.hidden_size = layer_->hidden_size();
      info.max_positions = layer_->max_positions();
      info.weight_bytes = layer_->weight_bytes();
    }
    absl::MutexLock lock(&kv_mu_);
    const auto stats = kv_.GetStats();
    info.total_pages = stats.total_pages;
    info.free_pages = stats.free_pages;
    return info;
  }

  absl::StatusOr<std::string> CreateSequence(absl::string_view id) override {
    absl::MutexLock lock(&kv_mu_);
    if (absl::Status st = CheckSequenceLimit(); !st.ok()) return st;
    if (absl::Status st = CheckNotOffloaded(id, "sequence_id"); !st.ok()) return st;
    auto seq = kv_.CreateSequence(id);
    if (!seq.ok()) return seq.status();
    kv_.Touch(*seq, absl::Now());
    return kv_.Id(*seq);
  }

  absl::StatusOr<CreatedSequence> CreateSequenceWithPrefix(absl::string_view id,
                                                           const std::vector<std::string>& page_keys) override {
    std::vector<kv::PageKey> keys;  // once per sequence, not per step
    keys.reserve(page_keys.size());
    for (size_t i = 0; i < page_keys.size(); ++i) {
      const std::string& k = page_keys[i];
      if (k.size() != kPageKeyBytes)
        return absl::InvalidArgumentError(
            absl::StrCat("page_keys[", i, "]: expected ", kPageKeyBytes, " bytes, got ", k.size()));
      keys.push_back(KeyOf(k));
    }
    absl::MutexLock lock(&kv_mu_);
    if (absl::Status st = CheckSequenceLimit(); !st.ok()) return st;
    if (absl::Status st = CheckNotOffloaded(id, "sequence_id"); !st.ok()) return st;
    auto seq = kv_.CreateSequence(id, keys);
    if (!seq.ok()) return seq.status();
    kv_.Touch(*seq, absl::Now());
    const int64_t prefix = kv_.PrefixTokens(*seq);
    prefix_bytes_saved_ += static_cast<uint64_t>(prefix) * RowBytes() * o_.model.num_layers;
    return CreatedSequence{kv_.Id(*seq), prefix};
  }

  absl::StatusOr<SequenceLengths> AppendKv(absl::string_view id, int layer, absl::string_view kv) override {
    if (absl::Status st = CheckAppendTarget(id, layer); !st.ok()) return st;
    return AppendRows(id, layer, kv, /*expect_length=*/-1);
  }

  absl::StatusOr<SequenceLengths> AppendHidden(absl::string_view id, int layer, absl::string_view hidden) override {
    if (layer_ == nullptr) return NoLayerApi();
    if (absl::Status st = CheckAppendTarget(id, layer); !st.ok()) return st;
    const size_t row = size_t(layer_->hidden_size()) * kernels::DTypeBytes(o_.model.dtype);
    if (hidden.empty() || hidden.size() % row != 0)
      return absl::InvalidArgumentError(absl::StrCat("hidden: expected a positive multiple of ", row,
                                                     " bytes ([n, hidden_size=", layer_->hidden_size(), "] ",
                                                     kernels::DTypeName(o_.model.dtype), "), got ", hidden.size()));
    const int64_t n = static_cast<int64_t>(hidden.size() / row);
    if (absl::Status st = EnsureResident(id); !st.ok()) return st;
    int64_t length = 0;
    {
      absl::MutexLock lock(&kv_mu_);
      const kv::Sequence* seq = kv_.Find(id);
      if (seq == nullptr) return NotFound(id);
      length = kv_.Length(seq, layer);
    }
    if (length + n > layer_->max_positions())
      return absl::OutOfRangeError(absl::StrCat("hidden: ", n, " tokens after ", length, " would pass the ",
                                                layer_->max_positions(), " positions served (--max_positions)"));
    // The GEMMs run without the KV lock; the append then checks that the layer is still
    // as long as the positions assumed.
    absl::StatusOr<std::string> rows = layer_->Rows(layer, hidden, length);
    if (!rows.ok()) return rows.status();
    return AppendRows(id, layer, *rows, length);
  }

  absl::Status CheckAppendTarget(absl::string_view id, int layer) const {
    if (id.empty()) return absl::InvalidArgumentError("sequence_id: expected a non-empty id");
    if (layer < 0 || layer >= o_.model.num_layers)
      return absl::InvalidArgumentError(
          absl::StrCat("layer: expected 0..", o_.model.num_layers - 1, ", got ", layer));
    return absl::OkStatus();
  }

  static absl::Status NoLayerApi() {
    return absl::FailedPreconditionError(
        "hidden: this daemon serves the kernel-level API only (start it with --model_dir holding the checkpoint's "
        "attention weights)");
  }

  // AppendKv's copy; with expect_length >= 0, ABORTED unless the layer has that length.
  absl::StatusOr<SequenceLengths> AppendRows(absl::string_view id, int layer, absl::string_view kv,
                                             int64_t expect_length) {
    const size_t row = RowBytes();
    if (kv.empty() || kv.size() % row != 0)
      return absl::InvalidArgumentError(absl::StrCat("kv: expected a positive multiple of ", row,
                                                     " bytes ([n, h_kv=", o_.model.num_heads_kv, ", 576] ",
                                                     kernels::DTypeName(o_.model.dtype), "), got ", kv.size()));
    const int n = static_cast<int>(kv.size() / row);
    // Chunks of whole pages, so every chunk but the last ends on a page boundary.
    const int chunk_rows = static_cast<int>(
        std::max<size_t>(1, kAppendChunkBytes / (row * kernels::kPageSize)) * kernels::kPageSize);
    // The lock is dropped between chunks. Between them the sequence may be released
    // (and even re-created under the same id: the serial tells), or another step may
    // append to the same layer; the first ends the upload with NOT_FOUND, the second
    // only interleaves rows (see engine.h). Reserving every page first and copying
    // outside the lock would need pages that are neither free nor readable yet, which
    // the manager does not have, and a copy racing a release could write into pages
    // handed to another sequence; copying under the lock in bounded pieces has neither
    // problem.
    if (absl::Status st = EnsureResident(id); !st.ok()) return st;
    if (tier_ != nullptr) {
      // Pages for the whole upload, moving idle sequences to the host tier if need be.
      int64_t need = 0;
      {
        absl::MutexLock lock(&kv_mu_);
        if (const kv::Sequence* seq = kv_.Find(id))
          need = kv::PagesForTokens(kv_.Length(seq, layer) + n) - kv_.PagesOf(seq);
      }
      if (need > 0) MakeRoom(need, absl::Now());
    }
    uint64_t serial = 0;
    int64_t start_length = 0;
    for (int done = 0; done < n;) {
      if (done > 0 && o_.on_append_chunk_for_testing) o_.on_append_chunk_for_testing();
      const int rows = std::min(chunk_rows, n - done);
      absl::MutexLock lock(&kv_mu_);
      kv::Sequence* seq = kv_.Find(id);
      if (done == 0) {
        if (seq == nullptr) return NotFound(id);
        serial = kv_.Serial(seq);
        start_length = kv_.Length(seq, layer);
        if (expect_length >= 0 && start_length != expect_length)
          return absl::AbortedError(absl::StrCat("hidden: layer ", layer, " grew from ", expect_length, " to ",
                                                 start_length, " rows while its rows were computed; retry"));
        const int64_t total_pages = backend_->kv_config().num_pages;
        if ((start_length + n + kernels::kPageSize - 1) / kernels::kPageSize > total_pages)
          return absl::InvalidArgumentError(absl::StrCat("kv: ", n, " rows would make layer ", layer, " ",
                                                         start_length + n, " tokens long; the whole cache holds ",
                                                         total_pages * kernels::kPageSize));
        // Most uploads that cannot fit are refused before copying anything (others
        // may still take pages meanwhile: the chunks below check again).
        const int64_t need = (start_length + n + kernels::kPageSize - 1) / kernels::kPageSize - kv_.PagesOf(seq);
        if (need > kv_.free_pages()) {
          rejected_out_of_pages_.fetch_add(1);
          return absl::ResourceExhaustedError(
              absl::StrCat("kv cache: out of pages: need ", need, ", free ", kv_.free_pages()));
        }
      } else if (seq == nullptr || kv_.Serial(seq) != serial) {
        return absl::NotFoundError(absl::StrCat("sequence_id: sequence '", id, "' was released during the upload"));
      }
      absl::Status st = kv_.Append(seq, layer, kv.data() + size_t(done) * row, rows);
      if (!st.ok()) {
        // All or nothing: give back what the earlier chunks added.
        if (done > 0) kv_.TruncateLayer(seq, layer, start_length);
        if (absl::IsResourceExhausted(st)) rejected_out_of_pages_.fetch_add(1);
        return st;
      }
      append_chunks_.fetch_add(1, std::memory_order_relaxed);
      done += rows;
      if (done == n) {
        kv_.Touch(seq, absl::Now());
        return LengthsOf(seq);
      }
    }
    return absl::InternalError("kv: empty upload");  // unreachable: n > 0
  }

  absl::StatusOr<std::string> ForkSequence(absl::string_view id, absl::string_view new_id) override {
    if (id.empty()) return absl::InvalidArgumentError("sequence_id: expected a non-empty id");
    if (absl::Status st = EnsureResident(id); !st.ok()) return st;
    absl::MutexLock lock(&kv_mu_);
    if (kv_.Find(id) == nullptr) return NotFound(id);
    if (absl::Status st = CheckSequenceLimit(); !st.ok()) return st;
    if (absl::Status st = CheckNotOffloaded(new_id, "new_sequence_id"); !st.ok()) return st;
    auto seq = kv_.Fork(id, new_id);
    if (!seq.ok()) return seq.status();
    kv_.Touch(*seq, absl::Now());
    return kv_.Id(*seq);
  }

  absl::StatusOr<int64_t> ReleaseSequence(absl::string_view id) override {
    if (id.empty()) return absl::InvalidArgumentError("sequence_id: expected a non-empty id");
    absl::MutexLock lock(&kv_mu_);
    for (;;) {
      if (kv_.Find(id) != nullptr) return kv_.Release(id);
      const kv::HostTier::Entry* e = tier_ != nullptr ? tier_->Find(id) : nullptr;
      if (e == nullptr) return NotFound(id);
      if (!e->busy) {
        tier_->Remove(id, /*restored=*/false);
        return int64_t{0};  // it held no pages
      }
      restore_cv_.Wait(&kv_mu_);  // being brought back: release it where it lands
    }
  }

  int ReleaseIdleSequences(absl::Duration ttl) override {
    // One cutoff for the whole sweep: a sequence used while it runs is not idle.
    const absl::Time cutoff = absl::Now() - ttl;
    int released = 0;
    for (;;) {
      int n;
      {
        absl::MutexLock lock(&kv_mu_);
        n = kv_.ReleaseIdle(cutoff, kIdleReleaseBatch);
      }
      released += n;
      if (n < kIdleReleaseBatch) break;
    }
    if (tier_ != nullptr) {
      absl::MutexLock lock(&kv_mu_);
      for (const std::string& id : tier_->IdleIds(cutoff)) {
        tier_->Remove(id, /*restored=*/false);
        ++released;
      }
    }
    return released;
  }

  int OffloadIdleSequences(absl::Duration idle) override {
    if (tier_ == nullptr) return 0;
    const absl::Time cutoff = absl::Now() - idle;
    int moved = 0;
    for (;;) {
      std::vector<std::string> ids;
      {
        absl::MutexLock lock(&kv_mu_);
        ids = kv_.IdleSequences(SafeCutoff(cutoff), 16);
      }
      if (ids.empty()) return moved;
      int round = 0;
      for (const std::string& id : ids) {
        const OffloadResult r = OffloadOne(id, cutoff);
        if (r == OffloadResult::kTierFull) return moved;
        if (r == OffloadResult::kMoved) ++moved, ++round;
      }
      if (round == 0) return moved;  // the rest were used meanwhile
    }
  }

  absl::StatusOr<SequenceInfo> GetSequence(absl::string_view id) const override {
    if (id.empty()) return absl::InvalidArgumentError("sequence_id: expected a non-empty id");
    SequenceInfo info;
    absl::MutexLock lock(&kv_mu_);
    const kv::Sequence* seq = kv_.Find(id);
    if (seq == nullptr) {
      const kv::HostTier::Entry* e = tier_ != nullptr ? tier_->Find(id) : nullptr;
      if (e == nullptr) return NotFound(id);
      info.sequence_id = e->id;
      info.lengths = e->lengths;
      info.last_used = e->last_used;
      info.offloaded = true;
      return info;
    }
    info.sequence_id = kv_.Id(seq);
    info.lengths = kv_.Lengths(seq);
    info.pages = kv_.PagesOf(seq);
    info.shared_pages = kv_.SharedPagesOf(seq);
    info.last_used = kv_.LastUsed(seq);
    return info;
  }

  absl::StatusOr<std::unique_ptr<SequenceExporter>> ExportSequence(absl::string_view id) override {
    if (id.empty()) return absl::InvalidArgumentError("sequence_id: expected a non-empty id");
    const kv::KvCacheConfig& c = backend_->kv_config();
    SequenceExportHeader h;
    h.num_layers = c.num_layers;
    h.num_heads_kv = c.num_heads_kv;
    h.page_size = kernels::kPageSize;
    h.dtype = o_.model.dtype;
    h.kv_dtype = kernels::KvDTypeName(c.kv_dtype, o_.model.dtype);
    h.row_bytes = c.row_bytes();
    uint64_t serial = 0;
    {
      absl::MutexLock lock(&kv_mu_);
      const kv::Sequence* seq = kv_.Find(id);
      // An offloaded sequence is exported from the host tier as it lies (a drain moves
      // it without needing pages here).
      const kv::HostTier::Entry* off = seq == nullptr && tier_ != nullptr ? tier_->Find(id) : nullptr;
      if (off != nullptr) {
        h.sequence_id = off->id;
        h.lengths = off->lengths;
        for (const kv::PageKey& k : off->keys) h.page_keys.push_back(KeyBytes(k));
        return std::unique_ptr<SequenceExporter>(new Exporter(this, std::move(h), off->serial));
      }
      if (seq == nullptr) return NotFound(id);
      h.sequence_id = kv_.Id(seq);
      h.lengths = kv_.Lengths(seq);
      for (const kv::PageKey& k : kv_.PublishedKeys(seq)) h.page_keys.push_back(KeyBytes(k));
      serial = kv_.Serial(seq);
    }
    return std::unique_ptr<SequenceExporter>(new Exporter(this, std::move(h), serial));
  }

  absl::StatusOr<std::unique_ptr<SequenceImporter>> ImportSequence(const SequenceExportHeader& h,
                                                                  absl::string_view id) override {
    absl::Status st = CheckImportHeader(h);
    std::string new_id(id.empty() ? absl::string_view(h.sequence_id) : id);
    if (st.ok()) st = kv::ValidateSequenceId(new_id, id.empty() ? "header.sequence_id" : "sequence_id");
    if (!st.ok()) {
      import_failures_.fetch_add(1, std::memory_order_relaxed);
      return st;
    }
    if (tier_ != nullptr && !h.lengths.empty())
      MakeRoom(kv::PagesForTokens(*std::max_element(h.lengths.begin(), h.lengths.end())), absl::Now());
    kv::Sequence* pending = nullptr;
    {
      absl::MutexLock lock(&kv_mu_);
      if (kv_.Find(new_id) != nullptr || (tier_ != nullptr && tier_->Find(new_id) != nullptr)) {
        st = absl::AlreadyExistsError(absl::StrCat("sequence_id: sequence ", QuoteId(new_id), " already exists"));
      }
      if (st.ok()) st = CheckSequenceLimit();
      if (st.ok()) {
        // Every page up front: an import that cannot fit fails now, before any row
        // crosses the network, and one that began never runs out part-way. Leading
        // pages the prefix cache holds are attached instead (their rows are skipped).
        std::vector<kv::PageKey> keys;
        keys.reserve(h.page_keys.size());
        for (const std::string& k : h.page_keys) keys.push_back(KeyOf(k));
        auto begun = kv_.BeginImport(h.lengths, keys);
        if (begun.ok()) {
          pending = *begun;
        } else {
          st = absl::Status(begun.status().code(), absl::StrCat("header.", begun.status().message()));
          if (absl::IsResourceExhausted(st)) rejected_out_of_pages_.fetch_add(1);
        }
      }
    }
    if (!st.ok()) {
      import_failures_.fetch_add(1, std::memory_order_relaxed);
      return st;
    }
    return std::unique_ptr<SequenceImporter>(new Importer(this, h, std::move(new_id), pending));
  }

  absl::Status Submit(DecodeStep* step) override {
    step->unit = 0;
    return SubmitOne(step, /*wake=*/true);
  }

  // wake = false: the scheduler is not woken for this push (SubmitBatch wakes it once).
  absl::Status SubmitOne(DecodeStep* step, bool wake) {
    absl::Status st = Validate(*step);
    if (!st.ok()) {
      metrics_.Reject(RejectReason::kInvalid);
      return st;
    }
    // Counted before the draining check (both sequentially consistent), so a Drain that
    // began earlier either refuses this step here or waits for it.
    accepted_.fetch_add(1);
    if (draining_.load()) {
      Unaccept();
      return absl::UnavailableError("server is draining: no new decode steps accepted");
    }
    step->enqueued_at = absl::Now();
    st = queue_.Push(step, absl::HashOf(step->sequence_id), wake);
    if (!st.ok()) {
      Unaccept();
      metrics_.Reject(RejectReason::kQueueFull);
      return st;
    }
    return absl::OkStatus();
  }

  void SubmitBatch(DecodeStep* const* steps, int n, absl::Status* statuses) override {
    // A unit larger than a launch is split anyway: holding the scheduler for it would
    // only delay everyone else's steps.
    if (n > o_.max_batch_size) {
      for (int i = 0; i < n; ++i) statuses[i] = Submit(steps[i]);
      return;
    }
    // Seen by the scheduler before the first push, so no batch forms from a part. The
    // pushes do not wake the scheduler one by one (each wake costs the submitter a
    // syscall and the scheduler a drain); it is woken once the message is queued.
    batch_submitters_.fetch_add(1);
    // The fair queue keeps the message whole: it launches in one batch, never
    // interleaved with other flows' messages over several (FairQueue::Pick).
    const uint64_t unit = n > 1 ? next_unit_.fetch_add(1, std::memory_order_relaxed) : 0;
    for (int i = 0; i < n; ++i) {
      if (i > 0 && o_.on_batch_submit_for_testing) o_.on_batch_submit_for_testing();
      steps[i]->unit = unit;
      statuses[i] = SubmitOne(steps[i], /*wake=*/false);
    }
    batch_submitters_.fetch_sub(1);
    // A message of several steps is a batch its sender has already formed (a model
    // runner's layer): it ends the batching window instead of waiting it out.
    if (n > 1) unit_queued_.store(true);
    queue_.Wake();
  }

  uint64_t RegisterHostMemory(void* base, size_t bytes) override {
    return backend_->RegisterHostMemory(base, bytes);
  }
  void UnregisterHostMemory(void* base) override { backend_->UnregisterHostMemory(base); }
  absl::StatusOr<DeviceMemory> OpenDeviceMemory(absl::string_view ipc_handle, uint64_t offset,
                                                uint64_t bytes) override {
    return backend_->OpenDeviceMemory(ipc_handle, offset, bytes);
  }
  void CloseDeviceMemory(const DeviceMemory& memory) override { backend_->CloseDeviceMemory(memory); }

  EngineMetrics Metrics() const override {
    EngineMetrics m = metrics_.Snapshot();
    {
      absl::MutexLock lock(&kv_mu_);
      const auto stats = kv_.GetStats();
      m.pages_used = stats.used_pages;
      m.pages_free = stats.free_pages;
      m.pages_high_water = stats.high_water_pages;
      m.sequences = stats.sequences;
      m.pages_cached = stats.cached_pages;
      m.pages_keyed = stats.keyed_pages;
      m.prefix_hit_pages = stats.prefix_hits;
      m.prefix_miss_pages = stats.prefix_misses;
      m.prefix_evictions = stats.evictions;
      m.prefix_bytes_saved = prefix_bytes_saved_;
      if (tier_ != nullptr) {
        const auto t = tier_->GetStats();
        m.host_tier_capacity_bytes = t.capacity_bytes;
        m.host_tier_used_bytes = t.used_bytes;
        m.host_tier_sequences = t.sequences;
        m.host_offloads = t.offloads;
        m.host_restores = t.restores;
        m.host_offload_refused = t.refused;
        m.host_restore_failures = restore_failures_;
        m.host_restore_seconds = restore_seconds_;
      }
    }
    m.rejected_out_of_pages += rejected_out_of_pages_.load();
    m.rejected_max_sequences = rejected_max_sequences_.load();
    m.queued_steps = queue_.size();
    m.waiting_flows = waiting_flows_.load(std::memory_order_relaxed);
    m.last_batch_flows = last_batch_flows_.load(std::memory_order_relaxed);
    m.last_batch_max_flow_rows = last_batch_max_flow_rows_.load(std::memory_order_relaxed);
    m.append_chunks = append_chunks_.load(std::memory_order_relaxed);
    m.sequences_exported = sequences_exported_.load(std::memory_order_relaxed);
    m.export_bytes = export_bytes_.load(std::memory_order_relaxed);
    m.sequences_imported = sequences_imported_.load(std::memory_order_relaxed);
    m.import_bytes = import_bytes_.load(std::memory_order_relaxed);
    m.import_failures = import_failures_.load(std::memory_order_relaxed);
    return m;
  }

  bool Drain(absl::Duration timeout) override {
    draining_.store(true);
    const absl::Time deadline = absl::Now() + timeout;
    absl::MutexLock lock(&done_mu_);
    auto all_done = [this] { return completed_.load() == accepted_.load(); };
    while (!all_done()) {
      if (done_cv_.WaitWithDeadline(&done_mu_, deadline)) return all_done();
    }
    return true;
  }

 private:
  // Reads rows in pieces of at most the caller's size, each under the KV lock.
  class Exporter final : public SequenceExporter {
   public:
    Exporter(EngineImpl* engine, SequenceExportHeader header, uint64_t serial)
        : e_(engine), header_(std::move(header)), serial_(serial) {}

    const SequenceExportHeader& header() const override { return header_; }
    int64_t total_rows() const override { return total_rows_; }
    uint32_t crc32() const override { return crc_; }

    absl::StatusOr<bool> Next(size_t max_bytes, SequenceExportChunk* chunk) override {
      while (layer_ < header_.num_layers && row_ >= header_.lengths[layer_]) {
        ++layer_;
        row_ = 0;
      }
      if (layer_ == header_.num_layers) {
        if (!finished_) {
          finished_ = true;
          e_->sequences_exported_.fetch_add(1, std::memory_order_relaxed);
        }
        return false;
      }
      const int64_t row_bytes = header_.row_bytes;
      const int64_t n = std::min<int64_t>(std::max<int64_t>(1, static_cast<int64_t>(max_bytes) / row_bytes),
                                          header_.lengths[layer_] - row_);
      chunk->layer = layer_;
      chunk->first_row = row_;
      chunk->rows = n;
      chunk->bytes.resize(static_cast<size_t>(n * row_bytes));
      {
        absl::MutexLock lock(&e_->kv_mu_);
        const kv::Sequence* seq = e_->kv_.Find(header_.sequence_id);
        const kv::HostTier::Entry* off =
            seq == nullptr && e_->tier_ != nullptr ? e_->tier_->Find(header_.sequence_id) : nullptr;
        if (off != nullptr && off->serial == serial_) {
          // Offloaded (before or during the export): the same rows, from the host tier.
          if (off->lengths[layer_] < row_ + n) return Shorter(off->lengths[layer_]);
          char* out = chunk->bytes.data();
          for (int64_t r = row_; r < row_ + n;) {
            const int64_t in_page = r % kernels::kPageSize;
            const int64_t run = std::min<int64_t>(row_ + n - r, kernels::kPageSize - in_page);
            std::memcpy(out, e_->tier_->Block(off->blocks[layer_][r / kernels::kPageSize]) + in_page * row_bytes,
                        static_cast<size_t>(run * row_bytes));
            out += run * row_bytes;
            r += run;
          }
        } else {
          if (seq == nullptr || e_->kv_.Serial(seq) != serial_) {
            return absl::NotFoundError(absl::StrCat("sequence_id: sequence ", QuoteId(header_.sequence_id),
                                                    " was released during the export"));
          }
          if (e_->kv_.Length(seq, layer_) < row_ + n) return Shorter(e_->kv_.Length(seq, layer_));
          if (absl::Status st = e_->kv_.ReadStoredRows(seq, layer_, row_, n, chunk->bytes.data()); !st.ok())
            return st;
        }
      }
      crc_ = Crc32(crc_, chunk->bytes);
      total_rows_ += n;
      row_ += n;
      e_->export_bytes_.fetch_add(chunk->bytes.size(), std::memory_order_relaxed);
      return true;
    }

   private:
    absl::Status Shorter(int64_t length) const {
      return absl::AbortedError(absl::StrCat("sequence_id: layer ", layer_, " of sequence ", QuoteId(header_.sequence_id),
                                             " became shorter (", length, " rows) than the export's ",
                                             header_.lengths[layer_], " during the export"));
    }

    EngineImpl* const e_;
    const SequenceExportHeader header_;
    const uint64_t serial_;
    int layer_ = 0;
    int64_t row_ = 0;
    int64_t total_rows_ = 0;
    uint32_t crc_ = 0;
    bool finished_ = false;
  };

  // Fills a pending sequence in order; gives its pages back unless committed.
  class Importer final : public SequenceImporter {
   public:
    Importer(EngineImpl* engine, const SequenceExportHeader& header, std::string id, kv::Sequence* pending)
        : e_(engine), lengths_(header.lengths), row_bytes_(header.row_bytes), id_(std::move(id)), pending_(pending) {
      for (const std::string& k : header.page_keys) keys_.push_back(KeyOf(k));
    }
    ~Importer() override {
      if (pending_ != nullptr) Abort();
    }

    absl::Status Write(int layer, int64_t first_row, absl::string_view rows) override {
      if (pending_ == nullptr) return Gone();
      absl::Status st = CheckNext(layer, first_row, rows);
      const int64_t n = static_cast<int64_t>(rows.size()) / row_bytes_;
      // Pieces of about kAppendChunkBytes per hold of the KV lock, as AppendKv copies.
      const int64_t piece = std::max<int64_t>(1, static_cast<int64_t>(kAppendChunkBytes) / row_bytes_);
      for (int64_t done = 0; st.ok() && done < n; done += piece) {
        const int64_t k = std::min(piece, n - done);
        absl::MutexLock lock(&e_->kv_mu_);
        st = e_->kv_.WriteImportRows(pending_, layer, first_row + done, k, rows.data() + done * row_bytes_);
      }
      if (!st.ok()) {
        Abort();  // all or nothing: the pages go back now, not when the caller lets go
        return st;
      }
      crc_ = Crc32(crc_, rows);
      total_rows_ += n;
      row_ += n;
      return absl::OkStatus();
    }

    absl::StatusOr<SequenceLengths> Commit(int64_t total_rows, uint32_t crc32) override {
      if (pending_ == nullptr) return Gone();
      Skip();
      absl::Status st;
      if (layer_ < static_cast<int>(lengths_.size())) {
        st = absl::FailedPreconditionError(absl::StrCat("rows: layer ", layer_, " has ", row_, " of its ",
                                                        lengths_[layer_], " rows; the stream ended early"));
      } else if (total_rows != total_rows_) {
        st = absl::InvalidArgumentError(
            absl::StrCat("total_rows: expected ", total_rows_, " (the rows received), got ", total_rows));
      } else if (crc32 != crc_) {
        st = absl::InvalidArgumentError(absl::StrCat("crc32: expected ", crc_, " (of the rows received), got ",
                                                     crc32, "; the rows were corrupted on the way"));
      }
      SequenceLengths out;
      if (st.ok()) {
        absl::MutexLock lock(&e_->kv_mu_);
        st = e_->CheckSequenceLimit();
        if (st.ok()) {
          auto seq = e_->kv_.CommitImport(pending_, id_, keys_);
          if (seq.ok()) {
            pending_ = nullptr;
            out = e_->LengthsOf(*seq);
          } else {
            st = seq.status();
          }
        }
      }
      if (!st.ok()) {
        Abort();
        return st;
      }
      e_->sequences_imported_.fetch_add(1, std::memory_order_relaxed);
      e_->import_bytes_.fetch_add(static_cast<uint64_t>(total_rows_ * row_bytes_), std::memory_order_relaxed);
      return out;
    }

   private:
    static absl::Status Gone() {
      return absl::FailedPreconditionError("import: already committed or failed; start a new one");
    }
    // Past layers whose rows have all come (layers of length 0 included).
    void Skip() {
      while (layer_ < static_cast<int>(lengths_.size()) && row_ >= lengths_[layer_]) {
        ++layer_;
        row_ = 0;
      }
    }
    absl::Status CheckNext(int layer, int64_t first_row, absl::string_view rows) {
      Skip();
      if (layer_ == static_cast<int>(lengths_.size())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer: every row of the header's lengths has come; expected the end, got rows of layer ", layer));
      }
      if (layer != layer_) {
        return absl::InvalidArgumentError(absl::StrCat("layer: expected ", layer_, " (row ", row_, " of ",
                                                       lengths_[layer_], " next), got ", layer));
      }
      if (first_row != row_) {
        return absl::InvalidArgumentError(
            absl::StrCat("first_row: expected ", row_, " (layer ", layer_, "), got ", first_row));
      }
      if (rows.empty() || rows.size() % static_cast<size_t>(row_bytes_) != 0) {
        return absl::InvalidArgumentError(absl::StrCat("rows: expected a positive multiple of ", row_bytes_,
                                                       " bytes (whole stored rows), got ", rows.size()));
      }
      const int64_t n = static_cast<int64_t>(rows.size()) / row_bytes_;
      if (row_ + n > lengths_[layer_]) {
        return absl::InvalidArgumentError(absl::StrCat("rows: ", n, " rows from row ", row_, " pass layer ",
                                                       layer_, "'s length ", lengths_[layer_], " in the header"));
      }
      return absl::OkStatus();
    }
    void Abort() {
      {
        absl::MutexLock lock(&e_->kv_mu_);
        e_->kv_.AbortImport(pending_);
      }
      pending_ = nullptr;
      e_->import_failures_.fetch_add(1, std::memory_order_relaxed);
    }

    EngineImpl* const e_;
    const std::vector<int64_t> lengths_;
    const int64_t row_bytes_;
    const std::string id_;
    std::vector<kv::PageKey> keys_;
    kv::Sequence* pending_;  // null once committed or aborted
    int layer_ = 0;
    int64_t row_ = 0;
    int64_t total_rows_ = 0;
    uint32_t crc_ = 0;
  };

  // An import's header against this pool; the message names the field.
  absl::Status CheckImportHeader(const SequenceExportHeader& h) const {
    const kv::KvCacheConfig& c = backend_->kv_config();
    auto mismatch = [](absl::string_view field, auto want, auto got) {
      return absl::InvalidArgumentError(absl::StrCat("header.", field, ": expected ", want, ", got ", got));
    };
    if (h.format_version != kExportFormatVersion) return mismatch("format_version", kExportFormatVersion, h.format_version);
    if (h.num_layers != c.num_layers) return mismatch("num_layers", c.num_layers, h.num_layers);
    if (h.num_heads_kv != c.num_heads_kv) return mismatch("num_heads_kv", c.num_heads_kv, h.num_heads_kv);
    if (h.page_size != kernels::kPageSize) return mismatch("page_size", kernels::kPageSize, h.page_size);
    if (h.dtype != o_.model.dtype)
      return mismatch("dtype", kernels::DTypeName(o_.model.dtype), kernels::DTypeName(h.dtype));
    const std::string kv_dtype = kernels::KvDTypeName(c.kv_dtype, o_.model.dtype);
    if (h.kv_dtype != kv_dtype) return mismatch("kv_dtype", kv_dtype, QuoteId(h.kv_dtype));
    if (h.row_bytes != c.row_bytes()) return mismatch("row_bytes", c.row_bytes(), h.row_bytes);
    if (h.lengths.size() != static_cast<size_t>(c.num_layers))
      return mismatch("lengths", absl::StrCat(c.num_layers, " layers"), h.lengths.size());
    int64_t shortest = INT64_MAX;
    for (size_t l = 0; l < h.lengths.size(); ++l) {
      if (h.lengths[l] < 0 || kv::PagesForTokens(h.lengths[l]) > c.num_pages)
        return mismatch(absl::StrCat("lengths[", l, "]"), absl::StrCat("0 to ", c.num_pages * kernels::kPageSize,
                                                                       " rows (the whole pool)"),
                        h.lengths[l]);
      shortest = std::min(shortest, h.lengths[l]);
    }
    const int64_t full = h.lengths.empty() ? 0 : shortest / kernels::kPageSize;
    if (static_cast<int64_t>(h.page_keys.size()) > full)
      return mismatch("page_keys", absl::StrCat("at most ", full, " keys (pages full in every layer)"),
                      h.page_keys.size());
    for (size_t i = 0; i < h.page_keys.size(); ++i) {
      if (h.page_keys[i].size() != kPageKeyBytes)
        return mismatch(absl::StrCat("page_keys[", i, "]"), absl::StrCat(kPageKeyBytes, " bytes"),
                        h.page_keys[i].size());
    }
    return absl::OkStatus();
  }

  // ---- The host tier (EngineOptions::host_kv_bytes) ----

  // ALREADY_EXISTS for an id the host tier holds (a new sequence may not take it).
  absl::Status CheckNotOffloaded(absl::string_view id, absl::string_view field) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(kv_mu_) {
    if (tier_ == nullptr || id.empty() || tier_->Find(id) == nullptr) return absl::OkStatus();
    return absl::AlreadyExistsError(
        absl::StrCat(field, ": sequence ", QuoteId(id), " already exists (offloaded to the host tier)"));
  }

  // Sequences used at or after this time are never offloaded: those of the batches
  // being formed or computed (their steps have been taken), and those used since the
  // caller's own cutoff.
  absl::Time SafeCutoff(absl::Time cutoff) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(kv_mu_) {
    return std::min({cutoff, batch_taken_[0], batch_taken_[1]});
  }

  enum class OffloadResult { kMoved, kSkipped, kTierFull };

  // Moves one sequence last used before `cutoff` to the host tier: reserves its blocks,
  // copies its rows in pieces of about kAppendChunkBytes per hold of the KV lock, then,
  // if nothing touched it meanwhile, releases its pages and commits the entry in one
  // hold. Otherwise the copy is dropped and the sequence stays (kSkipped).
  OffloadResult OffloadOne(const std::string& id, absl::Time cutoff) {
    std::unique_ptr<kv::HostTier::Entry> e;
    uint64_t serial = 0;
    {
      absl::MutexLock lock(&kv_mu_);
      const kv::Sequence* seq = kv_.Find(id);
      if (seq == nullptr || kv_.LastUsed(seq) >= SafeCutoff(cutoff)) return OffloadResult::kSkipped;
      e = tier_->Reserve(kv_.Lengths(seq));
      if (e == nullptr) return OffloadResult::kTierFull;
      e->id = kv_.Id(seq);
      e->keys = kv_.PublishedKeys(seq);
      e->last_used = kv_.LastUsed(seq);
      e->serial = serial = kv_.Serial(seq);
    }
    // Still the same sequence, unused and no shorter than the copy (the lock is held).
    auto unchanged = [&](const kv::Sequence* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(kv_mu_) {
      return seq != nullptr && kv_.Serial(seq) == serial && kv_.LastUsed(seq) == e->last_used &&
             kv_.Lengths(seq) == e->lengths;
    };
    const int64_t piece_pages = std::max<int64_t>(1, static_cast<int64_t>(kAppendChunkBytes) / tier_->block_bytes());
    absl::Status st;
    for (size_t l = 0; l < e->lengths.size() && st.ok(); ++l) {
      const int64_t pages = kv::PagesForTokens(e->lengths[l]);
      for (int64_t p0 = 0; p0 < pages && st.ok(); p0 += piece_pages) {
        absl::MutexLock lock(&kv_mu_);
        const kv::Sequence* seq = kv_.Find(id);
        if (!unchanged(seq)) {
          st = absl::AbortedError("used meanwhile");
          break;
        }
        for (int64_t p = p0; p < std::min(pages, p0 + piece_pages) && st.ok(); ++p) {
          const int64_t first = p * kernels::kPageSize;
          const int64_t n = std::min<int64_t>(kernels::kPageSize, e->lengths[l] - first);
          st = kv_.ReadStoredRows(seq, static_cast<int>(l), first, n, tier_->Block(e->blocks[l][p]),
                                  /*synchronize=*/false);
        }
        // One wait per piece, with the lock still held: the rows are in the blocks before
        // anything can free their pages.
        if (st.ok()) st = kv_.storage()->SynchronizeReads();
      }
    }
    absl::MutexLock lock(&kv_mu_);
    if (st.ok() && unchanged(kv_.Find(id))) {
      (void)kv_.Release(id);
      tier_->Commit(std::move(e));
      return OffloadResult::kMoved;
    }
    tier_->Cancel(std::move(e));
    return OffloadResult::kSkipped;
  }

  // Offloads least recently used sequences idle before `cutoff` until `need` pages are
  // free or on their way (retiring: freed while a batch in flight may still read
  // them; counted, so a batch in flight does not make every idle sequence move out).
  // true when they are.
  bool MakeRoom(int64_t need, absl::Time cutoff) {
    if (tier_ == nullptr) return false;
    // Each round moves a sequence or drops candidates that were used or released
    // meanwhile; the bound covers candidates whose rows cannot be read.
    for (int round = 0; round < 1024; ++round) {
      std::vector<std::string> ids;
      {
        absl::MutexLock lock(&kv_mu_);
        if (need <= kv_.free_pages() + kv_.retiring_pages()) return true;
        ids = kv_.IdleSequences(SafeCutoff(cutoff), 4);
      }
      if (ids.empty()) return false;
      for (const std::string& id : ids) {
        const OffloadResult r = OffloadOne(id, cutoff);
        if (r == OffloadResult::kTierFull) return false;
        if (r == OffloadResult::kMoved) break;  // count again before moving more
      }
    }
    return false;
  }

  // Brings an offloaded sequence back into the pool before something uses it: pages
  // for its longest layer (made room for by offloading others if need be), its rows
  // copied in pieces, its page keys published again. OK when it is resident; NOT_FOUND
  // when it is neither resident nor offloaded; RESOURCE_EXHAUSTED when the pool cannot
  // take it (it stays offloaded). Concurrent callers for one sequence wait for the one
  // that restores it.
  absl::Status EnsureResident(absl::string_view id) {
    if (tier_ == nullptr) return absl::OkStatus();
    const absl::Time start = absl::Now();
    kv::HostTier::Entry* e = nullptr;
    {
      absl::MutexLock lock(&kv_mu_);
      for (;;) {
        if (kv_.Find(id) != nullptr) return absl::OkStatus();
        e = tier_->Find(id);
        if (e == nullptr) return absl::OkStatus();  // unknown: the caller's lookup says NOT_FOUND
        if (!e->busy) break;
        restore_cv_.Wait(&kv_mu_);
      }
      e->busy = true;  // the entry (and its blocks) stays put until this restore ends
    }
    const int64_t need = kv::PagesForTokens(*std::max_element(e->lengths.begin(), e->lengths.end()));
    kv::Sequence* pending = nullptr;
    absl::Status st;
    // Pages freed while a batch may still read them (retiring) come free when it
    // finishes: waited for a few milliseconds at most, off the scheduler thread.
    for (int attempt = 0; pending == nullptr && st.ok(); ++attempt) {
      bool wait = false;
      {
        absl::MutexLock lock(&kv_mu_);
        if (kv_.free_pages() >= need) {
          auto begun = kv_.BeginImport(e->lengths, e->keys);
          if (begun.ok()) {
            pending = *begun;
            break;
          }
          if (!absl::IsResourceExhausted(begun.status())) {
            st = begun.status();
            break;
          }
        }
        wait = attempt > 0 && attempt < 200 && kv_.free_pages() + kv_.retiring_pages() >= need;
      }
      if (wait) {
        absl::SleepFor(absl::Milliseconds(1));
        continue;
      }
      if (attempt >= 200 || !MakeRoom(need, start)) {
        absl::MutexLock lock(&kv_mu_);
        st = absl::ResourceExhaustedError(absl::StrCat(
            "kv cache: out of pages to bring sequence ", QuoteId(id), " back from the host tier: need ", need,
            ", free ", kv_.free_pages(), ", and no idle sequence could move out"));
      }
    }
    const int64_t piece_pages = std::max<int64_t>(1, static_cast<int64_t>(kAppendChunkBytes) / tier_->block_bytes());
    // Pages the prefix cache still held were attached: only the others are copied.
    int64_t attached_pages = 0;
    if (pending != nullptr) {
      absl::MutexLock lock(&kv_mu_);
      attached_pages = kv_.PrefixTokens(pending) / kernels::kPageSize;
    }
    for (size_t l = 0; pending != nullptr && st.ok() && l < e->lengths.size(); ++l) {
      const int64_t pages = kv::PagesForTokens(e->lengths[l]);
      for (int64_t p0 = attached_pages; p0 < pages && st.ok(); p0 += piece_pages) {
        absl::MutexLock lock(&kv_mu_);
        for (int64_t p = p0; p < std::min(pages, p0 + piece_pages) && st.ok(); ++p) {
          const int64_t first = p * kernels::kPageSize;
          const int64_t n = std::min<int64_t>(kernels::kPageSize, e->lengths[l] - first);
          st = kv_.WriteImportRows(pending, static_cast<int>(l), first, n, tier_->Block(e->blocks[l][p]));
        }
      }
    }
    absl::MutexLock lock(&kv_mu_);
    // The copies read the (pinned) blocks asynchronously: done before the blocks go back.
    if (st.ok() && kv_.storage() != nullptr) st = kv_.storage()->Synchronize();
    if (st.ok()) {
      const std::string sid = e->id;
      auto seq = kv_.CommitImport(pending, sid, e->keys, e->serial);
      if (seq.ok()) {
        pending = nullptr;
        kv_.Touch(*seq, absl::Now());
        tier_->Remove(sid, /*restored=*/true);
        e = nullptr;
        restore_seconds_ += absl::ToDoubleSeconds(absl::Now() - start);
      } else {
        st = seq.status();
      }
    }
    if (!st.ok()) {
      if (pending != nullptr) kv_.AbortImport(pending);
      e->busy = false;
      ++restore_failures_;
    }
    restore_cv_.SignalAll();
    return st;
  }

  // Before a batch stages: its offloaded sequences come back, and pages its steps will
  // take are made free by moving idle sequences out. The batch's own sequences are
  // marked used first, so none of them is picked.
  // A batch in flight is finished first when there is work to do (its reads hold pages
  // that moving sequences out frees).
  void PrepareResidency(Batch& batch, Batch*& inflight) {
    const absl::Time start = absl::Now();
    std::vector<std::string>& missing = missing_;  // scheduler thread only: reused
    missing.clear();
    bool work = false;
    {
      absl::MutexLock lock(&kv_mu_);
      batch_taken_[batch.slot] = start;
      for (auto& e : batch.entries) {
        if (!e.status.ok()) continue;
        kv::Sequence* seq = kv_.Find(e.step->sequence_id);
        if (seq != nullptr) {
          kv_.Touch(seq, start);
        } else if (tier_->Find(e.step->sequence_id) != nullptr &&
                   std::find(missing.begin(), missing.end(), e.step->sequence_id) == missing.end()) {
          missing.push_back(e.step->sequence_id);
        }
      }
      work = !missing.empty() || kv_.free_pages() < BatchNewPages(batch);
    }
    if (!work) return;
    if (inflight != nullptr) {
      Finish(*inflight);
      inflight = nullptr;
    }
    for (const std::string& id : missing) {
      const absl::Status st = EnsureResident(id);
      if (st.ok()) continue;
      for (auto& e : batch.entries)
        if (e.step->sequence_id == id) e.status = st;
    }
    int64_t need = 0;
    {
      absl::MutexLock lock(&kv_mu_);
      need = BatchNewPages(batch);
      if (need <= kv_.free_pages()) return;
    }
    MakeRoom(need, start);
  }

  // Pages the batch's steps take: one for a step past its table's last page (an upper
  // bound per step would be 2; copy-on-write of a shared tail is not counted).
  int64_t BatchNewPages(const Batch& batch) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(kv_mu_) {
    int64_t need = 0;
    for (const auto& e : batch.entries) {
      if (!e.status.ok()) continue;
      const kv::Sequence* seq = kv_.Find(e.step->sequence_id);
      if (seq == nullptr) continue;
      need += std::max<int64_t>(0, kv::PagesForTokens(kv_.Length(seq, e.step->layer) + e.step->s_q) -
                                       static_cast<int64_t>(kv_.BlockTable(seq).size()));
    }
    return need;
  }

  // Bytes of one appended row as clients send it (16-bit values, whatever the pool stores).
  size_t RowBytes() const { return size_t(o_.model.num_heads_kv) * kHeadDimQK * 2; }

  absl::Status CheckSequenceLimit() ABSL_EXCLUSIVE_LOCKS_REQUIRED(kv_mu_) {
    const int64_t offloaded = tier_ != nullptr ? tier_->GetStats().sequences : 0;
    if (o_.max_sequences <= 0 || kv_.num_sequences() + offloaded < o_.max_sequences) return absl::OkStatus();
    rejected_max_sequences_.fetch_add(1);
    return absl::ResourceExhaustedError(absl::StrCat("max_sequences: ", o_.max_sequences,
                                                     " live sequences; release some or raise --max_sequences"));
  }

  static absl::Status NotFound(absl::string_view id) {
    return absl::NotFoundError(absl::StrCat("sequence_id: no sequence '", id, "'"));
  }

  SequenceLengths LengthsOf(const kv::Sequence* seq) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(kv_mu_) {
    SequenceLengths out;
    out.sequence_id = kv_.Id(seq);
    out.lengths.resize(o_.model.num_layers);
    for (int l = 0; l < o_.model.num_layers; ++l) out.lengths[l] = kv_.Length(seq, l);
    return out;
  }

  absl::Status Validate(const DecodeStep& s) const {
    const auto& m = o_.model;
    const char* dt = kernels::DTypeName(m.dtype);
    if (s.sequence_id.empty()) return absl::InvalidArgumentError("sequence_id: expected a non-empty id");
    if (s.layer < 0 || s.layer >= m.num_layers)
      return absl::InvalidArgumentError(absl::StrCat("layer: expected 0..", m.num_layers - 1, ", got ", s.layer));
    if (s.s_q < 1 || s.s_q > o_.max_s_q)
      return absl::InvalidArgumentError(absl::StrCat("q: expected 1..", o_.max_s_q, " query tokens, got ", s.s_q));
    if (IsLayerStep(s)) return ValidateLayerStep(s);
    const size_t q_bytes = size_t(s.s_q) * m.num_heads_q * kHeadDimQK * 2;
    if (s.q.bytes() != q_bytes)
      return absl::InvalidArgumentError(absl::StrCat("q: expected ", q_bytes, " bytes ([s_q=", s.s_q,
                                                     ", h_q=", m.num_heads_q, ", 576] ", dt, "), got ",
                                                     s.q.bytes()));
    const size_t kv_bytes = size_t(s.s_q) * RowBytes();
    if (s.kv.bytes() != kv_bytes)
      return absl::InvalidArgumentError(absl::StrCat("kv: expected ", kv_bytes, " bytes ([s_q=", s.s_q,
                                                     ", h_kv=", m.num_heads_kv, ", 576] ", dt, "), got ",
                                                     s.kv.bytes()));
    if (!s.out.set() || !s.lse.set() || s.callback == nullptr)
      return absl::InternalError("decode step without out, lse or callback");
    // The backends move q with kv, and out with lse, one way or the other.
    if (s.q.kind() != s.kv.kind() || s.out.kind() != s.lse.kind())
      return absl::InternalError("decode step with q and kv, or out and lse, in different kinds of memory");
    return absl::OkStatus();
  }

  absl::Status ValidateLayerStep(const DecodeStep& s) const {
    if (layer_ == nullptr) return NoLayerApi();
    if (s.q.set() || s.kv.set() || s.out.set() || s.lse.set())
      return absl::InvalidArgumentError("q: a layer step (hidden set) carries no q, kv, out or lse");
    const size_t bytes = size_t(s.s_q) * layer_->hidden_size() * kernels::DTypeBytes(o_.model.dtype);
    if (s.hidden.bytes() != bytes)
      return absl::InvalidArgumentError(absl::StrCat("hidden: expected ", bytes, " bytes ([s_q=", s.s_q,
                                                     ", hidden_size=", layer_->hidden_size(), "] ",
                                                     kernels::DTypeName(o_.model.dtype), "), got ", s.hidden.bytes()));
    // The layer math reads and writes these on the host (a CUDA region is for kernel-level steps).
    if (!s.hidden.on_host() || !s.layer_out.on_host() || s.layer_out.bytes() != bytes || s.callback == nullptr)
      return absl::InternalError("layer step without host hidden, layer_out or callback");
    if (s.position < -1 || s.position > int64_t{layer_->max_positions()} - s.s_q)
      return absl::OutOfRangeError(absl::StrCat("position: expected 0..", layer_->max_positions() - s.s_q,
                                                " for ", s.s_q, " tokens (--max_positions ",
                                                layer_->max_positions(), "), got ", s.position));
    return absl::OkStatus();
  }

  // Layer steps' positions, under the KV lock: the given one, or the layer's length now
  // (which Stage checks again). Then their queries and rows, without the lock.
  void PrepareLayerSteps(Batch& batch) {
    bool any = false;
    for (auto& e : batch.entries) any |= IsLayerStep(*e.step);
    if (!any) return;
    {
      absl::MutexLock lock(&kv_mu_);
      for (auto& e : batch.entries) {
        DecodeStep* s = e.step;
        if (!IsLayerStep(*s)) continue;
        e.expect_length = -1;
        if (s->position >= 0) {
          e.position = s->position;
          continue;
        }
        const kv::Sequence* seq = kv_.Find(s->sequence_id);
        if (seq == nullptr) {
          e.status = NotFound(s->sequence_id);
          continue;
        }
        e.position = e.expect_length = kv_.Length(seq, s->layer);
        if (e.position + s->s_q > layer_->max_positions())
          e.status = absl::OutOfRangeError(absl::StrCat("position: layer ", s->layer, " holds ", e.position,
                                                        " rows; ", s->s_q, " more pass the ", layer_->max_positions(),
                                                        " positions served (--max_positions)"));
      }
    }
    layer_->Prepare(batch);
  }

  // Hands a finished step to the completion threads, keyed by flow (a stream) so one
  // flow's steps complete in order on one thread.
  void Complete(DecodeStep* step, const absl::Status& status) {
    done_pool_->Push(step, status, step->flow != 0 ? step->flow : absl::HashOf(step->sequence_id));
  }
  // Consecutive steps of one callback (a stream's steps of one batch) are answered in
  // one StepsDone. A step is not touched once its callback has it.
  void RunCompletions(DecodeStep* const* steps, const absl::Status* statuses, int n) {
    for (int i = 0; i < n;) {
      StepCallback* cb = steps[i]->callback;
      int j = i + 1;
      while (j < n && steps[j]->callback == cb) ++j;
      cb->StepsDone(steps + i, statuses + i, j - i);
      i = j;
    }
    if (completed_.fetch_add(n) + n == accepted_.load()) SignalDone();
  }

  // A step counted as accepted was refused after all.
  void Unaccept() {
    if (accepted_.fetch_sub(1) - 1 == completed_.load()) SignalDone();
  }

  void SignalDone() {
    absl::MutexLock lock(&done_mu_);
    done_cv_.SignalAll();
  }

  // A SubmitBatch is queueing a message's steps: let it finish (microseconds: each
  // Submit is a validation and a push) so the batch holds all of them. Bounded, in
  // case a submitter is descheduled.
  void WaitForBatchSubmitters() {
    if (batch_submitters_.load() == 0) return;
    const absl::Time limit = absl::Now() + o_.batch_submit_wait;
    while (batch_submitters_.load() > 0 && absl::Now() < limit) std::this_thread::yield();
    Collect();
  }

  // Moves queued steps into the fair queue (per flow, in arrival order). O(new steps).
  void Collect() {
    incoming_.clear();
    if (queue_.DrainInto(&incoming_) == 0) return;
    if (fair_.empty()) window_start_ = incoming_.front()->enqueued_at;
    for (DecodeStep* s : incoming_) {
      // Cannot fail: the queue's bound covers every step not yet launched or dropped,
      // and the fair queue holds as many. Kept as a check, not an assumption.
      if (!fair_.Add(s)) {
        queue_.Done(1);
        failed_.push_back({s, absl::InternalError("scheduler: waiting room full")});
      }
    }
    incoming_.clear();
  }

  // Drops cancelled and expired steps wherever they wait (O(waiting)), then lets the
  // fair queue share the batch between flows (O(flows + batch * log flows)).
  void Form(Batch& batch) {
    batch.entries.clear();
    batch.tokens = 0;
    const absl::Time now = absl::Now();
    const int dropped = fair_.RemoveIf([&](DecodeStep* s) {
      if (s->cancelled != nullptr && s->cancelled->load()) {
        metrics_.Reject(RejectReason::kCancelled);
        failed_.push_back({s, absl::CancelledError("caller went away before the step was launched")});
        return true;
      }
      if (now > s->deadline) {
        metrics_.Reject(RejectReason::kDeadline);
        failed_.push_back({s, absl::DeadlineExceededError("deadline passed before the step was launched")});
        return true;
      }
      return false;
    });
    const int taken = fair_.Pick(o_.max_batch_size, o_.max_batch_tokens, [&](DecodeStep* s) {
      BatchEntry e;
      e.step = s;
      s->batched_at = now;
      batch.entries.push_back(e);
      batch.tokens += s->s_q;
    });
    queue_.Done(dropped + taken);
    if (taken > 0) {
      last_batch_flows_.store(fair_.last_pick_flows(), std::memory_order_relaxed);
      last_batch_max_flow_rows_.store(fair_.last_pick_max_flow_rows(), std::memory_order_relaxed);
    }
    waiting_flows_.store(fair_.flows(), std::memory_order_relaxed);
    batch.formed_at = now;
  }

  // Under the KV lock: appends each step's rows (pages reserved, copy-on-write done) and
  // hands the batch to the backend's staging.
  void Stage(Batch& batch) {
    const absl::Time now = absl::Now();
    absl::MutexLock lock(&kv_mu_);
    // The batch reads its pages until Finish, after the lock is gone: pages a release
    // frees meanwhile are not handed out again before then.
    batch.kv_read = kv_.OpenRead();
    const int64_t num_pages = backend_->kv_config().num_pages;
    for (auto& e : batch.entries) {
      if (!e.status.ok()) continue;  // a layer step whose queries could not be made
      DecodeStep* s = e.step;
      kv::Sequence* seq = e.seq = kv_.Find(s->sequence_id);
      if (seq == nullptr) {
        e.status = NotFound(s->sequence_id);
        continue;
      }
      e.status = kv_.ReserveAppend(seq, s->layer, s->s_q, e.slots, &e.num_slots);
      if (!e.status.ok()) {
        if (absl::IsResourceExhausted(e.status)) rejected_out_of_pages_.fetch_add(1);
        continue;
      }
      kv_.Touch(seq, now);
      e.seqlen = kv_.Length(seq, s->layer);
      if (e.expect_length >= 0 && e.seqlen - s->s_q != e.expect_length) {
        // Rows were uploaded to the layer since its positions were taken: the rotary
        // embedding would be wrong for these rows.
        e.status = absl::AbortedError(absl::StrCat("position: layer ", s->layer, " grew from ", e.expect_length,
                                                   " to ", e.seqlen - s->s_q, " rows while this step was prepared"));
        continue;
      }
      e.table_pages = static_cast<int>((e.seqlen + kernels::kPageSize - 1) / kernels::kPageSize);
      e.page_offset = int64_t{s->layer} * num_pages;
    }
    // Table pointers only after every reservation: a later step of the same sequence
    // (another layer) may have grown, and so moved, its block table. (A Sequence itself
    // does not move: the manager holds each behind a pointer, and none is added or
    // removed while this lock is held.)
    for (auto& e : batch.entries)
      if (e.status.ok()) e.table = kv_.BlockTable(e.seq).data();
    backend_->Stage(batch);
    // A step the backend could not stage gives its reserved rows back.
    for (auto& e : batch.entries) {
      if (!e.status.ok() && e.num_slots > 0) {
        if (e.seq != nullptr) kv_.TruncateLayer(e.seq, e.step->layer, e.seqlen - e.step->s_q);
        e.num_slots = 0;
      }
      e.table = nullptr;
      e.seq = nullptr;
    }
  }

  void FailCollected() {
    for (auto& f : failed_) Answer(f.step, f.status);
    FlushInline();
    failed_.clear();
  }

  // Steps marked complete_inline wait in a buffer for FlushInline, which runs their
  // callbacks on this (the scheduler) thread in runs of one callback; the others go to
  // the completion threads at once.
  void Answer(DecodeStep* step, const absl::Status& status) {
    if (!step->complete_inline) {
      Complete(step, status);
      return;
    }
    if (inline_count_ == inline_steps_.size()) FlushInline();
    inline_steps_[inline_count_] = step;
    inline_statuses_[inline_count_++] = status;
  }
  void FlushInline() {
    if (inline_count_ == 0) return;
    RunCompletions(inline_steps_.data(), inline_statuses_.data(), static_cast<int>(inline_count_));
    for (size_t i = 0; i < inline_count_; ++i) inline_statuses_[i] = absl::OkStatus();  // drop error payloads now
    inline_count_ = 0;
  }

  void Finish(Batch& batch) {
    backend_->Finish(batch);
    if (layer_ != nullptr) layer_->Complete(batch);
    const absl::Time finished = absl::Now();
    for (auto& e : batch.entries) {
      e.step->launched_at = batch.launched_at;
      e.step->finished_at = finished;
    }
    {
      absl::MutexLock lock(&kv_mu_);
      kv_.CloseRead(batch.kv_read);
      batch_taken_[batch.slot] = absl::InfiniteFuture();
    }
    const absl::Time now = absl::Now();
    int ok = 0;
    for (auto& e : batch.entries) {
      if (!e.status.ok()) continue;
      ++ok;
      metrics_.RecordQueueWait(batch.launched_at - e.step->enqueued_at);
    }
    // Metrics first, so a caller that sees its result also sees it counted.
    metrics_.RecordBatch(static_cast<int>(batch.entries.size()), ok, now - batch.launched_at, now);
    for (auto& e : batch.entries) Answer(e.step, e.status);
    FlushInline();
  }

  void Loop() {
    Batch* inflight = nullptr;
    int slot = 0;
    for (;;) {
      if (stop_.load() && queue_.size() == 0 && inflight == nullptr) break;
      if (fair_.empty() && inflight == nullptr) {
        if (o_.idle_spin > absl::ZeroDuration()) {
          const absl::Time until = absl::Now() + o_.idle_spin;
          while (!queue_.HasPending() && !stop_.load(std::memory_order_relaxed) && absl::Now() < until) {
          }
        }
        if (!queue_.HasPending()) queue_.WaitForWork(absl::Now() + absl::Milliseconds(50));
      }
      Collect();
      // An idle engine waits a short window for more steps to fill the batch, unless a
      // whole message (SubmitBatch) has arrived: its sender formed the batch already.
      if (inflight == nullptr && !fair_.empty() && o_.batch_window > absl::ZeroDuration() && !stop_.load() &&
          !unit_queued_.exchange(false)) {
        const absl::Time until = window_start_ + o_.batch_window;
        while (fair_.size() < o_.max_batch_size && absl::Now() < until) {
          queue_.WaitForWork(until);
          Collect();
          if (unit_queued_.exchange(false)) {
            Collect();  // the message's last pushes may have landed after the drain above
            break;
          }
        }
      }
      WaitForBatchSubmitters();
      Batch& batch = batches_[slot];
      batch.slot = slot;
      Form(batch);
      FailCollected();
      const bool launched = !batch.entries.empty();
      // A batch the device has already finished is delivered before the next one is
      // staged, so its results do not wait for that staging (tens to hundreds of us).
      if (launched && inflight != nullptr && backend_->Ready(*inflight)) {
        Finish(*inflight);
        inflight = nullptr;
      }
      if (launched) {
        if (tier_ != nullptr) PrepareResidency(batch, inflight);
        if (layer_ != nullptr) PrepareLayerSteps(batch);
        Stage(batch);
        batch.launched_at = absl::Now();
        backend_->Launch(batch);
        if (layer_ != nullptr) layer_->AfterLaunch(batch);
        slot ^= 1;
      }
      if (inflight != nullptr) Finish(*inflight);
      inflight = launched ? &batch : nullptr;
      if (inflight != nullptr && backend_->SynchronousLaunch()) {
        Finish(*inflight);  // already computed: holding it back would only add latency
        inflight = nullptr;
      }
    }
    // Shutdown: nothing is left queued (the loop drained it), so nothing is lost.
  }

  struct Failed {
    DecodeStep* step;
    absl::Status status;
  };

  const EngineOptions o_;
  std::unique_ptr<AttentionBackend> backend_;
  std::unique_ptr<LayerStage> layer_;  // null: the kernel-level API only

  mutable absl::Mutex kv_mu_;
  kv::KvCacheManager kv_ ABSL_GUARDED_BY(kv_mu_);
  uint64_t prefix_bytes_saved_ ABSL_GUARDED_BY(kv_mu_) = 0;
  // The host tier (null: none), its waiters and figures; batch_taken_[slot]: when the
  // batch in that slot took its steps (InfiniteFuture once finished), for SafeCutoff.
  const std::unique_ptr<kv::HostTier> tier_ ABSL_PT_GUARDED_BY(kv_mu_);
  absl::CondVar restore_cv_;
  absl::Time batch_taken_[2] ABSL_GUARDED_BY(kv_mu_) = {absl::InfiniteFuture(), absl::InfiniteFuture()};
  uint64_t restore_failures_ ABSL_GUARDED_BY(kv_mu_) = 0;
  double restore_seconds_ ABSL_GUARDED_BY(kv_mu_) = 0;

  StepQueue queue_;
  EngineMetricsRecorder metrics_;
  std::atomic<uint64_t> rejected_out_of_pages_{0};
  std::atomic<uint64_t> rejected_max_sequences_{0};
  std::atomic<uint64_t> append_chunks_{0};
  std::atomic<uint64_t> sequences_exported_{0}, export_bytes_{0};
  std::atomic<uint64_t> sequences_imported_{0}, import_bytes_{0}, import_failures_{0};
  std::atomic<int64_t> waiting_flows_{0};
  std::atomic<int> last_batch_flows_{0}, last_batch_max_flow_rows_{0};

  // Scheduler thread only.
  FairQueue fair_;                      // steps drained from queue_, not yet launched
  std::vector<std::string> missing_;    // PrepareResidency's offloaded ids
  std::vector<DecodeStep*> incoming_;   // one drain's worth (reserved max_queue)
  absl::Time window_start_;             // arrival of the oldest waiting step, roughly
  std::vector<Failed> failed_;
  Batch batches_[2];
  // Inline completions waiting for FlushInline (Answer), sized once (max_batch_size).
  std::vector<DecodeStep*> inline_steps_;
  std::vector<absl::Status> inline_statuses_;
  size_t inline_count_ = 0;

  std::atomic<bool> stop_{false};
  std::atomic<bool> draining_{false};
  std::atomic<bool> unit_queued_{false};  // a SubmitBatch of 2+ steps finished queueing
  std::atomic<int> batch_submitters_{0};  // SubmitBatch calls under way
  std::atomic<uint64_t> next_unit_{1};     // DecodeStep::unit of the next message
  std::atomic<uint64_t> accepted_{0}, completed_{0};
  absl::Mutex done_mu_;
  absl::CondVar done_cv_;
  std::unique_ptr<CompletionPool> done_pool_;  // after everything RunCompletion reads
  std::thread scheduler_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  EngineOptions o = options;
  const auto& m = o.model;
  if (m.num_layers < 1) return absl::InvalidArgumentError("num_layers: expected >= 1");
  if (m.num_heads_kv < 1) return absl::InvalidArgumentError("num_heads_kv: expected >= 1");
  if (m.num_heads_q < 1 || m.num_heads_q % m.num_heads_kv != 0 ||
      m.num_heads_q / m.num_heads_kv > kernels::kMaxHeadsPerKvHead)
    return absl::InvalidArgumentError(absl::StrCat("num_heads_q: expected a multiple of num_heads_kv=",
                                                   m.num_heads_kv, " with at most ", kernels::kMaxHeadsPerKvHead,
                                                   " query heads per KV head, got ", m.num_heads_q));
  if (o.layer_config != nullptr) {
    // The layer API computes the queries, so the scale is the model's, YaRN mscale included.
    const float scale = static_cast<float>(model::SoftmaxScale(*o.layer_config));
    if (o.model.softmax_scale > 0.f && std::fabs(o.model.softmax_scale - scale) > 1e-6f * scale)
      return absl::InvalidArgumentError(absl::StrCat("softmax_scale: expected config.json's ", scale, " for the layer API, got ",
                                                     o.model.softmax_scale));
    o.model.softmax_scale = scale;
  }
  if (o.model.softmax_scale <= 0.f) o.model.softmax_scale = 1.0f / std::sqrt(float(kHeadDimQK));
  if (o.max_batch_size < 1) return absl::InvalidArgumentError("max_batch_size: expected >= 1");
  if (o.max_s_q < 1 || o.max_s_q > 64) return absl::InvalidArgumentError("max_s_q: expected 1..64");
  static_assert(kv::KvCacheManager::MaxAppendSlots(64) <= kMaxAppendSlots, "BatchEntry::slots too small");
  if (o.max_batch_tokens < o.max_s_q)
    return absl::InvalidArgumentError("max_batch_tokens: expected >= max_s_q");
  if (o.max_queue < 1) return absl::InvalidArgumentError("max_queue: expected >= 1");
  // The backend the engine will run: the layer stage's weights go where its math runs,
  // and on the GPU they are allocated before the KV pool takes its share of what is free.
  const BackendKind kind =
      o.backend == BackendKind::kAuto ? (CudaDevicePresent() ? BackendKind::kCuda : BackendKind::kCpu) : o.backend;
  std::unique_ptr<LayerStage> layer;
  if (o.layer_weights != nullptr || o.layer_config != nullptr) {
    auto st = LayerStage::Create(o, kind == BackendKind::kCuda);
    if (!st.ok()) return st.status();
    layer = *std::move(st);
  }
  auto backend = MakeBackend(kind, o);  // BackendOptions is EngineOptions
  if (!backend.ok()) return backend.status();
  if (layer != nullptr) {
    if (absl::Status st = layer->Attach(backend->get()); !st.ok()) return st;
  }
  std::unique_ptr<kv::HostTier> tier;
  if (o.host_kv_bytes < 0) return absl::InvalidArgumentError("host_kv_bytes: expected >= 0");
  if (o.host_kv_bytes > 0) {
    auto t = kv::HostTier::Create(o.host_kv_bytes, (*backend)->kv_config().row_bytes());
    if (!t.ok()) return t.status();
    tier = *std::move(t);
  }
  // The stage holds the weights in its own form now; the options' copy is not kept.
  o.layer_weights.reset();
  return std::unique_ptr<Engine>(new EngineImpl(o, std::move(*backend), std::move(layer), std::move(tier)));
}

}  // namespace latentd::engine
