// config.json parsing (published configs' shapes, defaults, every error naming the file
// and key) and DeepSeek-V3's softmax scale.
#include "engine/model/config.h"

#include <cmath>
#include <string>

#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace latentd::engine::model {
namespace {

using ::testing::HasSubstr;

// deepseek-ai/DeepSeek-V3's config.json, the keys that matter here plus a few others.
constexpr char kDeepSeekV3[] = R"({
  "architectures": ["DeepseekV3ForCausalLM"],
  "hidden_size": 7168,
  "kv_lora_rank": 512,
  "model_type": "deepseek_v3",
  "num_attention_heads": 128,
  "num_hidden_layers": 61,
  "num_key_value_heads": 128,
  "num_nextn_predict_layers": 1,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128]
  },
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn"
  },
  "rope_theta": 10000,
  "torch_dtype": "bfloat16",
  "v_head_dim": 128,
  "vocab_size": 129280
})";

std::string Replace(const std::string& from, const std::string& to) {
  std::string s = kDeepSeekV3;
  const size_t n = absl::StrReplaceAll({{from, to}}, &s);
  EXPECT_EQ(n, 1u) << from;
  return s;
}

TEST(ConfigTest, DeepSeekV3) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kDeepSeekV3, "dsv3/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->path, "dsv3/config.json");
  EXPECT_EQ(c->hidden_size, 7168);
  EXPECT_EQ(c->num_attention_heads, 128);
  ASSERT_TRUE(c->q_lora_rank.has_value());
  EXPECT_EQ(*c->q_lora_rank, 1536);
  EXPECT_EQ(c->kv_lora_rank, 512);
  EXPECT_EQ(c->qk_nope_head_dim, 128);
  EXPECT_EQ(c->qk_rope_head_dim, 64);
  EXPECT_EQ(c->qk_head_dim(), 192);
  EXPECT_EQ(c->v_head_dim, 128);
  EXPECT_EQ(c->num_hidden_layers, 61);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_TRUE(c->rope_interleave);
  ASSERT_TRUE(c->yarn.has_value());
  EXPECT_DOUBLE_EQ(c->yarn->factor, 40.0);
  EXPECT_EQ(c->yarn->original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c->yarn->beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c->yarn->beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c->yarn->mscale, 1.0);
  EXPECT_DOUBLE_EQ(c->yarn->mscale_all_dim, 1.0);
  EXPECT_EQ(c->dtype, kernels::DType::kBF16);
  EXPECT_EQ(c->quant_method, "fp8");
  ASSERT_TRUE(c->fp8.has_value());
  EXPECT_EQ(c->fp8->block_rows, 128);
  EXPECT_EQ(c->fp8->block_cols, 128);
}

// By hand: ln 40 = 3.6888794541139363, so mscale = 0.1 x 1.0 x ln 40 + 1 = 1.3688879454113936
// and mscale^2 = 1.8738542070926265; 192^-0.5 = 0.07216878364870323; the product is
// 0.1352337788608801, the deepseek-v3 preset's scale (server/presets_test.cc pins
// 0.13523377886088). Without YaRN the scale is 192^-0.5 alone.
TEST(ConfigTest, SoftmaxScaleDeepSeekV3) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kDeepSeekV3, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NEAR(YarnGetMscale(40.0, 1.0), 1.3688879454113936, 1e-15);
  EXPECT_NEAR(SoftmaxScale(*c), 0.1352337788608801, 1e-15);
  EXPECT_NEAR(SoftmaxScale(*c), 0.13523377886088, 1e-12);

  absl::StatusOr<ModelConfig> plain = ParseModelConfig(Replace(R"("rope_scaling": {)", R"("unused": {)"), "c");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->yarn.has_value());
  EXPECT_NEAR(SoftmaxScale(*plain), 0.07216878364870323, 1e-15);
}

