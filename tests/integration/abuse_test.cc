// Random malformed traffic from several clients at once against the real daemon: steps
// broken in random fields, bad unary requests, undecodable and mutated message bytes,
// streams abandoned mid-way. Meanwhile a well-behaved client's results must stay
// correct; afterwards the daemon still serves and no page has leaked.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/generic/generic_stub.h"
#include "tests/integration/daemon.h"
#include "tests/integration/tracker.h"

namespace latentd::testing {
namespace {

using Rng = std::mt19937_64;

int Pick(Rng& rng, int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); }

std::string RandomBytes(Rng& rng, size_t n, bool printable) {
  std::string s(n, '\0');
  for (char& c : s) c = printable ? static_cast<char>(' ' + Pick(rng, 95)) : static_cast<char>(rng());
  return s;
}

// Ids that are sometimes well-formed, sometimes not (empty, too long, bad characters).
std::string RandomId(Rng& rng) {
  switch (Pick(rng, 4)) {
    case 0: return "";
    case 1: return RandomBytes(rng, 1 + Pick(rng, 200), true);
    case 2: return absl::StrCat("g", rng() % 1000);
    default: return std::string(129, 'a');
  }
}

// Byte sizes around the valid ones, and far from them.
size_t RandomSize(Rng& rng, int64_t row_bytes) {
  switch (Pick(rng, 5)) {
    case 0: return 0;
    case 1: return static_cast<size_t>(row_bytes * (1 + Pick(rng, 12)));  // s_q may exceed the cap
    case 2: return static_cast<size_t>(row_bytes + Pick(rng, 9) - 4);
    case 3: return static_cast<size_t>(Pick(rng, 64));
    default: return static_cast<size_t>(Pick(rng, 1 << 20));
  }
}

// One misbehaving client: its own connection, its own sequences, random abuse.
class Abuser {
 public:
  Abuser(client::Client* c, uint64_t seed) : c_(c), rng_(seed) {}

  void Run(absl::Time until) {
    while (absl::Now() < until && !::testing::Test::HasFatalFailure()) {
      switch (Pick(rng_, 6)) {
        case 0: BadSteps(); break;
        case 1: Own(c_->CreateSequence(RandomId(rng_))); break;
        case 2: BadAppend(); break;
        case 3: Own(c_->ForkSequence(SomeId(), RandomId(rng_))); break;
        case 4: Release(SomeId()); break;
        default: RawBytes(); break;
      }
      ++ops_;
    }
  }

  // Releases whatever it still owns.
  void CleanUp() {
    for (const auto& id : std::set<std::string>(owned_)) Release(id);
  }

  int ops() const { return ops_; }

 private:
  void Own(const absl::StatusOr<std::string>& id) {
    if (id.ok()) owned_.insert(*id);
  }
  void Release(const std::string& id) {
    auto r = c_->ReleaseSequence(id);
    if (r.ok() || absl::IsNotFound(r.status())) owned_.erase(id);
  }
  std::string SomeId() {
    if (!owned_.empty() && Pick(rng_, 4) != 0) {
      auto it = owned_.begin();
      std::advance(it, Pick(rng_, static_cast<int>(owned_.size())));
      return *it;
    }
    return RandomId(rng_);
  }

  void BadAppend() {
    const client::Shape& sh = c_->shape();
    const int layer = Pick(rng_, 3) == 0 ? static_cast<int>(rng_()) : Pick(rng_, sh.num_layers);
    // Valid rows are random too: they land in this client's own sequences only.
    auto r = c_->AppendKv(SomeId(), layer, RandomBytes(rng_, RandomSize(rng_, sh.kv_row_bytes), false));
    (void)r;
  }

  v1::DecodeStep RandomStep() {
    const client::Shape& sh = c_->shape();
    v1::DecodeStep s;
    s.set_request_id(rng_());
    s.set_sequence_id(SomeId());
    s.set_layer(Pick(rng_, 3) == 0 ? static_cast<int>(rng_()) : Pick(rng_, sh.num_layers));
    const int s_q = 1 + Pick(rng_, 3);
    s.set_q(RandomBytes(rng_, Pick(rng_, 2) ? size_t(sh.QBytes(s_q)) : RandomSize(rng_, sh.q_row_bytes), false));
    s.set_kv(RandomBytes(rng_, Pick(rng_, 2) ? size_t(sh.KvBytes(s_q)) : RandomSize(rng_, sh.kv_row_bytes), false));
    s.set_causal(Pick(rng_, 2));
    if (Pick(rng_, 4) == 0) s.set_timeout_ms(static_cast<uint32_t>(rng_()));
    return s;
  }

  void BadSteps() {
    auto stream = c_->OpenDecodeStream();
    v1::DecodeRequest req;
    const int n = 1 + Pick(rng_, 6);
    for (int i = 0; i < n; ++i) *req.add_steps() = RandomStep();
    const bool wrote = stream->Write(req);
    if (Pick(rng_, 3) == 0) {
      stream->Cancel();  // gone without reading its results
    } else if (wrote) {
      stream->WritesDone();
    }
    v1::DecodeResponse resp;
    int results = 0;
    while (stream->Read(&resp)) {
      for (const auto& r : resp.results()) {
        ++results;
        // Whatever the input, an answer is an error with a message or a whole result.
        if (r.code() != 0) {
          EXPECT_FALSE(r.message().empty()) << "code " << r.code();
        } else {
          EXPECT_EQ(r.out().size() % c_->shape().out_row_bytes, 0u);
          EXPECT_FALSE(r.out().empty());
        }
      }
    }
    const grpc::Status st = stream->Finish();
    if (st.ok()) {
      EXPECT_EQ(results, n);
    }
  }

