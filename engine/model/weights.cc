// Attention weight loading: locate each tensor, check dtype and shape, convert (or
// dequantize) the rank's rows and columns into the model dtype.
#include "engine/model/weights.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/half.h"
#include "kernels/kv_fp8.h"

namespace latentd::engine::model {
namespace {

using kernels::DType;

// A [rows, cols] range of a tensor to read: rows [r0, r1), cols [c0, c1).
struct Slice {
  int64_t r0, r1, c0, c1;
};

// e4m3 (the "fn" variant: no infinities, S.1111.111 is NaN) to float, exactly.
float E4m3Value(uint8_t code) {
  if ((code & 0x7fu) == 0x7fu) return std::nanf("");
  return kernels::E4m3ToFloat(code);
}

bool Finite16(DType dtype, uint16_t v) {
  return dtype == DType::kBF16 ? (v & 0x7f80u) != 0x7f80u : (v & 0x7c00u) != 0x7c00u;
}

float ReadF32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

uint16_t Read16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

class Loader {
 public:
  Loader(const Checkpoint& ckpt, const ModelConfig& config) : ckpt_(ckpt), config_(config) {}

  // A 2-D weight of full shape [rows, cols]; `why` says where the shape comes from.
  absl::StatusOr<HostTensor> Matrix(const std::string& name, int64_t rows, int64_t cols, const Slice& s,
                                    const std::string& why) {
    absl::StatusOr<Checkpoint::Entry> e = Locate(name, {rows, cols}, why);
    if (!e.ok()) return e.status();
    const TensorInfo& t = *e->info;
    const std::string& file = e->file->path();
    HostTensor out;
    out.name = name;
    out.shape = {s.r1 - s.r0, s.c1 - s.c0};
    out.values.resize(static_cast<size_t>(out.shape[0] * out.shape[1]));
    const uint8_t* src = e->file->Data(t).data();
    uint16_t* dst = out.values.data();
    const DType dtype = config_.dtype;
    if (t.dtype == TensorDType::kF8E4M3) {
      if (!config_.fp8.has_value()) {
        return Error(file, name, "is F8_E4M3, but config.json has no quantization_config with quant_method "
                                 "\"fp8\" and weight_block_size");
      }
      const int64_t br = config_.fp8->block_rows, bc = config_.fp8->block_cols;
      const std::string scale_name = absl::StrCat(name, "_scale_inv");
      const int64_t srows = (rows + br - 1) / br, scols = (cols + bc - 1) / bc;
      absl::StatusOr<Checkpoint::Entry> se =
          Locate(scale_name, {srows, scols},
                 absl::StrCat("one float32 per ", br, "x", bc, " block of ", name, " ", ShapeString({rows, cols}),
                              " (quantization_config.weight_block_size)"));
      if (!se.ok()) return se.status();
      if (se->info->dtype != TensorDType::kF32) {
        return Error(se->file->path(), scale_name,
                     absl::StrCat("dtype ", TensorDTypeName(se->info->dtype), "; expected F32"));
      }
      const uint8_t* scale = se->file->Data(*se->info).data();
      float lut[256];
      for (int c = 0; c < 256; ++c) lut[c] = E4m3Value(static_cast<uint8_t>(c));
      for (int64_t r = s.r0; r < s.r1; ++r) {
        const uint8_t* row = src + r * cols;
        const uint8_t* srow = scale + (r / br) * scols * 4;
        for (int64_t c = s.c0; c < s.c1; ++c) {
          // The product in float, then one rounding: DeepSeek's own dequantization.
          const float v = lut[row[c]] * ReadF32(srow + (c / bc) * 4);
          *dst++ = kernels::FloatToHalf(dtype, v);
        }
      }
    } else if (absl::Status st = Convert(file, t, src, cols, s, dst); !st.ok()) {
      return st;
    }
    if (absl::Status st = CheckFinite(file, out, s); !st.ok()) return st;
    return out;
  }

  // A 1-D weight (a norm) of length n, replicated on every rank.
  absl::StatusOr<HostTensor> Vector(const std::string& name, int64_t n, const std::string& why) {
    absl::StatusOr<Checkpoint::Entry> e = Locate(name, {n}, why);
    if (!e.ok()) return e.status();
    HostTensor out;
    out.name = name;
    out.shape = {n};
    out.values.resize(static_cast<size_t>(n));
    const Slice s{0, 1, 0, n};
    if (e->info->dtype == TensorDType::kF8E4M3) {
      return Error(e->file->path(), name, "is F8_E4M3; expected BF16, F16 or F32 (norm weights are not quantized)");
    }
    if (absl::Status st = Convert(e->file->path(), *e->info, e->file->Data(*e->info).data(), n, s, out.values.data());
        !st.ok()) {
      return st;
    }
    if (absl::Status st = CheckFinite(e->file->path(), out, s); !st.ok()) return st;
    return out;
  }

 private:
  static absl::Status Error(const std::string& file, const std::string& tensor, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": tensor ", tensor, ": ", what));
  }

