// config.json parsing with nlohmann-json: every key is checked for presence, type and
// range, and an error names the file, the key and what was expected.
#include "engine/model/config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/model/json.h"
#include "nlohmann/json.hpp"

namespace latentd::engine::model {
namespace {

using Json = nlohmann::json;

// Upper bound on every dimension: far above any published model, low enough that the
// products the loader forms (heads x head width x hidden) cannot overflow int64.
constexpr int64_t kMaxDim = 1 << 20;

std::string Shown(const Json& v) { return ShownJson(v); }

// Reads typed values out of one JSON object; `prefix` is the dotted path of the object
// ("" for the top level, "rope_scaling." inside it).
class Reader {
 public:
  Reader(const std::string& path, const Json& obj, std::string prefix)
      : path_(path), obj_(obj), prefix_(std::move(prefix)) {}

  const Json* Find(const char* key) const {
    auto it = obj_.find(key);
    return it == obj_.end() ? nullptr : &*it;
  }

  absl::Status Error(const char* key, absl::string_view what, const Json* got) const {
    return absl::InvalidArgumentError(absl::StrCat(
        path_, ": ", prefix_, key, ": expected ", what,
        got == nullptr ? std::string(", but the key is missing") : absl::StrCat(", got ", Shown(*got))));
  }

  // An integer in [lo, hi]; a float with an integral value (4096.0) counts.
  absl::StatusOr<int64_t> Int(const char* key, int64_t lo, int64_t hi) const {
    const Json* v = Find(key);
    const std::string what = absl::StrCat("an integer in [", lo, ", ", hi, "]");
    if (v == nullptr || !v->is_number()) return Error(key, what, v);
    double d = v->get<double>();
    int64_t i = 0;
    if (v->is_number_integer()) {
      i = v->is_number_unsigned() ? static_cast<int64_t>(std::min<uint64_t>(v->get<uint64_t>(), INT64_MAX))
                                  : v->get<int64_t>();
    } else {
      if (!(std::floor(d) == d) || std::fabs(d) > 9e15) return Error(key, what, v);
      i = static_cast<int64_t>(d);
    }
    if (i < lo || i > hi) return Error(key, what, v);
    return i;
  }

  absl::StatusOr<int> Dim(const char* key) const {
    absl::StatusOr<int64_t> v = Int(key, 1, kMaxDim);
    if (!v.ok()) return v.status();
    return static_cast<int>(*v);
  }

  // A finite number, > 0 when `positive`.
  absl::StatusOr<double> Number(const char* key, bool positive) const {
    const Json* v = Find(key);
    const char* what = positive ? "a positive number" : "a number";
    if (v == nullptr || !v->is_number()) return Error(key, what, v);
    const double d = v->get<double>();
    if (!std::isfinite(d) || (positive && !(d > 0))) return Error(key, what, v);
    return d;
  }

  // As Number, with a default when the key is absent.
  absl::StatusOr<double> NumberOr(const char* key, double dflt, bool positive) const {
    if (Find(key) == nullptr) return dflt;
    return Number(key, positive);
  }

  const std::string& prefix() const { return prefix_; }

