// The layer stage on the CUDA backend: CudaLayerMath's projections on the backend's
// compute stream, with the queries, rows and latent outputs in device memory, so a batch
// of layer steps is one copy of hidden states in, one sequence of launches, one copy of
// outputs back.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "engine/attention_backend.h"
#include "engine/layer/cuda_layer_math.h"
#include "engine/layer/rope.h"
#include "engine/layer_stage.h"
#include "engine/model/config.h"
#include "engine/model/weights.h"
#include "kernels/params.h"

namespace latentd::engine {
namespace {

using kernels::kHeadDimQK;
using kernels::kHeadDimV;

absl::Status Cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("layer stage: ", what, ": ", cudaGetErrorString(err)));
}

size_t AlignUp(size_t x) { return (x + 255) / 256 * 256; }

// Device tensors of up to T tokens, carved from one allocation.
struct DeviceTensors {
  char* base = nullptr;
  int32_t* positions = nullptr;  // [T]
  uint16_t* hidden = nullptr;    // [T, H]
  uint16_t* q = nullptr;         // [T, h, 576]
  uint16_t* rows = nullptr;      // [T, 576]
  uint16_t* latent = nullptr;    // [T, h, 512]
  float* lse = nullptr;          // [T, h]
  uint16_t* out = nullptr;       // [T, H]

  absl::Status Allocate(size_t T, size_t H, size_t h) {
    const size_t sizes[] = {T * 4, T * H * 2, T * h * kHeadDimQK * 2, T * kHeadDimQK * 2, T * h * kHeadDimV * 2,
                            T * h * 4, T * H * 2};
    size_t total = 0;
    for (size_t s : sizes) total += AlignUp(s);
    if (absl::Status st = Cuda(cudaMalloc(reinterpret_cast<void**>(&base), total), "cudaMalloc"); !st.ok()) return st;
    char* p = base;
    auto next = [&](size_t i) {
      char* at = p;
      p += AlignUp(sizes[i]);
      return at;
    };
    positions = reinterpret_cast<int32_t*>(next(0));
    hidden = reinterpret_cast<uint16_t*>(next(1));
    q = reinterpret_cast<uint16_t*>(next(2));
    rows = reinterpret_cast<uint16_t*>(next(3));
    latent = reinterpret_cast<uint16_t*>(next(4));
    lse = reinterpret_cast<float*>(next(5));
    out = reinterpret_cast<uint16_t*>(next(6));
    return absl::OkStatus();
  }
};

// A device address as a TensorLocation of `bytes` bytes.
TensorLocation OnDevice(const void* p, size_t bytes) {
  return TensorLocation::InDeviceRegion(MemoryRegion{nullptr, reinterpret_cast<uint64_t>(p), bytes}, 0, bytes);
}

class CudaLayerStage final : public LayerStage {
 public:
  ~CudaLayerStage() override {
    cudaSetDevice(device_);
    if (compute_ != nullptr) cudaStreamSynchronize(compute_);
    for (Slot& s : slots_) {
      cudaFreeHost(s.host_in);
      cudaFreeHost(s.host_out);
      cudaFree(s.dev.base);
      for (cudaEvent_t e : {s.in_copied, s.prepared, s.done})
        if (e != nullptr) cudaEventDestroy(e);
    }
    cudaFreeHost(up_host_);
    cudaFree(up_dev_.base);
    if (up_done_ != nullptr) cudaEventDestroy(up_done_);
    math_.clear();  // before the shared handle and table go
  }

  static absl::StatusOr<std::unique_ptr<LayerStage>> Create(const EngineOptions& o) {
    std::unique_ptr<CudaLayerStage> st(new CudaLayerStage());
    if (absl::Status s = st->Init(o); !s.ok()) return s;
    if (absl::Status s = st->Build(o); !s.ok()) return s;
    return std::unique_ptr<LayerStage>(std::move(st));
  }

  absl::Status Attach(AttentionBackend* backend) override {
    compute_ = static_cast<cudaStream_t>(backend->compute_stream());
    input_ = static_cast<cudaStream_t>(backend->input_stream());
    if (compute_ == nullptr || input_ == nullptr || backend->device() != device_)
      return absl::InternalError("layer stage: the CUDA layer math needs the CUDA backend on its device");
    backend_ = backend;
    return absl::OkStatus();
  }

