// The CUDA attention backend: KV pool in device memory, one decode launch per group of
// steps (planner on the host, SM80 kernel and combine from kernels/). Inputs travel in
// one pinned host-to-device copy per batch on a copy stream, so the next batch's copy
// overlaps this batch's compute; results come back into pinned memory on a stream of
// their own, so the next batch's kernel does not wait behind them. Two staging
// slots, allocated once: nothing is allocated per step. Steps whose tensors lie in
// registered host memory (a same-host client's region) skip the host staging: one
// copy-list kernel reads their q and rows from it over PCIe, another writes out and lse
// back into it. Steps whose inputs only are there (a stream's own registered buffers)
// are read the same way and get their results staged.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine/attention_backend.h"
#include "engine/backend_common.h"
#include "engine/cuda/scatter_rows.h"
#include "engine/kv/cuda_storage.h"
#include "kernels/mla_decode_cuda.h"

namespace latentd::engine {
namespace {

using kernels::kHeadDimQK;
using kernels::kHeadDimV;
using kernels::kPageSize;

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

size_t AlignUp(size_t x) { return (x + 255) / 256 * 256; }

// Bytes of the device allocation that starts at `base`, from the driver (the runtime
// has no query for it): cuMemGetAddressRange, reached through the runtime's entry point.
absl::StatusOr<uint64_t> AllocationSize(uint64_t base) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetAddressRange fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<GetAddressRange>(f);
  }();
  if (fn == nullptr) return absl::InternalError("open_cuda_region: the driver has no cuMemGetAddressRange");
  CUdeviceptr start = 0;
  size_t size = 0;
  if (fn(&start, &size, static_cast<CUdeviceptr>(base)) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError("open_cuda_region.ipc_handle: the driver knows no allocation behind it");
  }
  // IPC maps whole allocations, so the mapping starts where the allocation does.
  return static_cast<uint64_t>(start + size - base);
}

