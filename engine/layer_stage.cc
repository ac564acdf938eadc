// Layer steps around the decode kernel on the host: hidden states to queries and latent
// rows before staging, latent outputs to the layer's output after finishing.
#include "engine/layer_stage.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "engine/layer/layer_math.h"
#include "engine/layer/rope.h"
#include "engine/model/config.h"
#include "engine/model/weights.h"
#include "kernels/params.h"

namespace latentd::engine {

using kernels::kHeadDimQK;
using kernels::kHeadDimV;

// Positions served when config.json has no max_position_embeddings.
constexpr int kDefaultMaxPositions = 32768;

absl::Status LayerStage::Init(const EngineOptions& o) {
  if (o.layer_config == nullptr || o.layer_weights == nullptr)
    return absl::InvalidArgumentError("layer_weights: the layer API needs config.json and the attention weights");
  const model::ModelConfig& config = *o.layer_config;
  const model::AttentionWeights& w = *o.layer_weights;
  const ModelConfig& m = o.model;
  if (static_cast<int>(w.layers.size()) != m.num_layers)
    return absl::InvalidArgumentError(absl::StrCat("num_layers: expected the checkpoint's ", w.layers.size(),
                                                   " layers, got ", m.num_layers));
  if (w.num_heads != m.num_heads_q)
    return absl::InvalidArgumentError(absl::StrCat("num_heads_q: expected this rank's ", w.num_heads,
                                                   " heads of the checkpoint, got ", m.num_heads_q));
  if (m.num_heads_kv != 1)
    return absl::InvalidArgumentError(
        absl::StrCat("num_heads_kv: expected 1 (MLA's one latent head), got ", m.num_heads_kv));
  if (w.dtype != m.dtype || config.dtype != m.dtype)
    return absl::InvalidArgumentError(absl::StrCat("dtype: expected the checkpoint's ", kernels::DTypeName(config.dtype),
                                                   ", got ", kernels::DTypeName(m.dtype)));
  const int64_t positions = o.layer_max_positions > 0          ? o.layer_max_positions
                            : config.max_position_embeddings > 0 ? config.max_position_embeddings
                                                                 : kDefaultMaxPositions;
  if (positions > layer::Rope::kMaxPositions) {
    return absl::InvalidArgumentError(absl::StrCat("max_positions: at most ", layer::Rope::kMaxPositions,
                                                   " (the rotary table's bound), got ", positions,
                                                   o.layer_max_positions > 0 ? "" : " from config.json; set --max_positions"));
  }
  hidden_ = config.hidden_size;
  heads_ = w.num_heads;
  max_positions_ = static_cast<int>(positions);
  return absl::OkStatus();
}

void CollectLayerEntries(const Batch& batch, std::vector<int>* order) {
  order->clear();
  for (int i = 0; i < static_cast<int>(batch.entries.size()); ++i) {
    const BatchEntry& e = batch.entries[i];
    if (IsLayerStep(*e.step) && e.status.ok()) order->push_back(i);
  }
  std::sort(order->begin(), order->end(), [&](int a, int b) {
    const int la = batch.entries[a].step->layer, lb = batch.entries[b].step->layer;
    return la != lb ? la < lb : a < b;
  });
}

namespace {

// The host's layer math (CpuLayerMath per layer, float32 weights) around either backend.
class HostLayerStage final : public LayerStage {
 public:
  static absl::StatusOr<std::unique_ptr<LayerStage>> Create(const EngineOptions& o) {
    std::unique_ptr<HostLayerStage> st(new HostLayerStage());
    if (absl::Status s = st->Init(o); !s.ok()) return s;
    const model::ModelConfig& config = *o.layer_config;
    absl::StatusOr<layer::Rope> rope = layer::Rope::Create(layer::RopeConfig::FromModel(config), st->max_positions_);
    if (!rope.ok()) return rope.status();
    layer::LayerMathOptions lo;
    lo.num_heads = st->heads_;
    lo.max_positions = st->max_positions_;
    lo.rope = std::make_shared<const layer::Rope>(*std::move(rope));
    for (const model::AttentionLayerWeights& lw : o.layer_weights->layers) {
      auto math = layer::CpuLayerMath::Create(config, lw, lo);
      if (!math.ok()) {
        return absl::Status(math.status().code(), absl::StrCat("layer ", lw.layer, ": ", math.status().message()));
      }
      st->weight_bytes_ += (*math)->weight_bytes();
      // The scheduler calls the layers one after another: one set of scratch for all,
      // sized for the largest batch now.
      if (st->math_.empty()) {
        (*math)->Reserve(o.max_batch_tokens);
      } else {
        (*math)->ShareScratch(*st->math_.front());
      }
      st->math_.push_back(*std::move(math));
    }
    const size_t T = static_cast<size_t>(o.max_batch_tokens), H = st->hidden_, h = st->heads_;
    for (Slot& s : st->slots_) {
      s.order.reserve(o.max_batch_size);
      s.x.resize(T * H);
      s.out.resize(T * H);
      s.positions.resize(T);
      s.q.resize(T * h * kHeadDimQK);
      s.rows.resize(T * kHeadDimQK);
      s.latent.resize(T * h * kHeadDimV);
      s.lse.resize(T * h);
    }
    return std::unique_ptr<LayerStage>(std::move(st));
  }