  // Finds `name` and checks its shape.
  absl::StatusOr<Checkpoint::Entry> Locate(const std::string& name, std::vector<int64_t> shape,
                                           const std::string& why) {
    std::optional<Checkpoint::Entry> e = ckpt_.Find(name);
    if (!e.has_value()) {
      // A q_lora_rank that disagrees with the checkpoint shows as the other form's tensors.
      std::string hint;
      const size_t dot = name.rfind(".self_attn.");
      const std::string prefix = dot == std::string::npos ? "" : name.substr(0, dot + 11);
      if (config_.q_lora_rank.has_value() && ckpt_.Find(prefix + "q_proj.weight").has_value()) {
        hint = absl::StrCat(" (the checkpoint has ", prefix, "q_proj.weight: should config.json's q_lora_rank be null?)");
      } else if (!config_.q_lora_rank.has_value() && ckpt_.Find(prefix + "q_a_proj.weight").has_value()) {
        hint = absl::StrCat(" (the checkpoint has ", prefix, "q_a_proj.weight: config.json's q_lora_rank is null)");
      }
      return absl::NotFoundError(absl::StrCat(ckpt_.source(), ": tensor ", name, ": missing; expected shape ",
                                              ShapeString(shape), ", ", why, hint));
    }
    if (e->info->shape != shape) {
      return Error(e->file->path(), name,
                   absl::StrCat("shape ", ShapeString(e->info->shape), "; expected ", ShapeString(shape), ", ", why,
                                " in ", config_.path));
    }
    return *e;
  }

  // BF16, F16 or F32 rows [s.r0, s.r1) x cols [s.c0, s.c1) of a row-major [.., cols]
  // tensor into the model dtype: a copy when the dtypes agree, else through float.
  absl::Status Convert(const std::string& file, const TensorInfo& t, const uint8_t* src, int64_t cols,
                       const Slice& s, uint16_t* dst) {
    const DType dtype = config_.dtype;
    const int64_t n = s.c1 - s.c0;
    switch (t.dtype) {
      case TensorDType::kBF16:
      case TensorDType::kF16: {
        const DType from = t.dtype == TensorDType::kBF16 ? DType::kBF16 : DType::kFP16;
        for (int64_t r = s.r0; r < s.r1; ++r, dst += n) {
          const uint8_t* row = src + (r * cols + s.c0) * 2;
          if (from == dtype) {
            std::memcpy(dst, row, static_cast<size_t>(n) * 2);
          } else {
            for (int64_t c = 0; c < n; ++c) {
              dst[c] = kernels::FloatToHalf(dtype, kernels::HalfToFloat(from, Read16(row + c * 2)));
            }
          }
        }
        return absl::OkStatus();
      }
      case TensorDType::kF32:
        for (int64_t r = s.r0; r < s.r1; ++r, dst += n) {
          const uint8_t* row = src + (r * cols + s.c0) * 4;
          for (int64_t c = 0; c < n; ++c) dst[c] = kernels::FloatToHalf(dtype, ReadF32(row + c * 4));
        }
        return absl::OkStatus();
      default:
        return Error(file, t.name,
                     absl::StrCat("dtype ", TensorDTypeName(t.dtype),
                                  "; expected BF16, F16, F32 or F8_E4M3 (with ", t.name, "_scale_inv)"));
    }
  }

  // A NaN or infinity (or an fp16 overflow at conversion) would poison every output
  // silently; it is a bad checkpoint.
  absl::Status CheckFinite(const std::string& file, const HostTensor& out, const Slice& s) {
    const int64_t n = s.c1 - s.c0;
    for (size_t i = 0; i < out.values.size(); ++i) {
      if (!Finite16(config_.dtype, out.values[i])) {
        const int64_t r = s.r0 + static_cast<int64_t>(i) / n, c = s.c0 + static_cast<int64_t>(i) % n;
        return Error(file, out.name,
                     absl::StrCat("element ", out.shape.size() == 1 ? absl::StrCat("[", c, "]")
                                                                    : absl::StrCat("[", r, ", ", c, "]"),
                                  " is not finite in ", kernels::DTypeName(config_.dtype)));
      }
    }
    return absl::OkStatus();
  }

  const Checkpoint& ckpt_;
  const ModelConfig& config_;
};

}  // namespace

int64_t AttentionLayerWeights::bytes() const {
  return q_a_proj.bytes() + q_a_layernorm.bytes() + q_b_proj.bytes() + q_proj.bytes() + kv_a_proj_with_mqa.bytes() +
         kv_a_layernorm.bytes() + kv_b_proj.bytes() + o_proj.bytes();
}

int64_t AttentionWeights::bytes() const {
  int64_t b = 0;
  for (const AttentionLayerWeights& l : layers) b += l.bytes();
  return b;
}

