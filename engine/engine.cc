// The engine: sequences and their KV pages, and the scheduler loop that batches every
// caller's decode steps into one launch (continuous batching, FIFO by arrival, at
// most one step per (sequence, layer) per batch, while the previous batch computes).
#include "engine/engine.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine/attention_backend.h"
#include "engine/batch.h"
#include "engine/metrics.h"
#include "engine/step_queue.h"
#include "kernels/params.h"

namespace latentd::engine {
namespace {

using kernels::kHeadDimQK;
using kernels::kHeadDimV;

class EngineImpl final : public Engine {
 public:
  EngineImpl(const EngineOptions& o, std::unique_ptr<AttentionBackend> backend)
      : o_(o),
        backend_(std::move(backend)),
        kv_(backend_->kv_config(), backend_->storage()),
        queue_(o.max_queue) {
    for (auto& b : batches_) b.entries.reserve(o.max_batch_size);
    pending_.reserve(o.max_queue);
    merge_scratch_.reserve(o.max_queue);
    failed_.reserve(o.max_queue);
    scheduler_ = std::thread([this] {
      pthread_setname_np(pthread_self(), "latentd-sched");  // for top -H and debuggers
      Loop();
    });
  }

  ~EngineImpl() override {
    stop_.store(true);
    queue_.Wake();
    scheduler_.join();
  }

  EngineInfo Info() const override {
    EngineInfo info;
    info.model = o_.model;
    info.backend = backend_->Name();
    info.max_batch_size = o_.max_batch_size;
    absl::MutexLock lock(&kv_mu_);
    const auto stats = kv_.GetStats();
    info.total_pages = stats.total_pages;
    info.free_pages = stats.free_pages;
    return info;
  }

  absl::StatusOr<std::string> CreateSequence(absl::string_view id) override {
    absl::MutexLock lock(&kv_mu_);
    auto seq = kv_.CreateSequence(id);
    if (!seq.ok()) return seq.status();
    kv_.Touch(*seq, absl::Now());
    return kv_.Id(*seq);
  }

  absl::StatusOr<SequenceLengths> AppendKv(absl::string_view id, int layer, absl::string_view kv) override {
    if (id.empty()) return absl::InvalidArgumentError("sequence_id: expected a non-empty id");
    if (layer < 0 || layer >= o_.model.num_layers)
      return absl::InvalidArgumentError(
          absl::StrCat("layer: expected 0..", o_.model.num_layers - 1, ", got ", layer));
    const size_t row = RowBytes();
    if (kv.empty() || kv.size() % row != 0)
      return absl::InvalidArgumentError(absl::StrCat("kv: expected a positive multiple of ", row,
                                                     " bytes ([n, h_kv=", o_.model.num_heads_kv, ", 576] ",
                                                     kernels::DTypeName(o_.model.dtype), "), got ", kv.size()));
    absl::MutexLock lock(&kv_mu_);
    kv::Sequence* seq = kv_.Find(id);
    if (seq == nullptr) return NotFound(id);
    absl::Status st = kv_.Append(seq, layer, kv.data(), static_cast<int>(kv.size() / row));
    if (!st.ok()) {
      if (absl::IsResourceExhausted(st)) rejected_out_of_pages_.fetch_add(1);
      return st;
    }
    kv_.Touch(seq, absl::Now());
    return LengthsOf(seq);
  }

  absl::StatusOr<std::string> ForkSequence(absl::string_view id, absl::string_view new_id) override {
    if (id.empty()) return absl::InvalidArgumentError("sequence_id: expected a non-empty id");
    absl::MutexLock lock(&kv_mu_);
    if (kv_.Find(id) == nullptr) return NotFound(id);
    auto seq = kv_.Fork(id, new_id);
    if (!seq.ok()) return seq.status();
    kv_.Touch(*seq, absl::Now());
    return kv_.Id(*seq);
  }

  absl::StatusOr<int64_t> ReleaseSequence(absl::string_view id) override {
    if (id.empty()) return absl::InvalidArgumentError("sequence_id: expected a non-empty id");
    absl::MutexLock lock(&kv_mu_);
    if (kv_.Find(id) == nullptr) return NotFound(id);
    return kv_.Release(id);
  }

  int ReleaseIdleSequences(absl::Duration ttl) override {
    absl::MutexLock lock(&kv_mu_);
    int released = 0;
    for (const std::string& id : kv_.IdleSequences(absl::Now() - ttl))
      if (kv_.Release(id).ok()) ++released;
    return released;
  }

  absl::Status Submit(DecodeStep* step) override {
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
    st = queue_.Push(step, absl::HashOf(step->sequence_id));
    if (!st.ok()) {
      Unaccept();
      metrics_.Reject(RejectReason::kQueueFull);
      return st;
    }
    return absl::OkStatus();
  }

