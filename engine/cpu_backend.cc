// The CPU attention backend: KV pool in host memory, attention by the exact CPU
// implementation in kernels/cpu on a fixed thread pool. Serves hosts without a GPU.
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "engine/attention_backend.h"
#include "engine/backend_common.h"
#include "kernels/cpu/mla_decode_cpu.h"

namespace latentd::engine {
namespace {

using kernels::kHeadDimQK;
using kernels::kHeadDimV;

class CpuBackend final : public AttentionBackend {
 public:
  CpuBackend(const BackendOptions& o, kv::KvCacheConfig config, std::unique_ptr<kv::KvStorage> storage)
      : o_(o), config_(config), storage_(std::move(storage)), decoder_(o.cpu_threads) {
    const int h_q = o.model.num_heads_q;
    const int h_kv = std::max(1, o.model.num_heads_kv);
    // Every launch shape the limits allow, sized once: no step allocates in the decoder.
    decoder_.Reserve(o.max_batch_size, h_kv, (h_q / h_kv) * o.max_s_q, config_.kv_dtype == kernels::KvDType::kFp8E4M3);
    q_.resize(size_t(o.max_batch_tokens) * h_q * kHeadDimQK);
    seqlens_.resize(o.max_batch_size);
    for (auto& s : slots_) {
      s.out.resize(size_t(o.max_batch_tokens) * h_q * kHeadDimV);
      s.lse.resize(size_t(o.max_batch_tokens) * h_q);
      s.order.reserve(o.max_batch_size);
      s.groups.reserve(o.max_batch_size);
    }
  }

  std::string Name() const override { return "cpu"; }
  bool SynchronousLaunch() const override { return true; }
  kv::KvStorage* storage() override { return storage_.get(); }
  const kv::KvCacheConfig& kv_config() const override { return config_; }

  void Stage(Batch& batch) override {
    const int h_q = o_.model.num_heads_q;
    // Steps carry 16-bit rows; the pool quantizes them when it stores fp8.
    const size_t row_bytes = size_t(config_.input_row_bytes());
    // New rows go straight into the host pool.
    for (auto& e : batch.entries) {
      // This backend reads and writes tensors on the host; a device region is the CUDA
      // backend's (OpenDeviceMemory fails here, so a server never sends one).
      if (e.status.ok() && !(e.step->q.on_host() && e.step->kv.on_host() && e.step->out.on_host()))
        e.status = absl::InternalError("cpu backend: the step's tensors are in device memory");
      if (!e.status.ok()) continue;
      const char* src = e.step->kv.host();
      const int layer = e.step->layer;
      for (int s = 0; s < e.num_slots && e.status.ok(); ++s) {
        const auto& slot = e.slots[s];
        e.status = storage_->WriteRows(layer, slot.page, slot.row, slot.n, src);
        src += slot.n * row_bytes;
      }
    }
    Slot& sl = slots_[batch.slot];
    GroupBatch(batch, &sl.order, &sl.groups);
    width_ = MaxTablePages(batch);
    if (tables_.size() < size_t(width_) * o_.max_batch_size) tables_.resize(size_t(width_) * o_.max_batch_size);
    int token = 0;
    for (int k = 0; k < static_cast<int>(sl.order.size()); ++k) {
      BatchEntry& e = batch.entries[sl.order[k]];
      const DecodeStep& s = *e.step;
      std::memcpy(q_.data() + size_t(token) * h_q * kHeadDimQK, s.q.host(), s.q.bytes());
      WritePhysicalTable(e, width_, tables_.data() + size_t(k) * width_);
      seqlens_[k] = static_cast<int32_t>(e.seqlen);
      token += s.s_q;
    }
  }

  void Launch(Batch& batch) override {
    const int h_q = o_.model.num_heads_q;
    Slot& sl = slots_[batch.slot];
    for (const auto& g : sl.groups) {
      kernels::MlaDecodeParams p = GroupShape(o_.model, config_, g, width_);
      p.q = q_.data() + size_t(g.first_token) * h_q * kHeadDimQK;
      p.kv = storage_->base();
      p.block_table = tables_.data() + size_t(g.first_entry) * width_;
      p.seqlens = seqlens_.data() + g.first_entry;
      p.out = sl.out.data() + size_t(g.first_token) * h_q * kHeadDimV;
      p.lse = sl.lse.data() + size_t(g.first_token) * h_q;
      const kernels::Status st = decoder_.Run(p);
      if (!st.ok()) {
        for (int k = g.first_entry; k < g.first_entry + g.num_entries; ++k)
          batch.entries[sl.order[k]].status = absl::InternalError("cpu attention: " + st.message);
      }
    }
  }

  void Finish(Batch& batch) override {
    const Slot& sl = slots_[batch.slot];
    CopyResults(batch, sl.order, o_.model.num_heads_q, reinterpret_cast<const char*>(sl.out.data()), sl.lse.data());
  }

 private:
  const BackendOptions o_;
  const kv::KvCacheConfig config_;
  std::unique_ptr<kv::KvStorage> storage_;
  kernels::CpuMlaDecoder decoder_;
  // Inputs are consumed by Launch; outputs wait in their slot until Finish, while the
  // scheduler already stages and runs the next batch.
  struct Slot {
    std::vector<uint16_t> out;
    std::vector<float> lse;
    std::vector<int> order;
    std::vector<LaunchGroup> groups;
  };
  std::vector<uint16_t> q_;
  std::vector<int32_t> tables_, seqlens_;
  Slot slots_[2];
  int width_ = 1;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCpuBackend(const BackendOptions& o) {
  const int64_t ram = int64_t{sysconf(_SC_PHYS_PAGES)} * sysconf(_SC_PAGE_SIZE);
  BackendOptions opts = o;
  if (opts.kv_pages <= 0 && opts.kv_bytes <= 0 && opts.kv_memory_fraction <= 0) opts.kv_bytes = int64_t{1} << 30;
  auto pages = PoolPages(opts, ram);
  if (!pages.ok()) return pages.status();
  kv::KvCacheConfig config = PoolShape(opts);
  config.num_pages = *pages;
  auto storage = kv::MakeHostKvStorage(config);
  if (!storage.ok()) return storage.status();
  return std::unique_ptr<AttentionBackend>(new CpuBackend(opts, config, std::move(*storage)));
}

}  // namespace latentd::engine