class CudaBackend final : public AttentionBackend {
 public:
  ~CudaBackend() override {
    cudaSetDevice(o_.device);
    cudaStreamSynchronize(copy_stream_);
    cudaStreamSynchronize(stream_);
    cudaStreamSynchronize(out_stream_);
    storage_.reset();
    for (auto& s : slots_) {
      cudaFreeHost(s.host_in);
      cudaFree(s.dev_in);
      cudaFreeHost(s.host_out);
      cudaFree(s.dev_out);
      if (s.h2d_done) cudaEventDestroy(s.h2d_done);
      if (s.computed) cudaEventDestroy(s.computed);
      if (s.done) cudaEventDestroy(s.done);
    }
    cudaFree(workspace_);
    if (copy_stream_) cudaStreamDestroy(copy_stream_);
    if (out_stream_) cudaStreamDestroy(out_stream_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  absl::Status Init(const BackendOptions& o) {
    o_ = o;
    absl::Status st = CudaStatus(cudaSetDevice(o.device), "cudaSetDevice");
    if (!st.ok()) return st;
    kernels::Status ks = kernels::QueryDevice(o.device, &dev_);
    if (!ks.ok()) return absl::InternalError("QueryDevice: " + ks.message);
    name_ = absl::StrCat("cuda:", dev_.name);
    if (!(st = CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream")).ok()) return st;
    if (!(st = CudaStatus(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking), "stream")).ok()) return st;
    if (!(st = CudaStatus(cudaStreamCreateWithFlags(&out_stream_, cudaStreamNonBlocking), "stream")).ok()) return st;

    const int h_q = o.model.num_heads_q, T = o.max_batch_tokens, E = o.max_batch_size;
    // Staging carries rows as clients send them (16-bit); the scatter quantizes them into
    // an fp8 pool on the device.
    row_bytes_ = size_t(o.model.num_heads_kv) * kHeadDimQK * 2;
    // The largest batch's inputs ahead of its block tables; Stage packs each batch tighter.
    max_fixed_in_bytes_ = AlignUp(size_t(T) * h_q * kHeadDimQK * 2);
    max_fixed_in_bytes_ = AlignUp(max_fixed_in_bytes_ + size_t(T) * row_bytes_);
    max_fixed_in_bytes_ = AlignUp(max_fixed_in_bytes_ + size_t(T) * sizeof(int64_t));
    max_fixed_in_bytes_ = AlignUp(max_fixed_in_bytes_ + size_t(E) * sizeof(int32_t));
    // Copy lists of steps in registered memory: q and rows in, out and lse back.
    max_fixed_in_bytes_ = AlignUp(max_fixed_in_bytes_ + size_t(4) * E * sizeof(DeviceCopy));
    out_lse_bytes_ = AlignUp(size_t(T) * h_q * sizeof(float));
    out_bytes_ = out_lse_bytes_ + size_t(T) * h_q * kHeadDimV * 2;
    for (auto& s : slots_) {
      if (!(st = GrowSlot(s, 256)).ok()) return st;
      if (!(st = CudaStatus(cudaHostAlloc(reinterpret_cast<void**>(&s.host_out), out_bytes_, cudaHostAllocDefault),
                            "cudaHostAlloc")).ok())
        return st;
      if (!(st = CudaStatus(cudaMalloc(reinterpret_cast<void**>(&s.dev_out), out_bytes_), "cudaMalloc")).ok()) return st;
      if (!(st = CudaStatus(cudaEventCreateWithFlags(&s.h2d_done, cudaEventDisableTiming), "event")).ok()) return st;
      if (!(st = CudaStatus(cudaEventCreateWithFlags(&s.computed, cudaEventDisableTiming), "event")).ok()) return st;
      if (!(st = CudaStatus(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming), "event")).ok()) return st;
      s.order.reserve(E);
      s.groups.reserve(E);
      s.plans.resize(E);
    }
    for (int s_q = 1; s_q <= o.max_s_q; ++s_q) {
      const int b = std::max(1, std::min(E, T / s_q));
      workspace_bytes_ = std::max(workspace_bytes_,
                                  kernels::MaxDecodeWorkspaceBytes(dev_, b, s_q, h_q, o.model.num_heads_kv));
    }
    if (workspace_bytes_ > 0) {
      if (!(st = CudaStatus(cudaMalloc(&workspace_, workspace_bytes_), "cudaMalloc workspace")).ok()) return st;
    }

    // The pool takes what the sizing asks for, from memory left after the buffers above.
    size_t free_bytes = 0, total_bytes = 0;
    if (!(st = CudaStatus(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo")).ok()) return st;
    BackendOptions sized = o;
    if (sized.kv_pages <= 0 && sized.kv_bytes <= 0 && sized.kv_memory_fraction <= 0) sized.kv_memory_fraction = 0.8;
    auto pages = PoolPages(sized, static_cast<int64_t>(free_bytes));
    if (!pages.ok()) return pages.status();
    config_ = PoolShape(o);
    config_.num_pages = *pages;
    auto storage = kv::MakeCudaKvStorage(config_, o.device, stream_);
    if (!storage.ok()) return storage.status();
    storage_ = std::move(*storage);
    return absl::OkStatus();
  }

  std::string Name() const override { return name_; }
  kv::KvStorage* storage() override { return storage_.get(); }

  uint64_t RegisterHostMemory(void* base, size_t bytes) override {
    cudaSetDevice(o_.device);
    if (cudaHostRegister(base, bytes, cudaHostRegisterMapped) != cudaSuccess) {
      cudaGetLastError();  // not sticky; the caller falls back to staged copies
      return 0;
    }
    void* dev = nullptr;
    if (cudaHostGetDevicePointer(&dev, base, 0) != cudaSuccess) {
      cudaGetLastError();
      cudaHostUnregister(base);
      return 0;
    }
    return reinterpret_cast<uint64_t>(dev);
  }

  void UnregisterHostMemory(void* base) override {
    cudaSetDevice(o_.device);
    cudaHostUnregister(base);
  }

  absl::StatusOr<DeviceMemory> OpenDeviceMemory(absl::string_view ipc_handle, uint64_t offset,
                                                uint64_t bytes) override {
    cudaIpcMemHandle_t handle;
    if (ipc_handle.size() != sizeof(handle.reserved)) {
      return absl::InvalidArgumentError(absl::StrCat("open_cuda_region.ipc_handle: ", ipc_handle.size(),
                                                     " bytes; expected ", sizeof(handle.reserved),
                                                     " (a cudaIpcMemHandle_t from cudaIpcGetMemHandle)"));
    }
    std::memcpy(handle.reserved, ipc_handle.data(), sizeof(handle.reserved));
    cudaSetDevice(o_.device);
    void* base = nullptr;
    cudaError_t err = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();  // not sticky: this client's request failed, nothing else
      return absl::InvalidArgumentError(absl::StrCat("open_cuda_region.ipc_handle: cudaIpcOpenMemHandle: ",
                                                     cudaGetErrorString(err),
                                                     "; expected the handle of a live allocation of a process on "
                                                     "this host, not already opened by this daemon"));
    }
    // The kernels trust every address they are given: a range past the allocation's end
    // would fault the device for every client, so it is refused here.
    const absl::StatusOr<uint64_t> size = AllocationSize(reinterpret_cast<uint64_t>(base));
    absl::Status st = size.status();
    if (st.ok() && (offset > *size || bytes > *size - offset)) {
      st = absl::InvalidArgumentError(absl::StrCat("open_cuda_region: offset ", offset, " + bytes ", bytes,
                                                   "; expected offset + bytes <= the allocation's ", *size,
                                                   " bytes"));
    }
    if (!st.ok()) {
      cudaIpcCloseMemHandle(base);
      cudaGetLastError();
      return st;
    }
    DeviceMemory m;
    m.mapping = reinterpret_cast<uint64_t>(base);
    m.address = m.mapping + offset;
    return m;
  }

  void CloseDeviceMemory(const DeviceMemory& memory) override {
    cudaSetDevice(o_.device);
    cudaIpcCloseMemHandle(reinterpret_cast<void*>(memory.mapping));
    cudaGetLastError();
  }
  const kv::KvCacheConfig& kv_config() const override { return config_; }

  void* compute_stream() override { return stream_; }
  void* input_stream() override { return copy_stream_; }
  int device() const override { return o_.device; }
  void* results_event(const Batch& batch) override { return slots_[batch.slot].done; }

  void Stage(Batch& batch) override {
    Slot& s = slots_[batch.slot];
    const int h_q = o_.model.num_heads_q;
    GroupBatch(batch, &s.order, &s.groups);
    s.width = MaxTablePages(batch);
    if (s.width > s.table_capacity) {
      absl::Status st = GrowSlot(s, std::max(s.width, 2 * s.table_capacity));
      if (!st.ok()) {
        for (auto& e : batch.entries)
          if (e.status.ok()) e.status = st;
        s.order.clear();
        s.groups.clear();
        return;
      }
    }
    // Packed for this batch's sizes, so the one input copy moves only what is used.
    int tokens = 0;
    for (int k : s.order) tokens += batch.entries[k].step->s_q;
    const size_t entries = s.order.size();
    s.off_kv = AlignUp(size_t(tokens) * h_q * kHeadDimQK * 2);
    s.off_dst = AlignUp(s.off_kv + size_t(tokens) * row_bytes_);
    s.off_seqlens = AlignUp(s.off_dst + size_t(tokens) * sizeof(int64_t));
    s.off_copies = AlignUp(s.off_seqlens + entries * sizeof(int32_t));
    size_t direct = 0;  // copies of steps in registered memory: two in, and two out when out is there too
    for (int k : s.order) {
      const DecodeStep& step = *batch.entries[k].step;
      direct += (InputsDeviceDirect(step) ? 2 : 0) + (OutputsDeviceDirect(step) ? 2 : 0);
    }
    s.off_tables = AlignUp(s.off_copies + direct * sizeof(DeviceCopy));
    char* q = s.host_in;
    char* kv = s.host_in + s.off_kv;
    auto* dst = reinterpret_cast<int64_t*>(s.host_in + s.off_dst);
    auto* seqlens = reinterpret_cast<int32_t*>(s.host_in + s.off_seqlens);
    auto* tables = reinterpret_cast<int32_t*>(s.host_in + s.off_tables);
    auto* copies = reinterpret_cast<DeviceCopy*>(s.host_in + s.off_copies);
    s.copies_in = s.copies_out = 0;
    s.max_copy_in = s.max_copy_out = 0;
    s.staged_tokens = 0;
    const uint64_t dev_in = reinterpret_cast<uint64_t>(s.dev_in), dev_out = reinterpret_cast<uint64_t>(s.dev_out);
    const size_t q_token = size_t(h_q) * kHeadDimQK * 2, out_token = size_t(h_q) * kHeadDimV * 2;
    int token = 0;
    s.rows = 0;
    for (int k = 0; k < static_cast<int>(s.order.size()); ++k) {
      const BatchEntry& e = batch.entries[s.order[k]];
      const DecodeStep& step = *e.step;
      if (InputsDeviceDirect(step)) {
        // Registered host memory or a device region: the copy lists move it (in: q,
        // rows; out: out, lse).
        DeviceCopy* in = copies + 2 * s.copies_in;
        in[0] = {step.q.device(), dev_in + token * q_token, step.q.bytes()};
        in[1] = {step.kv.device(), dev_in + s.off_kv + s.rows * row_bytes_, step.kv.bytes()};
        s.max_copy_in = std::max<uint64_t>(s.max_copy_in, std::max(step.q.bytes(), step.kv.bytes()));
        ++s.copies_in;
      } else {
        std::memcpy(q + size_t(token) * q_token, step.q.host(), step.q.bytes());
        std::memcpy(kv + size_t(s.rows) * row_bytes_, step.kv.host(), step.kv.bytes());
      }
      if (!OutputsDeviceDirect(step)) s.staged_tokens += step.s_q;  // its results come back through host_out
      for (int r = 0; r < e.num_slots; ++r)
        for (int t = 0; t < e.slots[r].n; ++t)
          dst[s.rows++] = (e.page_offset + e.slots[r].page) * kPageSize + e.slots[r].row + t;
      WritePhysicalTable(e, s.width, tables + size_t(k) * s.width);
      seqlens[k] = static_cast<int32_t>(e.seqlen);
      token += step.s_q;
    }
    s.tokens = token;
    s.in_bytes = s.off_tables + entries * s.width * sizeof(int32_t);
    // Out copies follow the in copies: out and lse of each step in registered memory.
    token = 0;
    DeviceCopy* out_copies = copies + 2 * s.copies_in;
    for (int k : s.order) {
      const DecodeStep& step = *batch.entries[k].step;
      if (OutputsDeviceDirect(step)) {
        const size_t out_bytes = size_t(step.s_q) * out_token, lse_bytes = size_t(step.s_q) * h_q * sizeof(float);
        DeviceCopy* c = out_copies + 2 * s.copies_out;
        c[0] = {dev_out + out_lse_bytes_ + token * out_token, step.out.device(), out_bytes};
        c[1] = {dev_out + token * h_q * sizeof(float), step.lse.device(), lse_bytes};
        s.max_copy_out = std::max<uint64_t>(s.max_copy_out, out_bytes);
        ++s.copies_out;
      }
      token += step.s_q;
    }
    // Plans come from the host copy of the seqlens, before anything is sent.
    for (size_t g = 0; g < s.groups.size(); ++g) {
      kernels::MlaDecodeParams p = GroupParams(s, s.groups[g], /*device=*/false);
      kernels::Status ks = kernels::PlanDecode(dev_, p, seqlens + s.groups[g].first_entry, &s.plans[g]);
      if (!ks.ok()) FailGroup(batch, s, s.groups[g], absl::InternalError("PlanDecode: " + ks.message));
    }
    // The inputs' copy and the new rows' scatter are queued here, under the engine's KV
    // lock: a fork or copy-on-write queued on the same stream afterwards sees the rows.
    // The inputs (the staged copy, then the copy list's reads of registered memory over
    // PCIe) go on the copy stream, which only this slot's buffers concern, so they run
    // beside the previous batch's kernel; the compute stream waits for them.
    s.launch_status = absl::OkStatus();
    if (s.order.empty()) return;
    cudaSetDevice(o_.device);
    absl::Status st = CudaStatus(cudaMemcpyAsync(s.dev_in, s.host_in, s.in_bytes, cudaMemcpyHostToDevice, copy_stream_),
                                 "inputs to device");
    if (st.ok() && s.copies_in > 0)
      st = CudaStatus(static_cast<cudaError_t>(LaunchCopyList(reinterpret_cast<const DeviceCopy*>(
                                                                  s.dev_in + s.off_copies),
                                                              2 * s.copies_in, s.max_copy_in, copy_stream_)),
                      "inputs from registered memory");
    if (st.ok()) st = CudaStatus(cudaEventRecord(s.h2d_done, copy_stream_), "event");
    if (st.ok()) st = CudaStatus(cudaStreamWaitEvent(stream_, s.h2d_done, 0), "wait");
    if (st.ok() && config_.kv_dtype == kernels::KvDType::kFp8E4M3)
      st = CudaStatus(static_cast<cudaError_t>(LaunchScatterRowsFp8(
                          s.dev_in + s.off_kv, reinterpret_cast<const int64_t*>(s.dev_in + s.off_dst), s.rows,
                          o_.model.num_heads_kv, o_.model.dtype, storage_->base(), stream_)),
                      "scatter and quantize new rows");
    else if (st.ok())
      st = CudaStatus(static_cast<cudaError_t>(LaunchScatterRows(
                          s.dev_in + s.off_kv, reinterpret_cast<const int64_t*>(s.dev_in + s.off_dst), s.rows,
                          static_cast<int>(row_bytes_), storage_->base(), stream_)),
                      "scatter new rows");
    s.launch_status = st;
  }

  void Launch(Batch& batch) override {
    Slot& s = slots_[batch.slot];
    if (s.order.empty() || !s.launch_status.ok()) return;
    cudaSetDevice(o_.device);
    absl::Status st;
    for (size_t g = 0; g < s.groups.size(); ++g) {
      const LaunchGroup& grp = s.groups[g];
      if (!batch.entries[s.order[grp.first_entry]].status.ok()) continue;  // planning failed
      kernels::MlaDecodeParams p = GroupParams(s, grp, /*device=*/true);
      kernels::Status ks = kernels::LaunchDecode(p, s.plans[g], workspace_, workspace_bytes_, stream_);
      if (!ks.ok()) FailGroup(batch, s, grp, absl::InternalError("decode launch: " + ks.message));
    }
    const int h_q = o_.model.num_heads_q;
    // The results travel on the out stream, so the next batch's kernel starts as soon as
    // this one's is done. This slot's dev_out is written again only two batches later,
    // after Finish has waited for `done`.
    st = CudaStatus(cudaEventRecord(s.computed, stream_), "event");
    if (st.ok()) st = CudaStatus(cudaStreamWaitEvent(out_stream_, s.computed, 0), "wait");
    if (st.ok() && s.copies_out > 0)
      st = CudaStatus(static_cast<cudaError_t>(LaunchCopyList(
                          reinterpret_cast<const DeviceCopy*>(s.dev_in + s.off_copies) + 2 * s.copies_in,
                          2 * s.copies_out, s.max_copy_out, out_stream_)),
                      "results to registered memory");
    // Staged results come back in one copy each; skipped when every step wrote in place.
    if (st.ok() && s.staged_tokens > 0)
      st = CudaStatus(cudaMemcpyAsync(s.host_out, s.dev_out, size_t(s.tokens) * h_q * sizeof(float),
                                      cudaMemcpyDeviceToHost, out_stream_),
                      "lse to host");
    if (st.ok() && s.staged_tokens > 0)
      st = CudaStatus(cudaMemcpyAsync(s.host_out + out_lse_bytes_, s.dev_out + out_lse_bytes_,
                                      size_t(s.tokens) * h_q * kHeadDimV * 2, cudaMemcpyDeviceToHost, out_stream_),
                      "out to host");
    if (st.ok()) st = CudaStatus(cudaEventRecord(s.done, out_stream_), "event");
    s.launch_status = st;
  }

  bool Ready(Batch& batch) override {
    Slot& s = slots_[batch.slot];
    if (s.order.empty() || !s.launch_status.ok()) return true;
    return cudaEventQuery(s.done) != cudaErrorNotReady;  // an error is reported by Finish
  }

  void Finish(Batch& batch) override {
    Slot& s = slots_[batch.slot];
    if (s.order.empty()) return;
    absl::Status st = s.launch_status;
    if (st.ok()) st = CudaStatus(cudaEventSynchronize(s.done), "decode");
    if (!st.ok())
      for (int k : s.order)
        if (batch.entries[k].status.ok()) batch.entries[k].status = st;
    CopyResults(batch, s.order, o_.model.num_heads_q, s.host_out + out_lse_bytes_,
                reinterpret_cast<const float*>(s.host_out));
  }

 private:
  struct Slot {
    char* host_in = nullptr;  // pinned: q | new rows | destination rows | seqlens | block tables
    size_t off_kv = 0, off_dst = 0, off_seqlens = 0, off_copies = 0, off_tables = 0;  // this batch's packing
    int copies_in = 0, copies_out = 0;  // steps in registered memory (two copies each way)
    uint64_t max_copy_in = 0, max_copy_out = 0;
    int staged_tokens = 0;  // tokens of steps whose results come back through host_out
    char* dev_in = nullptr;
    char* host_out = nullptr;  // pinned: lse | out
    char* dev_out = nullptr;
    int table_capacity = 0;  // block table width the slot can hold
    cudaEvent_t h2d_done = nullptr, computed = nullptr, done = nullptr;
    std::vector<int> order;
    std::vector<LaunchGroup> groups;
    std::vector<kernels::DecodePlan> plans;
    int width = 1, rows = 0, tokens = 0;
    size_t in_bytes = 0;
    absl::Status launch_status;
  };

  // (Re)allocates a slot's input staging for block tables of `width` pages. Happens at
  // start-up and when a sequence grows past every width seen before, never per step.
  absl::Status GrowSlot(Slot& s, int width) {
    const size_t bytes = max_fixed_in_bytes_ + size_t(o_.max_batch_size) * width * sizeof(int32_t);
    if (s.host_in) cudaFreeHost(s.host_in);
    if (s.dev_in) cudaFree(s.dev_in);
    s.host_in = s.dev_in = nullptr;
    s.table_capacity = 0;
    absl::Status st = CudaStatus(cudaHostAlloc(reinterpret_cast<void**>(&s.host_in), bytes, cudaHostAllocDefault),
                                 "cudaHostAlloc staging");
    if (st.ok()) st = CudaStatus(cudaMalloc(reinterpret_cast<void**>(&s.dev_in), bytes), "cudaMalloc staging");
    if (st.ok()) s.table_capacity = width;
    return st;
  }

  kernels::MlaDecodeParams GroupParams(const Slot& s, const LaunchGroup& g, bool device) const {
    const int h_q = o_.model.num_heads_q;
    const char* in = device ? s.dev_in : s.host_in;
    char* out = device ? s.dev_out : s.host_out;
    kernels::MlaDecodeParams p = GroupShape(o_.model, config_, g, s.width);
    p.q = in + size_t(g.first_token) * h_q * kHeadDimQK * 2;
    p.kv = storage_->base();  // the planner validates pointers but reads none
    p.block_table = reinterpret_cast<const int32_t*>(in + s.off_tables) + size_t(g.first_entry) * s.width;
    p.seqlens = reinterpret_cast<const int32_t*>(in + s.off_seqlens) + g.first_entry;
    p.lse = reinterpret_cast<float*>(out) + size_t(g.first_token) * h_q;
    p.out = out + out_lse_bytes_ + size_t(g.first_token) * h_q * kHeadDimV * 2;
    return p;
  }

  void FailGroup(Batch& batch, const Slot& s, const LaunchGroup& g, const absl::Status& st) {
    for (int k = g.first_entry; k < g.first_entry + g.num_entries; ++k) batch.entries[s.order[k]].status = st;
  }

  BackendOptions o_;
  kernels::DeviceInfo dev_;
  std::string name_;
  kv::KvCacheConfig config_;
  std::unique_ptr<kv::KvStorage> storage_;
  cudaStream_t stream_ = nullptr, copy_stream_ = nullptr, out_stream_ = nullptr;
  Slot slots_[2];
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  size_t row_bytes_ = 0;
  size_t max_fixed_in_bytes_ = 0;
  size_t out_lse_bytes_ = 0, out_bytes_ = 0;
};

}  // namespace

bool CudaDevicePresent() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

absl::StatusOr<std::unique_ptr<AttentionBackend>> MakeCudaBackend(const BackendOptions& options) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return absl::UnavailableError("backend cuda: no CUDA device");
  if (options.device < 0 || options.device >= n)
    return absl::InvalidArgumentError(absl::StrCat("device: expected 0..", n - 1, ", got ", options.device));
  auto backend = std::make_unique<CudaBackend>();
  absl::Status st = backend->Init(options);
  if (!st.ok()) return st;
  return std::unique_ptr<AttentionBackend>(std::move(backend));
}

}  // namespace latentd::engine