  void Prepare(Batch& batch) override {
    Slot& sl = slots_[batch.slot];
    CollectLayerEntries(batch, &sl.order);
    sl.tokens = 0;
    sl.status = absl::OkStatus();
    if (sl.order.empty()) return;
    const size_t H = hidden_, qw = size_t(heads_) * kHeadDimQK;
    auto* positions = reinterpret_cast<int32_t*>(sl.host_in);
    auto* hidden = reinterpret_cast<uint16_t*>(sl.host_in + host_hidden_at_);
    int t = 0;
    for (int k : sl.order) {
      const BatchEntry& e = batch.entries[k];
      std::memcpy(hidden + size_t(t) * H, e.step->hidden.host(), e.step->hidden.bytes());
      for (int j = 0; j < e.step->s_q; ++j) positions[t + j] = static_cast<int32_t>(e.position + j);
      t += e.step->s_q;
    }
    sl.tokens = t;
    cudaSetDevice(device_);
    // Hidden states in on the input stream (beside the previous batch's kernel); the
    // projections on the compute stream; the backend's copy of q and rows (input stream,
    // in Stage) after them.
    absl::Status st = Cuda(cudaMemcpyAsync(sl.dev.positions, positions, size_t(t) * 4, cudaMemcpyHostToDevice, input_),
                           "positions to device");
    if (st.ok())
      st = Cuda(cudaMemcpyAsync(sl.dev.hidden, hidden, size_t(t) * H * 2, cudaMemcpyHostToDevice, input_),
                "hidden states to device");
    if (st.ok()) st = Cuda(cudaEventRecord(sl.in_copied, input_), "event");
    if (st.ok()) st = Cuda(cudaStreamWaitEvent(compute_, sl.in_copied, 0), "wait");
    {
      absl::MutexLock lock(&math_mu_);
      ForEachLayerRun(batch, sl.order, [&](int layer, size_t a, size_t b, int t0, int n) {
        absl::Status run = st;
        layer::CudaLayerMath& math = *math_[layer];
        if (run.ok()) run = math.Queries(sl.dev.hidden + t0 * H, sl.dev.positions + t0, n, sl.dev.q + t0 * qw, compute_);
        if (run.ok())
          run = math.LatentRows(sl.dev.hidden + t0 * H, sl.dev.positions + t0, n, sl.dev.rows + t0 * kHeadDimQK,
                                compute_);
        int tt = t0;
        for (size_t k = a; k < b; ++k) {
          BatchEntry& e = batch.entries[sl.order[k]];
          DecodeStep& s = *e.step;
          if (!run.ok()) {
            e.status = run;
          } else {
            s.q = OnDevice(sl.dev.q + size_t(tt) * qw, size_t(s.s_q) * qw * 2);
            s.kv = OnDevice(sl.dev.rows + size_t(tt) * kHeadDimQK, size_t(s.s_q) * kHeadDimQK * 2);
            s.out = OnDevice(sl.dev.latent + size_t(tt) * heads_ * kHeadDimV, size_t(s.s_q) * heads_ * kHeadDimV * 2);
            s.lse = OnDevice(sl.dev.lse + size_t(tt) * heads_, size_t(s.s_q) * heads_ * sizeof(float));
          }
          tt += s.s_q;
        }
      });
    }
    if (st.ok()) st = Cuda(cudaEventRecord(sl.prepared, compute_), "event");
    if (st.ok()) st = Cuda(cudaStreamWaitEvent(input_, sl.prepared, 0), "wait");
    if (!st.ok()) {
      for (int k : sl.order) batch.entries[k].status = st;
    }
  }