  // Bytes that are not a message, or a valid message with some bytes changed, sent to
  // any method of the service.
  void RawBytes() {
    static const char* kMethods[] = {
        "/latentd.v1.DecodeService/GetInfo",        "/latentd.v1.DecodeService/CreateSequence",
        "/latentd.v1.DecodeService/AppendKv",       "/latentd.v1.DecodeService/Decode",
        "/latentd.v1.DecodeService/ForkSequence",   "/latentd.v1.DecodeService/ReleaseSequence",
    };
    std::string bytes;
    const bool mutated = Pick(rng_, 2) == 0;
    if (!mutated) {
      bytes = RandomBytes(rng_, Pick(rng_, 4096), false);
    } else {
      v1::DecodeRequest req;
      for (int i = 0, n = 1 + Pick(rng_, 3); i < n; ++i) *req.add_steps() = RandomStep();
      bytes = req.SerializeAsString();
      for (int i = 0, flips = 1 + Pick(rng_, 8); i < flips && !bytes.empty(); ++i)
        bytes[Pick(rng_, static_cast<int>(bytes.size()))] = static_cast<char>(rng_());
    }
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::GenericStub stub(c_->channel());
    grpc::ClientContext ctx;
    c_->Prepare(&ctx);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    absl::Notification done;
    grpc::Status status;
    const char* method = kMethods[Pick(rng_, 6)];
    stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response,
                   [&](grpc::Status s) {
                     status = std::move(s);
                     done.Notify();
                   });
    done.WaitForNotification();
    // Decode called as if unary may stall by design: its results can span several
    // messages, and a caller that reads one stops the flow; its deadline then ends it.
    // Every other method answers once.
    if (std::string(method) != "/latentd.v1.DecodeService/Decode") {
      EXPECT_NE(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
          << method << (mutated ? " (mutated request, " : " (random bytes, ") << bytes.size()
          << " bytes): no answer in 5 s";
    }
  }

  client::Client* c_;
  Rng rng_;
  std::set<std::string> owned_;
  int ops_ = 0;
};

TEST(AbuseTest, MalformedTrafficHurtsNobodyElse) {
  Daemon daemon({"--num_layers=2", "--num_heads_q=16", "--max_s_q=4", "--kv_pages=1024"});
  ASSERT_TRUE(daemon.Start()) << daemon.Log();
  auto good = daemon.Connect();
  ASSERT_TRUE(good.ok()) << good.status();
  Tracker tracker(good->get(), 7);
  std::vector<std::string> mine;
  for (int i = 0; i < 2; ++i) {
    auto s = tracker.NewSequence({70 + 60 * i, 130});
    ASSERT_TRUE(s.ok()) << s.status();
    mine.push_back(*s);
  }

  constexpr int kAbusers = 3;
  const absl::Time until = absl::Now() + absl::Seconds(6);
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::unique_ptr<Abuser>> abusers;
  for (int i = 0; i < kAbusers; ++i) {
    auto c = daemon.Connect();
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(std::move(*c));
    abusers.push_back(std::make_unique<Abuser>(clients.back().get(), 1000 + i));
  }
  std::vector<std::thread> threads;
  for (auto& a : abusers) threads.emplace_back([&a, until] { a->Run(until); });

  // The well-behaved client keeps decoding, every result checked.
  int checked = 0;
  while (absl::Now() < until) {
    std::vector<v1::DecodeStep> steps;
    for (const auto& s : mine)
      for (int layer = 0; layer < 2; ++layer) steps.push_back(tracker.Step(s, layer, 1 + layer, layer == 1));
    auto r = (*good)->DecodeAll(steps);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->size(), steps.size());
    for (const auto& [id, res] : *r) {
      ASSERT_TRUE(tracker.Check(res).ok()) << tracker.Check(res);
      ++checked;
    }
  }
  for (auto& t : threads) t.join();
  int ops = 0;
  for (auto& a : abusers) {
    a->CleanUp();
    ops += a->ops();
  }
  EXPECT_GT(checked, 0);
  EXPECT_GT(ops, 100);
  std::printf("%d abusive operations; %d results of the well-behaved client checked\n", ops, checked);

  ASSERT_TRUE(daemon.Running()) << daemon.Log();
  EXPECT_EQ(*(*good)->Health(), "SERVING");
  // Only the well-behaved client's sequences remain and hold pages (steps of abandoned
  // streams may still be finishing, so give it a moment).
  int64_t my_pages = 0;
  for (const auto& s : mine) {
    int64_t longest = 0;
    for (int layer = 0; layer < 2; ++layer) longest = std::max(longest, tracker.reference().Length(s, layer));
    my_pages += (longest + 63) / 64;
  }
  absl::StatusOr<v1::ServerInfo> info;
  const absl::Time deadline = absl::Now() + HangGuard(absl::Seconds(10));
  do {
    info = (*good)->GetInfo();
    ASSERT_TRUE(info.ok()) << info.status();
    if (info->sequences() == 2 && info->free_pages() == info->total_pages() - my_pages) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < deadline);
  EXPECT_EQ(info->sequences(), 2);
  EXPECT_EQ(info->free_pages(), info->total_pages() - my_pages);
  // And it still decodes correctly.
  auto r = (*good)->DecodeAll({tracker.Step(mine[0], 0)});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(tracker.Check(r->begin()->second).ok());
}

}  // namespace
}  // namespace latentd::testing
