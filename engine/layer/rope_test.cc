// Tests of the YaRN rotary table: inverse frequencies and attention factor against the formulas
// evaluated here in double, the two layouts, and a table computed by numpy following HF's code
// (testdata/rope_reference.py).
#include "engine/layer/rope.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace latentd::engine::layer {
namespace {

struct RopeReferenceCase {
  const char* name;
  int dim;
  double theta;
  bool yarn;
  double factor;
  int64_t original;
  double beta_fast, beta_slow, mscale, mscale_all_dim;
  double attention_factor;
  float inv_freq[32];
  float interleaved[8][64];  // [position index][value], for kRopePositions
  float plain[8][64];
};

#include "engine/layer/testdata/rope_reference.inc"

model::YarnScaling DeepSeekV3Yarn() {
  model::YarnScaling y;
  y.factor = 40;
  y.original_max_position_embeddings = 4096;
  y.beta_fast = 32;
  y.beta_slow = 1;
  y.mscale = 1;
  y.mscale_all_dim = 1;
  return y;
}

model::YarnScaling VariantYarn() {
  model::YarnScaling y;
  y.factor = 8;
  y.original_max_position_embeddings = 2048;
  y.beta_fast = 16;
  y.beta_slow = 2;
  y.mscale = 0.9;
  y.mscale_all_dim = 0.3;
  return y;
}

RopeConfig Config(double theta, std::optional<model::YarnScaling> yarn, bool interleave) {
  RopeConfig c;
  c.dim = 64;
  c.theta = theta;
  c.yarn = yarn;
  c.interleave = interleave;
  return c;
}

Rope MakeRope(const RopeConfig& c, int max_positions) {
  absl::StatusOr<Rope> r = Rope::Create(c, max_positions);
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

// The inverse frequency of pair i, written from YaRN's definition rather than HF's code path:
// the pair index at which the original context holds r full turns of the unscaled frequency is
// (d/2) log_theta(L / (2 pi r)); pairs below the beta_fast index keep their frequency, pairs
// above the beta_slow index are divided by the factor, linearly in between.
double ExpectedInvFreq(int i, int d, double theta, const model::YarnScaling* yarn) {
  const double unscaled = std::exp(-std::log(theta) * (2.0 * i) / d);
  if (yarn == nullptr) return unscaled;
  const double L = static_cast<double>(yarn->original_max_position_embeddings);
  auto pair_index = [&](double turns) { return (d / 2.0) * std::log(L / (2 * M_PI * turns)) / std::log(theta); };
  double low = std::floor(pair_index(yarn->beta_fast));
  double high = std::ceil(pair_index(yarn->beta_slow));
  if (low < 0) low = 0;
  if (high > d - 1) high = d - 1;
  if (low == high) high += 0.001;
  double t = (i - low) / (high - low);
  t = t < 0 ? 0 : (t > 1 ? 1 : t);
  return unscaled * (1.0 - t * (1.0 - 1.0 / yarn->factor));
}

TEST(RopeTest, InvFreqMatchesYarnFormula) {
  const model::YarnScaling ds = DeepSeekV3Yarn(), variant = VariantYarn();
  struct Case {
    double theta;
    const model::YarnScaling* yarn;
  } cases[] = {{10000, &ds}, {50000, &variant}, {10000, nullptr}};
  for (const Case& c : cases) {
    const Rope rope = MakeRope(Config(c.theta, c.yarn ? std::optional(*c.yarn) : std::nullopt, true), 8);
    ASSERT_EQ(rope.inv_freq().size(), 32u);
    for (int i = 0; i < 32; ++i) {
      const double want = ExpectedInvFreq(i, 64, c.theta, c.yarn);
      EXPECT_NEAR(rope.inv_freq()[i], want, 4e-7 * want) << "theta " << c.theta << " pair " << i;
    }
  }
}

// DeepSeek-V3's correction range, by hand: 32 ln(4096 / (64 pi)) / ln(10000) = 10.47 and
// 32 ln(4096 / (2 pi)) / ln(10000) = 22.5, so pairs 0..10 keep theta^(-2i/64) and pairs
// 23..31 are divided by 40; an off-by-one in the ramp moves these ends.
TEST(RopeTest, DeepSeekV3RampEnds) {
  const Rope rope = MakeRope(Config(10000, DeepSeekV3Yarn(), true), 8);
  for (int i = 0; i < 32; ++i) {
    const double unscaled = std::pow(10000.0, -i / 32.0);
    if (i <= 10) {
      EXPECT_NEAR(rope.inv_freq()[i], unscaled, 2e-7 * unscaled) << i;
    } else if (i >= 23) {
      EXPECT_NEAR(rope.inv_freq()[i], unscaled / 40, 2e-7 * unscaled / 40) << i;
    } else {
      EXPECT_LT(rope.inv_freq()[i], unscaled * (1 - 1e-3)) << i;
      EXPECT_GT(rope.inv_freq()[i], unscaled / 40 * (1 + 1e-3)) << i;
    }
  }
}

TEST(RopeTest, AttentionFactor) {
  EXPECT_DOUBLE_EQ(MakeRope(Config(10000, DeepSeekV3Yarn(), true), 1).attention_factor(), 1.0);
  const double want = (1 + 0.09 * std::log(8.0)) / (1 + 0.03 * std::log(8.0));
  EXPECT_NEAR(MakeRope(Config(50000, VariantYarn(), true), 1).attention_factor(), want, 1e-15);
  // mscale_all_dim absent (0): the denominator is 1.
  model::YarnScaling y = DeepSeekV3Yarn();
  y.mscale_all_dim = 0;
  EXPECT_NEAR(MakeRope(Config(10000, y, true), 1).attention_factor(), 1 + 0.1 * std::log(40.0), 1e-15);
  EXPECT_EQ(MakeRope(Config(10000, std::nullopt, true), 1).attention_factor(), 1.0);
}

std::vector<float> Input() { return std::vector<float>(kRopeInput, kRopeInput + 64); }

std::vector<float> Deinterleave(const std::vector<float>& x) {
  std::vector<float> out(64);
  for (int i = 0; i < 32; ++i) {
    out[i] = x[2 * i];
    out[32 + i] = x[2 * i + 1];
  }
  return out;
}

TEST(RopeTest, PositionZeroIsIdentityTimesAttentionFactor) {
  for (bool interleave : {false, true}) {
    const Rope rope = MakeRope(Config(50000, VariantYarn(), interleave), 4);
    std::vector<float> x = Input();
    ASSERT_TRUE(rope.Apply(0, absl::MakeSpan(x)).ok());
    // Interleaved input comes out de-interleaved (HF's layout), unrotated at position 0.
    const std::vector<float> want = interleave ? Deinterleave(Input()) : Input();
    const float f = static_cast<float>(rope.attention_factor());
    for (int i = 0; i < 64; ++i) EXPECT_FLOAT_EQ(x[i], want[i] * f) << i;
  }
}

TEST(RopeTest, InterleavedIsPlainOnDeinterleavedInput) {
  const Rope interleaved = MakeRope(Config(10000, DeepSeekV3Yarn(), true), 5000);
  const Rope plain = MakeRope(Config(10000, DeepSeekV3Yarn(), false), 5000);
  for (int p : {1, 77, 4999}) {
    std::vector<float> a = Input();
    std::vector<float> b = Deinterleave(Input());
    ASSERT_TRUE(interleaved.Apply(p, absl::MakeSpan(a)).ok());
    ASSERT_TRUE(plain.Apply(p, absl::MakeSpan(b)).ok());
    for (int i = 0; i < 64; ++i) EXPECT_EQ(a[i], b[i]) << "position " << p << " value " << i;
    // The two layouts do differ on the same input.
    std::vector<float> c = Input();
    ASSERT_TRUE(plain.Apply(p, absl::MakeSpan(c)).ok());
    EXPECT_NE(c, a);
  }
}

// Each pair turns by position * inv_freq (checked in double with the formula's frequencies) and
// keeps its length times the attention factor.
TEST(RopeTest, RotatesEachPairByItsAngle) {
  const model::YarnScaling y = VariantYarn();
  const Rope rope = MakeRope(Config(50000, y, false), 1001);
  const double f = rope.attention_factor();
  for (int p : {1, 3, 1000}) {
    std::vector<float> x = Input();
    ASSERT_TRUE(rope.Apply(p, absl::MakeSpan(x)).ok());
    for (int i = 0; i < 32; ++i) {
      const double angle = p * ExpectedInvFreq(i, 64, 50000, &y);
      const double a = kRopeInput[i], b = kRopeInput[i + 32];
      EXPECT_NEAR(x[i], f * (a * std::cos(angle) - b * std::sin(angle)), 2e-4) << p << " " << i;
      EXPECT_NEAR(x[i + 32], f * (b * std::cos(angle) + a * std::sin(angle)), 2e-4) << p << " " << i;
    }
  }
}

// Against numpy (float32, HF's order of operations) at positions up to 163839, where a float32
// angle of ~1.6e5 radians makes any difference in inv_freq visible.
TEST(RopeTest, TableFromNumpy) {
  for (const RopeReferenceCase& c : kRopeCases) {
    SCOPED_TRACE(c.name);
    std::optional<model::YarnScaling> yarn;
    if (c.yarn) {
      model::YarnScaling y;
      y.factor = c.factor;
      y.original_max_position_embeddings = c.original;
      y.beta_fast = c.beta_fast;
      y.beta_slow = c.beta_slow;
      y.mscale = c.mscale;
      y.mscale_all_dim = c.mscale_all_dim;
      yarn = y;
    }
    const int max_positions = static_cast<int>(kRopePositions[7]) + 1;
    for (bool interleave : {true, false}) {
      const Rope rope = MakeRope(Config(c.theta, yarn, interleave), max_positions);
      EXPECT_NEAR(rope.attention_factor(), c.attention_factor, 1e-15);
      for (int i = 0; i < 32; ++i) EXPECT_EQ(rope.inv_freq()[i], c.inv_freq[i]) << "pair " << i;
      for (int k = 0; k < 8; ++k) {
        std::vector<float> x = Input();
        ASSERT_TRUE(rope.Apply(kRopePositions[k], absl::MakeSpan(x)).ok());
        const float* want = interleave ? c.interleaved[k] : c.plain[k];
        // float32 cos/sin of the same float32 angle may differ by an ulp between libm and numpy.
        for (int i = 0; i < 64; ++i) {
          EXPECT_NEAR(x[i], want[i], 1e-6)
              << "position " << kRopePositions[k] << " value " << i << (interleave ? " interleaved" : " plain");
        }
      }
    }
  }
}

TEST(RopeTest, Errors) {
  const Rope rope = MakeRope(Config(10000, DeepSeekV3Yarn(), true), 16);
  std::vector<float> x(64);
  EXPECT_EQ(rope.Apply(16, absl::MakeSpan(x)).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(rope.Apply(-1, absl::MakeSpan(x)).code(), absl::StatusCode::kOutOfRange);
  std::vector<float> short_x(63);
  EXPECT_EQ(rope.Apply(0, absl::MakeSpan(short_x)).code(), absl::StatusCode::kInvalidArgument);

  RopeConfig odd = Config(10000, std::nullopt, true);
  odd.dim = 63;
  absl::StatusOr<Rope> r = Rope::Create(odd, 16);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("qk_rope_head_dim"), absl::string_view::npos) << r.status();
  EXPECT_EQ(Rope::Create(Config(10000, std::nullopt, true), 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Rope::Create(Config(10000, std::nullopt, true), Rope::kMaxPositions + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  model::YarnScaling bad = DeepSeekV3Yarn();
  bad.factor = 0;
  r = Rope::Create(Config(10000, bad, true), 16);
  EXPECT_NE(r.status().message().find("rope_scaling.factor"), absl::string_view::npos) << r.status();
}

}  // namespace
}  // namespace latentd::engine::layer