  void AfterLaunch(Batch& batch) override {
    Slot& sl = slots_[batch.slot];
    if (sl.order.empty()) return;
    const size_t H = hidden_, lw = size_t(heads_) * kHeadDimV;
    cudaSetDevice(device_);
    // The latent outputs are in place once the backend's results are.
    auto* ready = static_cast<cudaEvent_t>(backend_->results_event(batch));
    absl::Status st = Cuda(cudaStreamWaitEvent(compute_, ready, 0), "wait");
    {
      absl::MutexLock lock(&math_mu_);
      ForEachLayerRun(batch, sl.order, [&](int layer, size_t a, size_t b, int t0, int n) {
        bool any_ok = false;
        for (size_t k = a; k < b; ++k) any_ok |= batch.entries[sl.order[k]].status.ok();
        // Rows are independent: a failed entry's rows among them change nothing.
        if (st.ok() && any_ok) st = math_[layer]->Output(sl.dev.latent + t0 * lw, n, sl.dev.out + t0 * H, compute_);
      });
    }
    if (st.ok())
      st = Cuda(cudaMemcpyAsync(sl.host_out, sl.dev.out, size_t(sl.tokens) * H * 2, cudaMemcpyDeviceToHost, compute_),
                "outputs to host");
    if (st.ok()) st = Cuda(cudaEventRecord(sl.done, compute_), "event");
    sl.status = st;
  }

  void Complete(Batch& batch) override {
    Slot& sl = slots_[batch.slot];
    if (!sl.order.empty()) {
      absl::Status st = sl.status;
      if (st.ok()) st = Cuda(cudaEventSynchronize(sl.done), "layer outputs");
      const size_t H = hidden_;
      int t = 0;
      for (int k : sl.order) {
        BatchEntry& e = batch.entries[k];
        if (e.status.ok() && !st.ok()) e.status = st;
        if (e.status.ok())
          std::memcpy(e.step->layer_out.host(), sl.host_out + size_t(t) * H * 2, e.step->layer_out.bytes());
        t += e.step->s_q;
      }
    }
    UnsetLayerTensors(batch);
    sl.order.clear();
  }

  absl::StatusOr<std::string> Rows(int layer, absl::string_view hidden, int64_t first) override {
    const size_t H = hidden_, n = hidden.size() / (H * 2);
    std::string rows(n * kHeadDimQK * 2, '\0');
    if (compute_ == nullptr) return absl::InternalError("layer stage: not attached to the CUDA backend");
    // One upload at a time through the upload buffers, in chunks of max_batch_tokens; the
    // math's host side (cuBLAS handle, scratch) is shared with the scheduler, whose work
    // the compute stream orders with this on the device.
    absl::MutexLock upload(&upload_mu_);
    cudaSetDevice(device_);
    auto* positions = reinterpret_cast<int32_t*>(up_host_);
    auto* x = reinterpret_cast<uint16_t*>(up_host_ + host_hidden_at_);
    auto* out = reinterpret_cast<uint16_t*>(up_host_ + host_hidden_at_);  // rows come back over the hidden states
    for (size_t done = 0; done < n;) {
      const int m = static_cast<int>(std::min<size_t>(max_tokens_, n - done));
      std::memcpy(x, hidden.data() + done * H * 2, size_t(m) * H * 2);
      for (int i = 0; i < m; ++i) positions[i] = static_cast<int32_t>(first + int64_t(done) + i);
      absl::Status st =
          Cuda(cudaMemcpyAsync(up_dev_.positions, positions, size_t(m) * 4, cudaMemcpyHostToDevice, compute_), "copy");
      if (st.ok())
        st = Cuda(cudaMemcpyAsync(up_dev_.hidden, x, size_t(m) * H * 2, cudaMemcpyHostToDevice, compute_), "copy");
      if (st.ok()) {
        absl::MutexLock lock(&math_mu_);
        st = math_[layer]->LatentRows(up_dev_.hidden, up_dev_.positions, m, up_dev_.rows, compute_);
      }
      if (st.ok())
        st = Cuda(cudaMemcpyAsync(out, up_dev_.rows, size_t(m) * kHeadDimQK * 2, cudaMemcpyDeviceToHost, compute_),
                  "copy");
      if (st.ok()) st = Cuda(cudaEventRecord(up_done_, compute_), "event");
      if (st.ok()) st = Cuda(cudaEventSynchronize(up_done_), "latent rows");
      if (!st.ok()) return st;
      std::memcpy(rows.data() + done * kHeadDimQK * 2, out, size_t(m) * kHeadDimQK * 2);
      done += size_t(m);
    }
    return rows;
  }