absl::Status ValidateTensorParallel(const ModelConfig& config, TensorParallel tp) {
  if (tp.size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tensor_parallel: must be at least 1, got ", tp.size));
  }
  if (tp.rank < 0 || tp.rank >= tp.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor_rank: must be in [0, ", tp.size - 1, "] for tensor_parallel ", tp.size, ", got ", tp.rank));
  }
  if (config.num_attention_heads % tp.size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor_parallel: ", tp.size, " does not divide the ",
                                                   config.num_attention_heads, " num_attention_heads of ",
                                                   config.path));
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionLayerWeights> LoadAttentionLayer(const Checkpoint& checkpoint, const ModelConfig& config,
                                                         int layer, TensorParallel tp) {
  if (absl::Status s = ValidateTensorParallel(config, tp); !s.ok()) return s;
  if (layer < 0 || layer >= config.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, ": must be in [0, ", config.num_hidden_layers - 1,
                                                   "] (num_hidden_layers of ", config.path, ")"));
  }
  const int64_t H = config.hidden_size, h = config.num_attention_heads, hr = h / tp.size;
  const int64_t nope = config.qk_nope_head_dim, rope = config.qk_rope_head_dim, v = config.v_head_dim;
  const int64_t qk = nope + rope, rkv = config.kv_lora_rank;
  const std::string prefix = absl::StrCat("model.layers.", layer, ".self_attn.");
  const std::string heads = absl::StrCat("num_attention_heads ", h);
  Loader ld(checkpoint, config);
  AttentionLayerWeights w;
  w.layer = layer;
  // This rank's heads are a contiguous range: rows of the per-head projections, columns
  // of o_proj (whose input is the heads' v outputs side by side).
  const int64_t h0 = tp.rank * hr, h1 = h0 + hr;
  auto assign = [](absl::StatusOr<HostTensor> t, HostTensor& out) -> absl::Status {
    if (!t.ok()) return t.status();
    out = *std::move(t);
    return absl::OkStatus();
  };
  absl::Status s;
  if (config.q_lora_rank.has_value()) {
    const int64_t rq = *config.q_lora_rank;
    const std::string q_why = absl::StrCat("q_lora_rank ", rq, " x hidden_size ", H);
    s.Update(assign(ld.Matrix(prefix + "q_a_proj.weight", rq, H, {0, rq, 0, H}, q_why), w.q_a_proj));
    if (s.ok()) {
      s.Update(assign(ld.Vector(prefix + "q_a_layernorm.weight", rq, absl::StrCat("q_lora_rank ", rq)),
                      w.q_a_layernorm));
    }
    if (s.ok()) {
      s.Update(assign(ld.Matrix(prefix + "q_b_proj.weight", h * qk, rq, {h0 * qk, h1 * qk, 0, rq},
                                absl::StrCat(heads, " x (qk_nope_head_dim ", nope, " + qk_rope_head_dim ", rope,
                                             ") x q_lora_rank ", rq)),
                      w.q_b_proj));
    }
  } else {
    s.Update(assign(ld.Matrix(prefix + "q_proj.weight", h * qk, H, {h0 * qk, h1 * qk, 0, H},
                              absl::StrCat(heads, " x (qk_nope_head_dim ", nope, " + qk_rope_head_dim ", rope,
                                           ") x hidden_size ", H, " (q_lora_rank is null)")),
                    w.q_proj));
  }
  if (s.ok()) {
    s.Update(assign(ld.Matrix(prefix + "kv_a_proj_with_mqa.weight", rkv + rope, H, {0, rkv + rope, 0, H},
                              absl::StrCat("(kv_lora_rank ", rkv, " + qk_rope_head_dim ", rope, ") x hidden_size ", H)),
                    w.kv_a_proj_with_mqa));
  }
  if (s.ok()) {
    s.Update(assign(ld.Vector(prefix + "kv_a_layernorm.weight", rkv, absl::StrCat("kv_lora_rank ", rkv)),
                    w.kv_a_layernorm));
  }
  if (s.ok()) {
    s.Update(assign(ld.Matrix(prefix + "kv_b_proj.weight", h * (nope + v), rkv, {h0 * (nope + v), h1 * (nope + v), 0, rkv},
                              absl::StrCat(heads, " x (qk_nope_head_dim ", nope, " + v_head_dim ", v,
                                           ") x kv_lora_rank ", rkv)),
                    w.kv_b_proj));
  }
  if (s.ok()) {
    s.Update(assign(ld.Matrix(prefix + "o_proj.weight", H, h * v, {0, H, h0 * v, h1 * v},
                              absl::StrCat("hidden_size ", H, " x ", heads, " x v_head_dim ", v)),
                    w.o_proj));
  }
  if (!s.ok()) return s;
  return w;
}

absl::StatusOr<AttentionWeights> LoadAttentionWeights(const Checkpoint& checkpoint, const ModelConfig& config,
                                                      TensorParallel tp) {
  if (absl::Status s = ValidateTensorParallel(config, tp); !s.ok()) return s;
  AttentionWeights w;
  w.dtype = config.dtype;
  w.tensor_parallel = tp;
  w.num_heads = config.num_attention_heads / tp.size;
  w.layers.reserve(config.num_hidden_layers);
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    absl::StatusOr<AttentionLayerWeights> layer = LoadAttentionLayer(checkpoint, config, l, tp);
    if (!layer.ok()) return layer.status();
    w.layers.push_back(*std::move(layer));
  }
  return w;
}

}  // namespace latentd::engine::model