 private:
  const std::string& path_;
  const Json& obj_;
  std::string prefix_;
};

#define LATENTD_ASSIGN(lhs, expr)        \
  do {                                   \
    auto _v = (expr);                    \
    if (!_v.ok()) return _v.status();    \
    lhs = *std::move(_v);                \
  } while (0)

absl::Status ParseYarn(const std::string& path, const Json& rs, ModelConfig& c) {
  Reader r(path, rs, "rope_scaling.");
  // DeepSeek's configs say "type"; newer transformers write "rope_type".
  const Json* type = r.Find("type");
  const char* type_key = "type";
  if (type == nullptr) {
    type = r.Find("rope_type");
    type_key = "rope_type";
  }
  if (type == nullptr || !type->is_string() || type->get<std::string>() != "yarn") {
    return r.Error(type_key, "\"yarn\" (the only rope scaling DeepSeek-style MLA models use; or null for none)",
                   type);
  }
  YarnScaling y;
  LATENTD_ASSIGN(y.factor, r.Number("factor", true));
  LATENTD_ASSIGN(y.original_max_position_embeddings,
                 r.Int("original_max_position_embeddings", 1, int64_t{1} << 40));
  LATENTD_ASSIGN(y.beta_fast, r.NumberOr("beta_fast", y.beta_fast, true));
  LATENTD_ASSIGN(y.beta_slow, r.NumberOr("beta_slow", y.beta_slow, true));
  LATENTD_ASSIGN(y.mscale, r.NumberOr("mscale", y.mscale, false));
  LATENTD_ASSIGN(y.mscale_all_dim, r.NumberOr("mscale_all_dim", y.mscale_all_dim, false));
  c.yarn = y;
  return absl::OkStatus();
}

absl::Status ParseQuantization(const std::string& path, const Json& q, ModelConfig& c) {
  Reader r(path, q, "quantization_config.");
  const Json* method = r.Find("quant_method");
  if (method == nullptr || !method->is_string()) return r.Error("quant_method", "a string", method);
  c.quant_method = method->get<std::string>();
  // Other methods are recorded only: the weight loader rejects tensors it cannot read.
  if (c.quant_method != "fp8") return absl::OkStatus();
  if (const Json* fmt = r.Find("fmt"); fmt != nullptr && (!fmt->is_string() || fmt->get<std::string>() != "e4m3")) {
    return r.Error("fmt", "\"e4m3\"", fmt);
  }
  const Json* bs = r.Find("weight_block_size");
  const char* what = "[rows, cols], two integers in [1, 65536] (DeepSeek-V3: [128, 128])";
  if (bs == nullptr || !bs->is_array() || bs->size() != 2) return r.Error("weight_block_size", what, bs);
  int dims[2];
  for (int i = 0; i < 2; ++i) {
    const Json& d = (*bs)[i];
    if (!d.is_number_integer() || d.get<int64_t>() < 1 || d.get<int64_t>() > 65536) {
      return r.Error("weight_block_size", what, bs);
    }
    dims[i] = static_cast<int>(d.get<int64_t>());
  }
  c.fp8 = Fp8BlockQuantization{dims[0], dims[1]};
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text, const std::string& path) {
  // Published configs nest a few levels (quantization_config.weight_block_size).
  absl::StatusOr<Json> parsed = ParseJson(json_text, path, 16);
  if (!parsed.ok()) return parsed.status();
  const Json& j = *parsed;
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": expected a JSON object, got ", Shown(j)));
  }
  ModelConfig c;
  c.path = path;
  Reader r(c.path, j, "");
  LATENTD_ASSIGN(c.hidden_size, r.Dim("hidden_size"));
  LATENTD_ASSIGN(c.num_attention_heads, r.Dim("num_attention_heads"));
  {
    const Json* q = r.Find("q_lora_rank");
    if (q == nullptr || !q->is_null()) {
      int rank = 0;
      if (q == nullptr) return r.Error("q_lora_rank", "an integer in [1, 1048576] or null (a plain q_proj)", q);
      LATENTD_ASSIGN(rank, r.Dim("q_lora_rank"));
      c.q_lora_rank = rank;
    }
  }
  LATENTD_ASSIGN(c.kv_lora_rank, r.Dim("kv_lora_rank"));
  LATENTD_ASSIGN(c.qk_nope_head_dim, r.Dim("qk_nope_head_dim"));
  LATENTD_ASSIGN(c.qk_rope_head_dim, r.Dim("qk_rope_head_dim"));
  if (c.qk_rope_head_dim % 2 != 0) {
    return r.Error("qk_rope_head_dim", "an even integer (RoPE rotates pairs)", r.Find("qk_rope_head_dim"));
  }
  LATENTD_ASSIGN(c.v_head_dim, r.Dim("v_head_dim"));
  LATENTD_ASSIGN(c.num_hidden_layers, r.Dim("num_hidden_layers"));
  if (r.Find("max_position_embeddings") != nullptr) {
    LATENTD_ASSIGN(c.max_position_embeddings, r.Int("max_position_embeddings", 1, int64_t{1} << 40));
  }
  LATENTD_ASSIGN(c.rms_norm_eps, r.Number("rms_norm_eps", true));
  LATENTD_ASSIGN(c.rope_theta, r.Number("rope_theta", true));
  if (const Json* ri = r.Find("rope_interleave"); ri != nullptr) {
    if (!ri->is_boolean()) return r.Error("rope_interleave", "true or false", ri);
    c.rope_interleave = ri->get<bool>();
  }
  if (const Json* rs = r.Find("rope_scaling"); rs != nullptr && !rs->is_null()) {
    if (!rs->is_object()) return r.Error("rope_scaling", "an object or null", rs);
    if (absl::Status s = ParseYarn(c.path, *rs, c); !s.ok()) return s;
  }
  {
    // transformers 4.56 and later write "dtype" where older versions wrote "torch_dtype".
    const char* key = r.Find("torch_dtype") == nullptr && r.Find("dtype") != nullptr ? "dtype" : "torch_dtype";
    const Json* d = r.Find(key);
    const std::string v = d != nullptr && d->is_string() ? d->get<std::string>() : "";
    if (v == "bfloat16") {
      c.dtype = kernels::DType::kBF16;
    } else if (v == "float16") {
      c.dtype = kernels::DType::kFP16;
    } else {
      return r.Error(key, "\"bfloat16\" or \"float16\" (the dtypes latentd serves)", d);
    }
  }
  if (const Json* q = r.Find("quantization_config"); q != nullptr && !q->is_null()) {
    if (!q->is_object()) return r.Error("quantization_config", "an object or null", q);
    if (absl::Status s = ParseQuantization(c.path, *q, c); !s.ok()) return s;
  }
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string path = absl::StrCat(model_dir, "/config.json");
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open (no config.json in the model folder?)"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return ParseModelConfig(text.str(), path);
}

double YarnGetMscale(double factor, double mscale) {
  if (factor <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(factor) + 1.0;
}

double SoftmaxScale(const ModelConfig& config) {
  double scale = 1.0 / std::sqrt(static_cast<double>(config.qk_head_dim()));
  // DeepseekV3Attention applies the correction only where mscale_all_dim is nonzero.
  if (config.yarn.has_value() && config.yarn->mscale_all_dim != 0.0) {
    const double m = YarnGetMscale(config.yarn->factor, config.yarn->mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

}  // namespace latentd::engine::model