  EngineMetrics Metrics() const override {
    EngineMetrics m = metrics_.Snapshot();
    {
      absl::MutexLock lock(&kv_mu_);
      const auto stats = kv_.GetStats();
      m.pages_used = stats.used_pages;
      m.pages_free = stats.free_pages;
      m.pages_high_water = stats.high_water_pages;
      m.sequences = stats.sequences;
    }
    m.rejected_out_of_pages += rejected_out_of_pages_.load();
    m.queued_steps = queue_.size();
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
  size_t RowBytes() const { return size_t(o_.model.num_heads_kv) * kHeadDimQK * 2; }

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
    const size_t q_bytes = size_t(s.s_q) * m.num_heads_q * kHeadDimQK * 2;
    if (s.q.size() != q_bytes)
      return absl::InvalidArgumentError(absl::StrCat("q: expected ", q_bytes, " bytes ([s_q=", s.s_q,
                                                     ", h_q=", m.num_heads_q, ", 576] ", dt, "), got ",
                                                     s.q.size()));
    const size_t kv_bytes = size_t(s.s_q) * RowBytes();
    if (s.kv.size() != kv_bytes)
      return absl::InvalidArgumentError(absl::StrCat("kv: expected ", kv_bytes, " bytes ([s_q=", s.s_q,
                                                     ", h_kv=", m.num_heads_kv, ", 576] ", dt, "), got ",
                                                     s.kv.size()));
    if (s.out == nullptr || s.lse == nullptr || s.callback == nullptr)
      return absl::InternalError("decode step without out, lse or callback");
    return absl::OkStatus();
  }

  void Complete(DecodeStep* step, const absl::Status& status) {
    step->callback->StepDone(step, status);
    if (completed_.fetch_add(1) + 1 == accepted_.load()) SignalDone();
  }

  // A step counted as accepted was refused after all.
  void Unaccept() {
    if (accepted_.fetch_sub(1) - 1 == completed_.load()) SignalDone();
  }

  void SignalDone() {
    absl::MutexLock lock(&done_mu_);
    done_cv_.SignalAll();
  }

  // Moves queued steps into pending_, keeping arrival order. The merge goes through
  // merge_scratch_ (reserved once) rather than std::inplace_merge, which allocates.
  void Collect() {
    const size_t before = pending_.size();
    if (queue_.DrainInto(&pending_) > 0 && before > 0) {
      merge_scratch_.clear();
      std::merge(pending_.begin(), pending_.begin() + before, pending_.begin() + before, pending_.end(),
                 std::back_inserter(merge_scratch_), [](const DecodeStep* a, const DecodeStep* b) {
                   return StepQueue::Arrival(a) < StepQueue::Arrival(b);
                 });
      pending_.swap(merge_scratch_);
    }
  }

  // Takes steps off the front of pending_ into batch, in arrival order. Stops at the
  // first step that does not fit, so FIFO holds and no sequence starves; a second step
  // for a (sequence, layer) already in the batch waits for the next one.
  void Form(Batch& batch) {
    batch.entries.clear();
    batch.tokens = 0;
    const absl::Time now = absl::Now();
    size_t keep = 0, i = 0;
    bool closed = false;
    for (; i < pending_.size(); ++i) {
      DecodeStep* s = pending_[i];
      if (s->cancelled != nullptr && s->cancelled->load()) {
        metrics_.Reject(RejectReason::kCancelled);
        failed_.push_back({s, absl::CancelledError("caller went away before the step was launched")});
        continue;
      }
      if (now > s->deadline) {
        metrics_.Reject(RejectReason::kDeadline);
        failed_.push_back({s, absl::DeadlineExceededError("deadline passed before the step was launched")});
        continue;
      }
      bool duplicate = false;
      if (!closed) {
        for (const auto& e : batch.entries)
          if (e.step->layer == s->layer && e.step->sequence_id == s->sequence_id) {
            duplicate = true;
            break;
          }
        if (static_cast<int>(batch.entries.size()) >= o_.max_batch_size ||
            batch.tokens + s->s_q > o_.max_batch_tokens)
          closed = true;
      }
      if (closed || duplicate) {
        pending_[keep++] = s;
        continue;
      }
      BatchEntry e;
      e.step = s;
      batch.entries.push_back(e);
      batch.tokens += s->s_q;
    }
    queue_.Done(static_cast<int>(pending_.size() - keep));
    pending_.resize(keep);
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
      DecodeStep* s = e.step;
      kv::Sequence* seq = kv_.Find(s->sequence_id);
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
      e.table_pages = static_cast<int>((e.seqlen + kernels::kPageSize - 1) / kernels::kPageSize);
      e.page_offset = int64_t{s->layer} * num_pages;
    }
    // Table pointers only after every reservation: a later step of the same sequence
    // (another layer) may have grown, and so moved, its block table.
    for (auto& e : batch.entries)
      if (e.status.ok()) e.table = kv_.BlockTable(kv_.Find(e.step->sequence_id)).data();
    backend_->Stage(batch);
    // A step the backend could not stage gives its reserved rows back.
    for (auto& e : batch.entries) {
      if (!e.status.ok() && e.num_slots > 0) {
        kv::Sequence* seq = kv_.Find(e.step->sequence_id);
        if (seq != nullptr) kv_.TruncateLayer(seq, e.step->layer, e.seqlen - e.step->s_q);
        e.num_slots = 0;
      }
      e.table = nullptr;
    }
  }