// Kimi-K2: factor 32, so mscale = 0.1 x ln 32 + 1 = 0.1 x 3.4657359027997265 + 1 =
// 1.3465735902799727, squared 1.8132604340394958, x 192^-0.5 = 0.13086079996295008.
// DeepSeek-V2-Lite: factor 40, mscale_all_dim 0.707: 0.0707 x 3.6888794541139363 + 1 =
// 1.2608037774058554, squared 1.5896261651208736, x 192^-0.5 = 0.11472138679292612.
TEST(ConfigTest, SoftmaxScaleOtherModels) {
  absl::StatusOr<ModelConfig> kimi = ParseModelConfig(
      Replace(R"("factor": 40,)", R"("factor": 32.0,)"), "kimi/config.json");
  ASSERT_TRUE(kimi.ok()) << kimi.status();
  EXPECT_NEAR(SoftmaxScale(*kimi), 0.13086079996295008, 1e-15);

  std::string lite = Replace(R"("mscale_all_dim": 1.0,)", R"("mscale_all_dim": 0.707,)");
  absl::StrReplaceAll({{R"("q_lora_rank": 1536,)", R"("q_lora_rank": null,)"}}, &lite);
  absl::StatusOr<ModelConfig> v2 = ParseModelConfig(lite, "lite/config.json");
  ASSERT_TRUE(v2.ok()) << v2.status();
  EXPECT_FALSE(v2->q_lora_rank.has_value());
  EXPECT_NEAR(SoftmaxScale(*v2), 0.11472138679292612, 1e-15);
}

// DeepseekV3Attention corrects the scale only for a nonzero mscale_all_dim, whose
// default is 0; the other YaRN keys have DeepSeek's defaults.
TEST(ConfigTest, YarnDefaults) {
  const std::string text = Replace(R"("beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,)",
                                   R"("factor": 40,)");
  absl::StatusOr<ModelConfig> c = ParseModelConfig(text, "c");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->yarn->beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c->yarn->beta_slow, 1.0);
  EXPECT_DOUBLE_EQ(c->yarn->mscale, 1.0);
  EXPECT_DOUBLE_EQ(c->yarn->mscale_all_dim, 0.0);
  EXPECT_NEAR(SoftmaxScale(*c), 0.07216878364870323, 1e-15);
  // Newer transformers spell the type rope_type.
  absl::StatusOr<ModelConfig> t = ParseModelConfig(Replace(R"("type": "yarn")", R"("rope_type": "yarn")"), "c");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_TRUE(t->yarn.has_value());
}

TEST(ConfigTest, DtypesAndQuantization) {
  absl::StatusOr<ModelConfig> f16 =
      ParseModelConfig(Replace(R"("torch_dtype": "bfloat16")", R"("dtype": "float16")"), "c");
  ASSERT_TRUE(f16.ok()) << f16.status();
  EXPECT_EQ(f16->dtype, kernels::DType::kFP16);
  // Another quantization method is recorded; the loader rejects what it cannot read.
  absl::StatusOr<ModelConfig> other = ParseModelConfig(
      Replace(R"("quant_method": "fp8",)", R"("quant_method": "compressed-tensors",)"), "c");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->quant_method, "compressed-tensors");
  EXPECT_FALSE(other->fp8.has_value());
}

struct BadCase {
  const char* from;
  const char* to;
  const char* key;       // the message must name it
  const char* expected;  // and say what was expected
};