  void Prepare(Batch& batch) override {
    Slot& sl = slots_[batch.slot];
    CollectLayerEntries(batch, &sl.order);
    const size_t H = hidden_, qw = size_t(heads_) * kHeadDimQK;
    ForEachLayerRun(batch, sl.order, [&](int layer, size_t a, size_t b, int t0, int tokens) {
      int t = t0;
      for (size_t k = a; k < b; ++k) {
        const BatchEntry& e = batch.entries[sl.order[k]];
        std::memcpy(sl.x.data() + size_t(t) * H, e.step->hidden.host(), e.step->hidden.bytes());
        for (int j = 0; j < e.step->s_q; ++j) sl.positions[t + j] = e.position + j;
        t += e.step->s_q;
      }
      const size_t n = size_t(tokens);
      layer::CpuLayerMath& math = *math_[layer];
      absl::Span<const uint16_t> x(sl.x.data() + t0 * H, n * H);
      absl::Span<const int64_t> pos(sl.positions.data() + t0, n);
      absl::Status st = math.Queries(x, pos, absl::MakeSpan(sl.q.data() + t0 * qw, n * qw));
      if (st.ok()) st = math.LatentRows(x, pos, absl::MakeSpan(sl.rows.data() + t0 * kHeadDimQK, n * kHeadDimQK));
      t = t0;
      for (size_t k = a; k < b; ++k) {
        BatchEntry& e = batch.entries[sl.order[k]];
        DecodeStep& s = *e.step;
        if (!st.ok()) {
          e.status = st;
        } else {
          s.q = TensorLocation::Host(sl.q.data() + size_t(t) * qw, size_t(s.s_q) * qw * 2);
          s.kv = TensorLocation::Host(sl.rows.data() + size_t(t) * kHeadDimQK, size_t(s.s_q) * kHeadDimQK * 2);
          s.out = TensorLocation::Host(sl.latent.data() + size_t(t) * heads_ * kHeadDimV,
                                       size_t(s.s_q) * heads_ * kHeadDimV * 2);
          s.lse = TensorLocation::Host(sl.lse.data() + size_t(t) * heads_, size_t(s.s_q) * heads_ * sizeof(float));
        }
        t += s.s_q;
      }
    });
  }

  void Complete(Batch& batch) override {
    Slot& sl = slots_[batch.slot];
    const size_t H = hidden_, lw = size_t(heads_) * kHeadDimV;
    ForEachLayerRun(batch, sl.order, [&](int layer, size_t a, size_t b, int t0, int tokens) {
      bool any_ok = false;
      for (size_t k = a; k < b; ++k) any_ok |= batch.entries[sl.order[k]].status.ok();
      const size_t n = size_t(tokens);
      // Rows are independent, so a failed entry's (unwritten) rows among them change nothing.
      absl::Status st = any_ok ? math_[layer]->Output(tokens, absl::MakeConstSpan(sl.latent.data() + t0 * lw, n * lw),
                                                      absl::MakeSpan(sl.out.data() + t0 * H, n * H))
                               : absl::OkStatus();
      int t = t0;
      for (size_t k = a; k < b; ++k) {
        BatchEntry& e = batch.entries[sl.order[k]];
        if (e.status.ok() && !st.ok()) e.status = st;
        if (e.status.ok()) std::memcpy(e.step->layer_out.host(), sl.out.data() + size_t(t) * H, e.step->layer_out.bytes());
        t += e.step->s_q;
      }
    });
    UnsetLayerTensors(batch);
    sl.order.clear();
  }

  absl::StatusOr<std::string> Rows(int layer, absl::string_view hidden, int64_t first) override {
    const size_t H = hidden_, n = hidden.size() / (H * 2);
    std::vector<uint16_t> x(n * H);
    std::memcpy(x.data(), hidden.data(), n * H * 2);
    std::vector<int64_t> positions(n);
    for (size_t i = 0; i < n; ++i) positions[i] = first + static_cast<int64_t>(i);
    std::string rows(n * kHeadDimQK * 2, '\0');
    // A clone: the scheduler thread may be using this layer's math right now.
    std::unique_ptr<layer::CpuLayerMath> math = math_[layer]->Clone();
    absl::Status st =
        math->LatentRows(x, positions, absl::MakeSpan(reinterpret_cast<uint16_t*>(rows.data()), n * kHeadDimQK));
    if (!st.ok()) return st;
    return rows;
  }

 private:
  HostLayerStage() = default;

  struct Slot {
    std::vector<int> order;          // the batch's layer entries, by layer
    std::vector<uint16_t> x, out;    // [tokens, hidden]
    std::vector<int64_t> positions;  // [tokens]
    std::vector<uint16_t> q;         // [tokens, h, 576]
    std::vector<uint16_t> rows;      // [tokens, 576]
    std::vector<uint16_t> latent;    // [tokens, h, 512]
    std::vector<float> lse;          // [tokens, h]
  };

  std::vector<std::unique_ptr<layer::CpuLayerMath>> math_;  // per layer, the scheduler's
  Slot slots_[2];
};

}  // namespace

void UnsetLayerTensors(Batch& batch) {
  for (BatchEntry& e : batch.entries) {
    if (IsLayerStep(*e.step)) e.step->q = e.step->kv = e.step->out = e.step->lse = TensorLocation();
  }
}

absl::StatusOr<std::unique_ptr<LayerStage>> LayerStage::Create(const EngineOptions& o, bool on_device) {
  return on_device ? MakeCudaLayerStage(o) : HostLayerStage::Create(o);
}

}  // namespace latentd::engine
