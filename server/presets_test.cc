// Pins the --model preset table: shapes, tensor-parallel division, aliases, errors and
// the YaRN-corrected softmax scales (reference values computed independently in double).
#include "server/presets.h"

#include <cmath>

#include "gtest/gtest.h"

namespace latentd::server {
namespace {

TEST(PresetsTest, DeepSeekV3) {
  auto p = ResolvePreset("deepseek-v3", 1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->name, "deepseek-v3");
  EXPECT_EQ(p->num_layers, 61);
  EXPECT_EQ(p->num_heads_q, 128);
  EXPECT_EQ(p->num_heads_kv, 1);
  EXPECT_EQ(p->dtype, "bf16");
  // mscale = 0.1 * ln(40) + 1 = 1.368888; mscale^2 / sqrt(192).
  EXPECT_NEAR(p->softmax_scale, 0.13523377886088, 1e-12);
}

TEST(PresetsTest, AliasAndCase) {
  auto r1 = ResolvePreset("DeepSeek-R1", 8);
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r1->name, "deepseek-v3");
  EXPECT_EQ(r1->num_heads_q, 16);
  EXPECT_EQ(r1->tensor_parallel, 8);
}

TEST(PresetsTest, DeepSeekV2Lite) {
  auto p = ResolvePreset("deepseek-v2-lite", 2);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->num_layers, 27);
  EXPECT_EQ(p->num_heads_q, 8);
  // mscale = 0.1 * 0.707 * ln(40) + 1 = 1.260804.
  EXPECT_NEAR(p->softmax_scale, 0.11472138679293, 1e-12);
}

TEST(PresetsTest, KimiK2) {
  auto p = ResolvePreset("kimi-k2", 4);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->num_layers, 61);
  EXPECT_EQ(p->num_heads_q, 16);
  // mscale = 0.1 * ln(32) + 1 = 1.346574.
  EXPECT_NEAR(p->softmax_scale, 0.13086079996295, 1e-12);
  auto q = ResolvePreset("kimi-k2-0905", 1);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->num_heads_q, 64);
  EXPECT_NEAR(q->softmax_scale, 0.14467962580269, 1e-12);
}

TEST(PresetsTest, TensorParallelMustDivide) {
  auto p = ResolvePreset("deepseek-v3", 3);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("--tensor_parallel"), std::string::npos);
  EXPECT_FALSE(ResolvePreset("deepseek-v2-lite", 0).ok());
  EXPECT_FALSE(ResolvePreset("deepseek-v2-lite", 32).ok());
  EXPECT_TRUE(ResolvePreset("deepseek-v2-lite", 16).ok());
}

TEST(PresetsTest, UnknownListsKnownNames) {
  auto p = ResolvePreset("llama-3", 1);
  ASSERT_FALSE(p.ok());
  const std::string m(p.status().message());
  for (const char* name : {"deepseek-v3", "deepseek-r1", "deepseek-v2-lite", "kimi-k2"}) {
    EXPECT_NE(m.find(name), std::string::npos) << m;
  }
}

TEST(PresetsTest, ScaleUsesOriginalHeadDim) {
  // Without YaRN the scale is 1/sqrt(128 + 64), not latentd's default 1/sqrt(576).
  EXPECT_DOUBLE_EQ(YarnMscale(1.0, 1.0), 1.0);
  ModelPreset plain{"x", "", 1, 1, 128, 64, 1.0, 1.0};
  EXPECT_DOUBLE_EQ(PresetSoftmaxScale(plain), 1.0 / std::sqrt(192.0));
  for (const ModelPreset& p : ModelPresets()) {
    EXPECT_EQ(p.qk_nope_head_dim + p.qk_rope_head_dim, 192) << p.name;
    EXPECT_GT(PresetSoftmaxScale(p), 1.0 / std::sqrt(192.0)) << p.name;
  }
}

}  // namespace
}  // namespace latentd::server