TEST(ConfigTest, ErrorsNameFileKeyAndExpectation) {
  const BadCase cases[] = {
      {R"("hidden_size": 7168,)", "", "hidden_size", "an integer in [1, 1048576]"},
      {R"("hidden_size": 7168,)", R"("hidden_size": "7168",)", "hidden_size", "an integer"},
      {R"("hidden_size": 7168,)", R"("hidden_size": 7168.5,)", "hidden_size", "an integer"},
      {R"("num_attention_heads": 128,)", R"("num_attention_heads": 0,)", "num_attention_heads", "[1, 1048576]"},
      {R"("num_attention_heads": 128,)", R"("num_attention_heads": -4,)", "num_attention_heads", "[1, 1048576]"},
      {R"("kv_lora_rank": 512,)", R"("kv_lora_rank": null,)", "kv_lora_rank", "an integer"},
      {R"("q_lora_rank": 1536,)", "", "q_lora_rank", "or null"},
      {R"("q_lora_rank": 1536,)", R"("q_lora_rank": true,)", "q_lora_rank", "an integer"},
      {R"("qk_rope_head_dim": 64,)", R"("qk_rope_head_dim": 63,)", "qk_rope_head_dim", "even"},
      {R"("v_head_dim": 128,)", R"("v_head_dim": 99999999999,)", "v_head_dim", "[1, 1048576]"},
      {R"("num_hidden_layers": 61,)", "", "num_hidden_layers", "an integer"},
      {R"("rms_norm_eps": 1e-06,)", R"("rms_norm_eps": 0,)", "rms_norm_eps", "a positive number"},
      {R"("rope_theta": 10000,)", "", "rope_theta", "a positive number"},
      {R"("torch_dtype": "bfloat16",)", R"("torch_dtype": "float32",)", "torch_dtype", "\"bfloat16\" or \"float16\""},
      {R"("torch_dtype": "bfloat16",)", "", "torch_dtype", "\"bfloat16\""},
      {R"("type": "yarn")", R"("type": "linear")", "rope_scaling.type", "\"yarn\""},
      {R"("factor": 40,)", R"("factor": -1,)", "rope_scaling.factor", "a positive number"},
      {R"("original_max_position_embeddings": 4096,)", "", "rope_scaling.original_max_position_embeddings",
       "an integer"},
      {R"("beta_fast": 32,)", R"("beta_fast": "fast",)", "rope_scaling.beta_fast", "a positive number"},
      {R"("weight_block_size": [128, 128])", R"("weight_block_size": [128])", "quantization_config.weight_block_size",
       "[rows, cols]"},
      {R"("weight_block_size": [128, 128])", R"("weight_block_size": [128, 0])",
       "quantization_config.weight_block_size", "[rows, cols]"},
      {R"("fmt": "e4m3",)", R"("fmt": "e5m2",)", "quantization_config.fmt", "\"e4m3\""},
      {R"("quant_method": "fp8",)", "", "quantization_config.quant_method", "a string"},
  };
  for (const BadCase& b : cases) {
    std::string text = kDeepSeekV3;
    ASSERT_EQ(absl::StrReplaceAll({{b.from, b.to}}, &text), 1) << b.from;
    absl::StatusOr<ModelConfig> c = ParseModelConfig(text, "/models/x/config.json");
    ASSERT_FALSE(c.ok()) << b.key;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << b.key;
    const std::string msg(c.status().message());
    EXPECT_THAT(msg, HasSubstr("/models/x/config.json: ")) << msg;
    EXPECT_THAT(msg, HasSubstr(std::string(b.key) + ": expected ")) << msg;
    EXPECT_THAT(msg, HasSubstr(b.expected)) << msg;
  }
}

TEST(ConfigTest, NotJsonOrNotAnObject) {
  for (const char* text : {"{\"hidden_size\": ", "[1, 2]", ""}) {
    absl::StatusOr<ModelConfig> c = ParseModelConfig(text, "m/config.json");
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_THAT(std::string(c.status().message()), HasSubstr("m/config.json: ")) << c.status();
  }
}

TEST(ConfigTest, DuplicateKeysAndDeepNesting) {
  std::string text = kDeepSeekV3;
  text.insert(1, R"("hidden_size": 4096,)");
  absl::StatusOr<ModelConfig> c = ParseModelConfig(text, "m/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("m/config.json: names \"hidden_size\" twice"));

  text = kDeepSeekV3;
  text.insert(1, "\"x\": " + std::string(100000, '[') + std::string(100000, ']') + ",");
  c = ParseModelConfig(text, "m/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("m/config.json: nests deeper than 16 levels"));
}

TEST(ConfigTest, LoadModelConfigMissingFile) {
  absl::StatusOr<ModelConfig> c = LoadModelConfig("/nonexistent/model");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("/nonexistent/model/config.json"));
}

}  // namespace
}  // namespace latentd::engine::model