 private:
  CudaLayerStage() = default;

  struct Slot {
    std::vector<int> order;
    int tokens = 0;
    char* host_in = nullptr;   // pinned: positions [T] int32 | hidden [T, H]
    char* host_out = nullptr;  // pinned: out [T, H]
    DeviceTensors dev;
    cudaEvent_t in_copied = nullptr, prepared = nullptr, done = nullptr;
    absl::Status status;
  };

  absl::Status Build(const EngineOptions& o) {
    device_ = o.device;
    max_tokens_ = o.max_batch_tokens;
    if (absl::Status st = Cuda(cudaSetDevice(device_), "cudaSetDevice"); !st.ok()) return st;
    const model::ModelConfig& config = *o.layer_config;
    auto blas = layer::CublasHandle::Create(device_);
    if (!blas.ok()) return blas.status();
    auto rope = layer::CudaRopeTable::Create(layer::RopeConfig::FromModel(config), max_positions_, device_);
    if (!rope.ok()) return rope.status();
    layer::LayerMathOptions lo;
    lo.num_heads = heads_;
    lo.max_positions = max_positions_;
    for (const model::AttentionLayerWeights& lw : o.layer_weights->layers) {
      auto math = layer::CudaLayerMath::Create(config, lw, lo, max_tokens_, device_, {*blas, *rope});
      if (!math.ok()) {
        return absl::Status(math.status().code(), absl::StrCat("layer ", lw.layer, ": ", math.status().message()));
      }
      weight_bytes_ += (*math)->weight_bytes();
      math_.push_back(*std::move(math));
    }
    const size_t T = size_t(max_tokens_), H = hidden_, h = heads_;
    host_hidden_at_ = AlignUp(T * 4);
    const size_t host_in = host_hidden_at_ + std::max(T * H * 2, T * kHeadDimQK * 2);
    for (Slot& s : slots_) {
      s.order.reserve(o.max_batch_size);
      absl::Status st = Cuda(cudaHostAlloc(reinterpret_cast<void**>(&s.host_in), host_in, cudaHostAllocDefault),
                             "cudaHostAlloc");
      if (st.ok())
        st = Cuda(cudaHostAlloc(reinterpret_cast<void**>(&s.host_out), T * H * 2, cudaHostAllocDefault), "cudaHostAlloc");
      if (st.ok()) st = s.dev.Allocate(T, H, h);
      for (cudaEvent_t* e : {&s.in_copied, &s.prepared, &s.done})
        if (st.ok()) st = Cuda(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "event");
      if (!st.ok()) return st;
    }
    absl::Status st = Cuda(cudaHostAlloc(reinterpret_cast<void**>(&up_host_), host_in, cudaHostAllocDefault),
                           "cudaHostAlloc");
    if (st.ok()) st = up_dev_.Allocate(T, H, /*h=*/1);
    if (st.ok()) st = Cuda(cudaEventCreateWithFlags(&up_done_, cudaEventDisableTiming), "event");
    return st;
  }

  int device_ = 0, max_tokens_ = 0;
  size_t host_hidden_at_ = 0;
  AttentionBackend* backend_ = nullptr;
  cudaStream_t compute_ = nullptr, input_ = nullptr;
  // The layers' math objects are driven by the scheduler and by uploads (Rows): their
  // host side (the shared cuBLAS handle's stream binding, scratch pointers) one at a time.
  absl::Mutex math_mu_;
  std::vector<std::unique_ptr<layer::CudaLayerMath>> math_;
  Slot slots_[2];
  absl::Mutex upload_mu_;  // the upload buffers below, one Rows call at a time
  char* up_host_ = nullptr;
  DeviceTensors up_dev_;
  cudaEvent_t up_done_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LayerStage>> MakeCudaLayerStage(const EngineOptions& options) {
  return CudaLayerStage::Create(options);
}

}  // namespace latentd::engine