  void FailCollected() {
    for (auto& f : failed_) Complete(f.step, f.status);
    failed_.clear();
  }

  void Finish(Batch& batch) {
    backend_->Finish(batch);
    {
      absl::MutexLock lock(&kv_mu_);
      kv_.CloseRead(batch.kv_read);
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
    for (auto& e : batch.entries) Complete(e.step, e.status);
  }

  void Loop() {
    Batch* inflight = nullptr;
    int slot = 0;
    for (;;) {
      if (stop_.load() && queue_.size() == 0 && inflight == nullptr) break;
      if (pending_.empty() && inflight == nullptr) queue_.WaitForWork(absl::Now() + absl::Milliseconds(50));
      Collect();
      // An idle engine waits a short window for more steps to fill the batch.
      if (inflight == nullptr && !pending_.empty() && o_.batch_window > absl::ZeroDuration() && !stop_.load()) {
        const absl::Time until = pending_.front()->enqueued_at + o_.batch_window;
        while (static_cast<int>(pending_.size()) < o_.max_batch_size && absl::Now() < until) {
          queue_.WaitForWork(until);
          Collect();
        }
      }
      Batch& batch = batches_[slot];
      batch.slot = slot;
      Form(batch);
      FailCollected();
      const bool launched = !batch.entries.empty();
      if (launched) {
        Stage(batch);
        batch.launched_at = absl::Now();
        backend_->Launch(batch);
        slot ^= 1;
      }
      if (inflight != nullptr) Finish(*inflight);
      inflight = launched ? &batch : nullptr;
    }
    // Shutdown: nothing is left queued (the loop drained it), so nothing is lost.
  }

  struct Failed {
    DecodeStep* step;
    absl::Status status;
  };

  const EngineOptions o_;
  std::unique_ptr<AttentionBackend> backend_;

  mutable absl::Mutex kv_mu_;
  kv::KvCacheManager kv_ ABSL_GUARDED_BY(kv_mu_);

  StepQueue queue_;
  EngineMetricsRecorder metrics_;
  std::atomic<uint64_t> rejected_out_of_pages_{0};

  // Scheduler thread only.
  std::vector<DecodeStep*> pending_;
  std::vector<DecodeStep*> merge_scratch_;
  std::vector<Failed> failed_;
  Batch batches_[2];

  std::atomic<bool> stop_{false};
  std::atomic<bool> draining_{false};
  std::atomic<uint64_t> accepted_{0}, completed_{0};
  absl::Mutex done_mu_;
  absl::CondVar done_cv_;
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
  if (o.model.softmax_scale <= 0.f) o.model.softmax_scale = 1.0f / std::sqrt(float(kHeadDimQK));
  if (o.max_batch_size < 1) return absl::InvalidArgumentError("max_batch_size: expected >= 1");
  if (o.max_s_q < 1 || o.max_s_q > 64) return absl::InvalidArgumentError("max_s_q: expected 1..64");
  static_assert(kv::KvCacheManager::MaxAppendSlots(64) <= kMaxAppendSlots, "BatchEntry::slots too small");
  if (o.max_batch_tokens < o.max_s_q)
    return absl::InvalidArgumentError("max_batch_tokens: expected >= max_s_q");
  if (o.max_queue < 1) return absl::InvalidArgumentError("max_queue: expected >= 1");
  BackendOptions b;
  b.model = o.model;
  b.device = o.device;
  b.max_batch_size = o.max_batch_size;
  b.max_batch_tokens = o.max_batch_tokens;
  b.max_s_q = o.max_s_q;
  b.cpu_threads = o.cpu_threads;
  b.kv_pages = o.kv_pages;
  b.kv_bytes = o.kv_bytes;
  b.kv_memory_fraction = o.kv_memory_fraction;
  auto backend = MakeBackend(o.backend, b);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<Engine>(new EngineImpl(o, std::move(*backend)));
}

}  // namespace latentd::engine
