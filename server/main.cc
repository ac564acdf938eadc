// latentd: the MLA decode attention daemon. Parses flags, builds the engine, serves
// latentd.v1.DecodeService (plus health and reflection) and drains cleanly on
// SIGTERM/SIGINT: health NOT_SERVING, new work UNAVAILABLE, accepted steps finish.
// Exit codes: 0 clean drain; 1 drain timed out or accepted steps went undelivered;
// 2 bad flags or start-up failure; 128 + signal (130, 143) on a second signal mid-drain.
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/internal/private_handle_accessor.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/engine.h"
#include "engine/layer/layer_math.h"
#include "engine/model/config.h"
#include "engine/model/safetensors.h"
#include "engine/model/weights.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/auth.h"
#include "server/dataplane/fd_handoff.h"
#include "server/lock_order.h"
#include "server/metrics_exporter.h"
#include "server/presets.h"
#include "server/sd_notify.h"
#include "server/service.h"
#include "server/version.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

// Model presets (server/presets.cc): --model fills --num_layers, --num_heads_q,
// --num_heads_kv, --dtype and --softmax_scale; any of them given explicitly wins.
ABSL_FLAG(std::string, model, "",
          "model preset: deepseek-v3, deepseek-r1 (= deepseek-v3), deepseek-v2-lite, kimi-k2, kimi-k2-0905; "
          "sets the shape and the YaRN-corrected softmax scale (explicit shape flags override it)");
ABSL_FLAG(int, tensor_parallel, 1,
          "with --model or --model_dir: tensor-parallel degree; this daemon serves num_attention_heads / N query "
          "heads");
ABSL_FLAG(std::string, model_dir, "",
          "a Hugging Face checkpoint folder (config.json and *.safetensors): the shape comes from config.json, and "
          "with the attention weights present the daemon also serves the layer API (hidden states in, the layer's "
          "output back; docs/mla-layer-server.md). Not with --model");
ABSL_FLAG(int, tensor_rank, 0,
          "with --model_dir and --tensor_parallel N: this daemon's rank, 0..N-1 (its slice of the heads)");
ABSL_FLAG(int, max_positions, 0,
          "layer API: positions with a rotary table entry (RoPE), at most 1048576; 0 = config.json's "
          "max_position_embeddings (32768 when absent)");

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "address to serve on (host:port; port 0 picks a free one, see --port_file)");
ABSL_FLAG(std::string, backend, "auto", "attention backend: auto (CUDA when a GPU is present), cuda or cpu");
ABSL_FLAG(int, device, 0, "CUDA device ordinal");
ABSL_FLAG(int, num_layers, 1, "layers per sequence (each has its own KV cache)");
ABSL_FLAG(int, num_heads_q, 16, "query heads (h_q), a multiple of num_heads_kv");
ABSL_FLAG(int, num_heads_kv, 1, "latent KV heads (h_kv)");
ABSL_FLAG(std::string, dtype, "bf16", "element type of q, kv and out: bf16 or fp16");
ABSL_FLAG(double, softmax_scale, 0.0, "attention scale; 0 means 1/sqrt(576)");
ABSL_FLAG(std::string, bf16_p_rounding, "split",
          "how the CUDA backend rounds a bf16 model's softmax probabilities for the PV product: split (hi + lo "
          "bf16 parts, the tighter accuracy) or once (one bf16 rounding, faster on compute-bound calls); "
          "docs/p-rounding.md");
ABSL_FLAG(std::string, kv_dtype, "auto",
          "how the KV cache stores rows: auto or the model dtype's name (as sent), or fp8_e4m3 (quantized on "
          "append: 656 instead of 1152 bytes per token and KV head; docs/fp8-kv-cache.md)");
ABSL_FLAG(int64_t, kv_pages, 0, "KV pool size in pages (64 tokens of every layer each)");
ABSL_FLAG(int64_t, kv_bytes, 0, "KV pool size in bytes (used when --kv_pages is 0)");
ABSL_FLAG(double, kv_memory_fraction, 0.0,
          "KV pool as a fraction of free GPU memory (CUDA) or of RAM (CPU), used when the two above are 0; "
          "with none of the three: 0.8 of free GPU memory on CUDA, 1 GiB on CPU");
ABSL_FLAG(int, max_batch_size, 0,
          "most steps per attention launch (0: 64 on CUDA; on the CPU backend, 2 per CPU thread, since its "
          "batches gain little from size and each step waits for its whole batch)");
ABSL_FLAG(int, max_batch_tokens, 1024, "most query rows (sum of s_q) per launch");
ABSL_FLAG(int, batch_window_us, 50, "how long an idle engine waits to fill a batch");
ABSL_FLAG(int, engine_spin_us, 0,
          "how long the scheduler spins after a batch for the next steps before sleeping (0: sleep at once; "
          "a spin saves the next submission a thread wake-up and costs a core while it lasts)");
ABSL_FLAG(int64_t, max_sequences, 65536,
          "live sequences (forks included); CreateSequence and ForkSequence beyond fail RESOURCE_EXHAUSTED "
          "(0: no limit)");
ABSL_FLAG(int64_t, host_kv_bytes, 0,
          "host memory tier for idle sequences' KV rows, in bytes (pinned on CUDA): under pool pressure, or "
          "after --offload_idle_s unused, least recently used sequences move there, and a step for one "
          "brings it back first (0: no tier; a full pool refuses with RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, offload_idle_s, 0,
          "with --host_kv_bytes, move sequences unused for this many seconds to the host tier (0: only under "
          "pool pressure)");
ABSL_FLAG(int, max_queue, 4096, "queued steps before new ones fail RESOURCE_EXHAUSTED");
ABSL_FLAG(int, completion_threads, 4,
          "threads that answer finished steps (start their gRPC writes), so the scheduler stages the next "
          "batch meanwhile; 0: the scheduler answers them itself (it always answers doorbell-ring steps)");
ABSL_FLAG(int, max_s_q, 8, "most query tokens per decode step");
ABSL_FLAG(int, cpu_threads, 0, "CPU backend threads (0: all cores)");
ABSL_FLAG(int64_t, max_message_bytes, 64 << 20,
          "largest request message accepted; larger ones fail RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_stream_inflight, 1024,
          "steps one Decode stream may have in the engine at once; a message's steps beyond it wait in the "
          "stream, which is not read again until they are in");
ABSL_FLAG(int, max_steps_per_message, 1024,
          "most steps in one DecodeRequest; a larger message ends its stream RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_inflight_bytes, int64_t{2} << 30,
          "step buffers (q, kv, out, lse) held for all Decode streams together; steps beyond fail "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_streams, 4096, "Decode and AppendKv streams open at once over all clients");
ABSL_FLAG(int, max_streams_per_connection, 1024,
          "concurrent RPCs per client connection (HTTP/2 MAX_CONCURRENT_STREAMS; more wait in the client)");
ABSL_FLAG(int64_t, max_upload_bytes, int64_t{256} << 20,
          "AppendKv bytes received and not yet applied, over all streams; beyond it the upload fails "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(std::string, pinned_step_inputs, "auto",
          "auto: read Decode steps' q and kv straight into host memory registered with the GPU, which reads "
          "them from there (no staging copy per step; the buffers count in --max_inflight_bytes); off: into "
          "plain buffers, staged per batch; always: those buffers even unregistered (tests on the CPU backend)");
ABSL_FLAG(int64_t, max_response_bytes, int64_t{2} << 20,
          "results coalesced into one DecodeResponse (soft cap: a single result may exceed it); clients must "
          "accept messages this large (gRPC's default receive limit is 4 MiB)");
ABSL_FLAG(int64_t, max_region_bytes, int64_t{1} << 30,
          "largest shared region one Decode stream may open (same-host data plane); larger requests fail "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_region_total_bytes, int64_t{8} << 30,
          "shared regions mapped for all open Decode streams together; beyond it opening one fails "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_rings, 64,
          "doorbell rings (DecodeRequest.region_ring_entries) open at once over all streams; each has a "
          "daemon thread polling it while its stream lasts; beyond it opening one fails RESOURCE_EXHAUSTED");
ABSL_FLAG(std::string, data_plane_socket, "",
          "Unix socket on which shared regions' memory files go to their stream's client, each for a "
          "one-time ticket in its Decode response (a path, made mode 0600, or @name in the abstract "
          "namespace; empty: @latentd-<pid>-<random>)");
ABSL_FLAG(bool, data_plane_proc_paths, false,
          "name shared regions by /proc/<pid>/fd paths instead of handing them over, for clients older than "
          "the ticket handoff; any process of the daemon's user can then open every region, and the daemon "
          "stays dumpable (core dumps, ptrace)");
ABSL_FLAG(int, max_rings_per_connection, 16,
          "of --max_rings, rings one client connection may hold at once (1 to 4096; above --max_rings it is "
          "--max_rings), so one client cannot take every ring; beyond it opening one fails RESOURCE_EXHAUSTED");
ABSL_FLAG(int, ring_spin_us, 1000,
          "how long a ring's thread spins on an idle ring before sleeping on its futex (0: sleep at once; "
          "a spin costs a core while it lasts, a sleep 20-30 us of wake-up for the next submission)");
ABSL_FLAG(int64_t, grpc_memory_bytes, int64_t{1} << 30,
          "memory gRPC may use for its own buffers (connections, messages being received); a ResourceQuota");
ABSL_FLAG(int64_t, sequence_ttl_s, 600, "release sequences idle this long (0: never)");
ABSL_FLAG(int64_t, stream_stall_timeout_s, 60,
          "cancel a Decode stream whose client has not taken a response for this long (0: never)");
ABSL_FLAG(int64_t, stats_interval_s, 60, "log engine stats this often while busy (0: never)");
ABSL_FLAG(int64_t, drain_timeout_s, 30, "on SIGTERM/SIGINT, how long accepted steps may take to finish");
ABSL_FLAG(int64_t, drain_handoff_s, 5,
          "after a drain's accepted steps, keep answering ExportSequence while sequences remain, so that clients "
          "move them to other daemons: the daemon exits once none is left, or once this long passes with no "
          "export open or started (and --drain_timeout_s after the steps at the latest); 0: exit at once");
ABSL_FLAG(int64_t, import_stall_timeout_s, 60,
          "cancel an ImportSequence stream whose client has sent no chunk for this long, giving back the pages it "
          "reserved (0: never)");
ABSL_FLAG(int, max_export_streams, 16, "ExportSequence streams open at once; more fail RESOURCE_EXHAUSTED");
ABSL_FLAG(int, max_import_streams, 16,
          "ImportSequence streams open at once (each holds the pages of its sequence until it commits or ends); "
          "more fail RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_transfer_chunk_bytes, int64_t{4} << 20,
          "most row bytes of one ExportSequence or ImportSequence chunk (exports send 1 MiB unless asked for "
          "less); a larger import chunk fails INVALID_ARGUMENT");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain; with --tls_key serves TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key for --tls_cert");
ABSL_FLAG(std::string, auth_token, "",
          "when set, every RPC but health needs metadata 'authorization: Bearer <token>'; visible in ps to "
          "every local user, so prefer --auth_token_file or $LATENTD_AUTH_TOKEN (give only one of the three)");
ABSL_FLAG(std::string, auth_token_file, "",
          "read the token from this file (trailing newline stripped; must not be group/world-readable)");
ABSL_FLAG(int, max_health_watchers, 64,
          "most open grpc.health.v1 Watch streams; more fail RESOURCE_EXHAUSTED (0: Watch always refused)");
ABSL_FLAG(std::string, metrics_listen, "",
          "serve Prometheus metrics (GET /metrics over plain HTTP, no auth) on this literal address, e.g. "
          "127.0.0.1:9464; keep it on loopback or a private network (empty: off)");
ABSL_FLAG(bool, lock_order_checks, false,
          "check the lock order of every mutex acquisition and report cycles on stderr "
          "(debugging; costs a process-wide lock per acquisition)");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or off");
ABSL_FLAG(std::string, port_file, "", "write the bound port here once serving (for --listen host:0)");

namespace latentd::server {
namespace {

int Fail(const std::string& message) {
  spdlog::critical("{}", message);
  return 2;
}

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::ostringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  return true;
}

// Whether the host part of --listen only accepts local peers (a token sent to it in
// clear text does not leave the machine).
bool IsLoopback(absl::string_view host) {
  if (absl::StartsWith(host, "unix:") || absl::StartsWith(host, "unix-abstract:")) return true;
  if (absl::ConsumePrefix(&host, "[")) absl::ConsumeSuffix(&host, "]");
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

bool GpuDevicePresent() {
#ifdef LATENTD_NO_CUDA
  return false;
#else
  struct stat st;
  return stat("/dev/nvidiactl", &st) == 0;
#endif
}

// --model: sets the shape flags not given explicitly (on the command line or in a
// --flagfile) to the preset's values, so BuildEngineOptions validates one set of flags.
// Returns a message naming the bad flag, or empty; *applied describes the result for
// the start-up line.
std::string ApplyModelPreset(std::string* applied) {
  const std::string model = absl::GetFlag(FLAGS_model);
  const int tensor_parallel = absl::GetFlag(FLAGS_tensor_parallel);
  if (model.empty()) {
    *applied = "custom";
    if (tensor_parallel != 1 && absl::GetFlag(FLAGS_model_dir).empty())
      return "--tensor_parallel: only with --model or --model_dir (else give --num_heads_q per rank)";
    return "";
  }
  if (!absl::GetFlag(FLAGS_model_dir).empty()) return "--model and --model_dir: expected one of them, got both";
  auto preset = ResolvePreset(model, tensor_parallel);
  if (!preset.ok()) return std::string(preset.status().message());
  std::vector<std::string> overridden;
  auto fill = [&](auto& flag, const auto& value) {
    // Newer abseil makes IsSpecifiedOnCommandLine public; Debian's 20220623 reaches it
    // through this accessor. It counts flags from --flagfile as given too.
    const absl::CommandLineFlag& handle = absl::GetFlagReflectionHandle(flag);
    if (absl::flags_internal::PrivateHandleAccessor::IsSpecifiedOnCommandLine(handle)) {
      overridden.push_back(absl::StrCat("--", handle.Name()));
    } else {
      absl::SetFlag(&flag, value);
    }
  };
  fill(FLAGS_num_layers, preset->num_layers);
  fill(FLAGS_num_heads_q, preset->num_heads_q);
  fill(FLAGS_num_heads_kv, preset->num_heads_kv);
  fill(FLAGS_dtype, preset->dtype);
  fill(FLAGS_softmax_scale, preset->softmax_scale);
  *applied = absl::StrCat(preset->name, " tp ", tensor_parallel);
  if (!overridden.empty()) absl::StrAppend(applied, " (overridden: ", absl::StrJoin(overridden, " "), ")");
  return "";
}

// --model_dir: the shape from config.json (explicit shape flags must agree with it) and,
// when the folder holds safetensors files, this rank's attention weights for the layer
// API. Returns a message naming the flag, file or tensor, or empty; *applied describes
// the result for the start-up line.
std::string ApplyModelDir(engine::EngineOptions* o, std::string* applied) {
  const std::string dir = absl::GetFlag(FLAGS_model_dir);
  const int rank = absl::GetFlag(FLAGS_tensor_rank);
  o->layer_max_positions = absl::GetFlag(FLAGS_max_positions);
  if (o->layer_max_positions < 0 || o->layer_max_positions > (1 << 20))
    return "--max_positions: expected 0 (config.json's) to 1048576";
  if (dir.empty()) {
    if (rank != 0) return "--tensor_rank: only with --model_dir";
    return "";
  }
  auto config = engine::model::LoadModelConfig(dir);
  if (!config.ok()) return absl::StrCat("--model_dir: ", config.status().message());
  const engine::model::TensorParallel tp{absl::GetFlag(FLAGS_tensor_parallel), rank};
  if (absl::Status st = engine::model::ValidateTensorParallel(*config, tp); !st.ok())
    return absl::StrCat("--", st.message());
  // The decode kernel's row is 512 latent + 64 rope values.
  if (config->kv_lora_rank != kernels::kHeadDimV || config->qk_rope_head_dim != kernels::kHeadDimQK - kernels::kHeadDimV)
    return absl::StrCat("--model_dir: ", config->path, ": kv_lora_rank ", config->kv_lora_rank,
                        " and qk_rope_head_dim ", config->qk_rope_head_dim, "; expected 512 and 64 (the rows the "
                        "decode kernel reads)");
  const int heads = config->num_attention_heads / tp.size;
  const float scale = static_cast<float>(engine::model::SoftmaxScale(*config));
  std::vector<std::string> conflicts;
  auto agree = [&](auto& flag, auto value, auto current) {
    const absl::CommandLineFlag& handle = absl::GetFlagReflectionHandle(flag);
    if (absl::flags_internal::PrivateHandleAccessor::IsSpecifiedOnCommandLine(handle) && current != value)
      conflicts.push_back(absl::StrCat("--", handle.Name(), " (config.json: ", value, ")"));
  };
  agree(FLAGS_num_layers, config->num_hidden_layers, o->model.num_layers);
  agree(FLAGS_num_heads_q, heads, o->model.num_heads_q);
  agree(FLAGS_num_heads_kv, 1, o->model.num_heads_kv);
  agree(FLAGS_dtype, std::string(config->dtype == kernels::DType::kBF16 ? "bf16" : "fp16"),
        absl::AsciiStrToLower(absl::GetFlag(FLAGS_dtype)));
  if (!conflicts.empty())
    return absl::StrCat("--model_dir: ", absl::StrJoin(conflicts, ", "), " disagree with ", config->path);
  o->model.num_layers = config->num_hidden_layers;
  o->model.num_heads_q = heads;
  o->model.num_heads_kv = 1;
  o->model.dtype = config->dtype;
  o->model.softmax_scale = scale;
  *applied = absl::StrCat(dir, " (", config->num_hidden_layers, " layers, ", heads, " of ",
                          config->num_attention_heads, " heads on rank ", rank, " of ", tp.size, ")");
  bool has_weights = false;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec))
    has_weights |= absl::EndsWith(entry.path().filename().string(), ".safetensors");
  if (!has_weights) {
    absl::StrAppend(applied, "; no safetensors files: the kernel-level API only");
    return "";
  }
  auto checkpoint = engine::model::Checkpoint::Open(dir);
  if (!checkpoint.ok()) return absl::StrCat("--model_dir: ", checkpoint.status().message());
  const absl::Time start = absl::Now();
  auto weights = engine::model::LoadAttentionWeights(*checkpoint, *config, tp);
  if (!weights.ok()) return absl::StrCat("--model_dir: ", weights.status().message());
  absl::StrAppend(applied, "; attention weights ", weights->bytes() >> 20, " MiB read in ",
                  absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))), ": the layer API");
  o->layer_config = std::make_shared<const engine::model::ModelConfig>(*std::move(config));
  o->layer_weights = std::make_shared<const engine::model::AttentionWeights>(*std::move(weights));
  return "";
}

// Flags into engine options; returns a message naming the bad flag, or empty.
std::string BuildEngineOptions(engine::EngineOptions* o) {
  const std::string backend = absl::AsciiStrToLower(absl::GetFlag(FLAGS_backend));
  if (backend == "auto") {
    o->backend = engine::BackendKind::kAuto;
  } else if (backend == "cuda") {
    o->backend = engine::BackendKind::kCuda;
  } else if (backend == "cpu") {
    o->backend = engine::BackendKind::kCpu;
  } else {
    return "--backend: '" + backend + "'; expected auto, cuda or cpu";
  }
  const std::string dtype = absl::AsciiStrToLower(absl::GetFlag(FLAGS_dtype));
  if (dtype == "bf16") {
    o->model.dtype = kernels::DType::kBF16;
  } else if (dtype == "fp16") {
    o->model.dtype = kernels::DType::kFP16;
  } else {
    return "--dtype: '" + dtype + "'; expected bf16 or fp16";
  }
  // Clients send rows in the model dtype either way; fp8 is only how the pool keeps them.
  const std::string kv_dtype = absl::AsciiStrToLower(absl::GetFlag(FLAGS_kv_dtype));
  if (kv_dtype == "auto" || kv_dtype == dtype) {
    o->kv_dtype = kernels::KvDType::kModel;
  } else if (kv_dtype == "fp8_e4m3") {
    o->kv_dtype = kernels::KvDType::kFp8E4M3;
  } else {
    return absl::StrCat("--kv_dtype: '", kv_dtype, "'; expected auto, ", dtype, " (the model dtype) or fp8_e4m3");
  }
  const std::string p_rounding = absl::AsciiStrToLower(absl::GetFlag(FLAGS_bf16_p_rounding));
  if (p_rounding == "split") {
    o->model.p_rounding = kernels::PRounding::kSplit;
  } else if (p_rounding == "once") {
    o->model.p_rounding = kernels::PRounding::kOnce;
  } else {
    return "--bf16_p_rounding: '" + p_rounding + "'; expected split or once";
  }
  o->model.num_layers = absl::GetFlag(FLAGS_num_layers);
  o->model.num_heads_q = absl::GetFlag(FLAGS_num_heads_q);
  o->model.num_heads_kv = absl::GetFlag(FLAGS_num_heads_kv);
  o->model.softmax_scale = static_cast<float>(absl::GetFlag(FLAGS_softmax_scale));
  if (o->model.num_layers < 1) return "--num_layers: expected at least 1";
  if (o->model.num_heads_kv < 1) return "--num_heads_kv: expected at least 1";
  if (o->model.num_heads_q < 1 || o->model.num_heads_q % o->model.num_heads_kv != 0 ||
      o->model.num_heads_q / o->model.num_heads_kv > kernels::kMaxHeadsPerKvHead) {
    return absl::StrCat("--num_heads_q: expected a positive multiple of --num_heads_kv with at most ",
                        kernels::kMaxHeadsPerKvHead, " query heads per KV head");
  }
  if (o->model.softmax_scale < 0 || !std::isfinite(o->model.softmax_scale)) {
    return "--softmax_scale: expected a finite value >= 0";
  }
  if (o->model.softmax_scale == 0) o->model.softmax_scale = 1.f / std::sqrt(float{kernels::kHeadDimQK});
  o->device = absl::GetFlag(FLAGS_device);
  o->kv_pages = absl::GetFlag(FLAGS_kv_pages);
  o->kv_bytes = absl::GetFlag(FLAGS_kv_bytes);
  o->kv_memory_fraction = absl::GetFlag(FLAGS_kv_memory_fraction);
  if (o->kv_pages < 0 || o->kv_bytes < 0 || o->kv_memory_fraction < 0 || o->kv_memory_fraction > 1) {
    return "--kv_pages/--kv_bytes/--kv_memory_fraction: expected non-negative values (fraction at most 1)";
  }
  if (o->kv_pages == 0 && o->kv_bytes == 0 && o->kv_memory_fraction == 0) {
    const bool gpu = o->backend == engine::BackendKind::kCuda ||
                     (o->backend == engine::BackendKind::kAuto && GpuDevicePresent());
    if (gpu) {
      o->kv_memory_fraction = 0.8;
    } else {
      o->kv_bytes = int64_t{1} << 30;
    }
  }
  o->max_batch_size = absl::GetFlag(FLAGS_max_batch_size);
  if (o->max_batch_size == 0) {
    const bool gpu = o->backend == engine::BackendKind::kCuda ||
                     (o->backend == engine::BackendKind::kAuto && GpuDevicePresent());
    const int threads = absl::GetFlag(FLAGS_cpu_threads) > 0
                            ? absl::GetFlag(FLAGS_cpu_threads)
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    o->max_batch_size = gpu ? 64 : 2 * threads;
  }
  o->max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  o->max_queue = absl::GetFlag(FLAGS_max_queue);
  o->completion_threads = absl::GetFlag(FLAGS_completion_threads);
  o->max_sequences = absl::GetFlag(FLAGS_max_sequences);
  if (o->max_sequences < 0) return "--max_sequences: expected >= 0 (0: no limit)";
  o->host_kv_bytes = absl::GetFlag(FLAGS_host_kv_bytes);
  if (o->host_kv_bytes < 0) return "--host_kv_bytes: expected >= 0 (0: no host tier)";
  if (absl::GetFlag(FLAGS_offload_idle_s) < 0) return "--offload_idle_s: expected >= 0 (0: under pressure only)";
  if (absl::GetFlag(FLAGS_offload_idle_s) > 0 && o->host_kv_bytes == 0)
    return "--offload_idle_s: needs --host_kv_bytes (a host tier to move sequences to)";
  o->batch_window = absl::Microseconds(absl::GetFlag(FLAGS_batch_window_us));
  o->idle_spin = absl::Microseconds(absl::GetFlag(FLAGS_engine_spin_us));
  if (absl::GetFlag(FLAGS_engine_spin_us) < 0 || absl::GetFlag(FLAGS_engine_spin_us) > 1000000)
    return "--engine_spin_us: expected 0 to 1000000 microseconds";
  o->max_s_q = absl::GetFlag(FLAGS_max_s_q);
  o->cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  if (o->max_batch_size < 1) return "--max_batch_size: expected at least 1";
  if (o->max_queue < 1) return "--max_queue: expected at least 1";
  if (o->completion_threads < 0 || o->completion_threads > 64) return "--completion_threads: expected 0..64";
  if (o->max_s_q < 1) return "--max_s_q: expected at least 1";
  if (o->max_batch_tokens < o->max_s_q) return "--max_batch_tokens: expected at least --max_s_q";
  if (absl::GetFlag(FLAGS_batch_window_us) < 0) return "--batch_window_us: expected >= 0";
  return "";
}

int Run() {
  const std::string level_name = absl::AsciiStrToLower(absl::GetFlag(FLAGS_log_level));
  const auto level = spdlog::level::from_str(level_name);
  if (level == spdlog::level::off && level_name != "off") {
    return Fail("--log_level: '" + level_name + "'; expected trace, debug, info, warn, error or off");
  }
  spdlog::set_level(level);

  engine::EngineOptions eo;
  std::string model_preset;
  if (std::string err = ApplyModelPreset(&model_preset); !err.empty()) return Fail(err);
  if (std::string err = BuildEngineOptions(&eo); !err.empty()) return Fail(err);
  std::string model_dir;
  if (std::string err = ApplyModelDir(&eo, &model_dir); !err.empty()) return Fail(err);
  if (!model_dir.empty()) model_preset = model_dir;
  const int64_t max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message_bytes < 1024 || max_message_bytes > (int64_t{1} << 31) - 1) {
    return Fail("--max_message_bytes: expected 1024 to 2^31-1");
  }
  const std::string cert_path = absl::GetFlag(FLAGS_tls_cert);
  const std::string key_path = absl::GetFlag(FLAGS_tls_key);
  if (cert_path.empty() != key_path.empty()) return Fail("--tls_cert and --tls_key: expected both or neither");
  const int max_health_watchers = absl::GetFlag(FLAGS_max_health_watchers);
  if (max_health_watchers < 0) return Fail("--max_health_watchers: expected >= 0");
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (!metrics_listen.empty()) {
    if (absl::Status st = ValidateMetricsListen(metrics_listen); !st.ok()) return Fail(std::string(st.message()));
  }
  TokenSources token_sources;
  token_sources.file_path = absl::GetFlag(FLAGS_auth_token_file);
  if (const char* env = std::getenv(kAuthTokenEnv); env != nullptr) token_sources.env = env;
  token_sources.flag = absl::GetFlag(FLAGS_auth_token);
  auto token = ResolveAuthToken(token_sources);
  if (!token.ok()) return Fail(std::string(token.status().message()));
  if (token->source == "--auth_token") {
    spdlog::warn("--auth_token: the token is visible in ps to every local user; prefer --auth_token_file or ${}",
                 kAuthTokenEnv);
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!cert_path.empty()) {
    grpc::SslServerCredentialsOptions ssl;
    grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
    if (!ReadFile(cert_path, &pair.cert_chain)) return Fail("--tls_cert: cannot read " + cert_path);
    if (!ReadFile(key_path, &pair.private_key)) return Fail("--tls_key: cannot read " + key_path);
    ssl.pem_key_cert_pairs.push_back(std::move(pair));
    creds = grpc::SslServerCredentials(ssl);
  }

  auto created = engine::Engine::Create(eo);
  if (!created.ok()) return Fail(absl::StrCat("engine: ", created.status().ToString()));
  std::unique_ptr<engine::Engine> engine = std::move(*created);
  eo.layer_weights.reset();  // the engine's layer math holds them in its own form now
  const engine::EngineInfo info = engine->Info();

  ServiceOptions so;
  so.auth_token = token->token;
  so.tensor_parallel = absl::GetFlag(FLAGS_tensor_parallel);
  so.tensor_rank = absl::GetFlag(FLAGS_tensor_rank);
  so.max_s_q = eo.max_s_q;
  so.max_message_bytes = max_message_bytes;
  so.max_stream_inflight = absl::GetFlag(FLAGS_max_stream_inflight);
  so.max_steps_per_message = absl::GetFlag(FLAGS_max_steps_per_message);
  so.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  so.max_streams = absl::GetFlag(FLAGS_max_streams);
  so.max_upload_bytes = absl::GetFlag(FLAGS_max_upload_bytes);
  if (so.max_stream_inflight < 1) return Fail("--max_stream_inflight: expected at least 1");
  if (so.max_steps_per_message < 1) return Fail("--max_steps_per_message: expected at least 1");
  if (so.max_inflight_bytes < (int64_t{1} << 20)) return Fail("--max_inflight_bytes: expected at least 1 MiB");
  if (so.max_streams < 1) return Fail("--max_streams: expected at least 1");
  if (so.max_upload_bytes < 1) return Fail("--max_upload_bytes: expected at least 1");
  so.max_export_streams = absl::GetFlag(FLAGS_max_export_streams);
  so.max_import_streams = absl::GetFlag(FLAGS_max_import_streams);
  so.max_transfer_chunk_bytes = absl::GetFlag(FLAGS_max_transfer_chunk_bytes);
  if (so.max_export_streams < 0) return Fail("--max_export_streams: expected >= 0 (0: no exports)");
  if (so.max_import_streams < 0) return Fail("--max_import_streams: expected >= 0 (0: no imports)");
  if (so.max_transfer_chunk_bytes < (int64_t{64} << 10))
    return Fail("--max_transfer_chunk_bytes: expected at least 64 KiB");
  // A chunk travels in one message beside its framing.
  so.max_transfer_chunk_bytes = std::min<int64_t>(so.max_transfer_chunk_bytes, max_message_bytes - 4096);
  so.transfer_chunk_bytes = std::min<int64_t>(so.transfer_chunk_bytes, so.max_transfer_chunk_bytes);
  if (absl::GetFlag(FLAGS_drain_handoff_s) < 0) return Fail("--drain_handoff_s: expected >= 0");
  if (absl::GetFlag(FLAGS_import_stall_timeout_s) < 0) return Fail("--import_stall_timeout_s: expected >= 0");
  so.max_response_bytes = absl::GetFlag(FLAGS_max_response_bytes);
  const std::string pinned = absl::GetFlag(FLAGS_pinned_step_inputs);
  if (pinned == "auto") {
    so.pinned_step_inputs = ServiceOptions::PinnedInputs::kAuto;
  } else if (pinned == "off") {
    so.pinned_step_inputs = ServiceOptions::PinnedInputs::kOff;
  } else if (pinned == "always") {
    so.pinned_step_inputs = ServiceOptions::PinnedInputs::kAlways;
  } else {
    return Fail("--pinned_step_inputs: expected auto, off or always, got '" + pinned + "'");
  }
  if (so.max_response_bytes < 1) return Fail("--max_response_bytes: expected at least 1");
  so.max_region_bytes = absl::GetFlag(FLAGS_max_region_bytes);
  so.max_region_total_bytes = absl::GetFlag(FLAGS_max_region_total_bytes);
  if (so.max_region_bytes < 0) return Fail("--max_region_bytes: expected >= 0 (0: no shared regions)");
  if (so.max_region_total_bytes < 0) return Fail("--max_region_total_bytes: expected >= 0");
  so.max_rings = absl::GetFlag(FLAGS_max_rings);
  so.ring_spin_us = absl::GetFlag(FLAGS_ring_spin_us);
  if (so.max_rings < 0) return Fail("--max_rings: expected >= 0 (0: no doorbell rings)");
  const int rings_per_connection = absl::GetFlag(FLAGS_max_rings_per_connection);
  if (rings_per_connection < 1 || rings_per_connection > 4096)
    return Fail("--max_rings_per_connection: expected 1 to 4096");
  so.max_rings_per_connection = std::min(rings_per_connection, so.max_rings);
  if (so.ring_spin_us < 0 || so.ring_spin_us > 1000000)
    return Fail("--ring_spin_us: expected 0 to 1000000 microseconds");
  const int max_streams_per_connection = absl::GetFlag(FLAGS_max_streams_per_connection);
  if (max_streams_per_connection < 1) return Fail("--max_streams_per_connection: expected at least 1");
  const int64_t grpc_memory_bytes = absl::GetFlag(FLAGS_grpc_memory_bytes);
  if (grpc_memory_bytes < (int64_t{64} << 20)) return Fail("--grpc_memory_bytes: expected at least 64 MiB");
  so.version = kVersion;
  // Regions go only to their stream's client (dataplane::FdHandoff), and the daemon is
  // made non-dumpable, so that no other non-root process of its user can take them
  // from /proc/<pid>/fd (or read its memory: /proc/<pid>/mem, process_vm_readv, ptrace).
  // It also means no core dumps (unless fs.suid_dumpable is 2) and that a debugger or
  // profiler must attach as root.
  std::unique_ptr<dataplane::FdHandoff> handoff;
  if (!absl::GetFlag(FLAGS_data_plane_proc_paths)) {
    std::string name = absl::GetFlag(FLAGS_data_plane_socket);
    if (name.empty()) {
      // Random too: abstract names are per network namespace, pids per pid namespace, so
      // two daemons in containers sharing a network would otherwise meet.
      uint32_t salt = 0;
      if (getrandom(&salt, sizeof(salt), 0) != sizeof(salt)) return Fail("getrandom failed");
      name = absl::StrCat("@latentd-", getpid(), "-", absl::Hex(salt, absl::kZeroPad8));
    }
    absl::StatusOr<std::unique_ptr<dataplane::FdHandoff>> made = dataplane::FdHandoff::Listen(name);
    if (!made.ok()) return Fail(absl::StrCat("--data_plane_socket: ", made.status().message()));
    handoff = *std::move(made);
    so.handoff = handoff.get();
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) return Fail("cannot make the daemon non-dumpable (prctl)");
  }
  DecodeServiceImpl service(engine.get(), so);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  builder.AddListeningPort(listen, creds, &port);
  // gRPC sets SO_REUSEPORT by default, which would let a second daemon silently share
  // the port with a running one; a taken port must fail the start instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, max_streams_per_connection);
  grpc::ResourceQuota quota("latentd");
  quota.Resize(static_cast<size_t>(grpc_memory_bytes));
  builder.SetResourceQuota(quota);
  builder.SetMaxSendMessageSize(-1);
  builder.RegisterService(&service);
  // Guards what DecodeService cannot (reflection) and bounds health Watch streams; see
  // server/auth.h for why an interceptor and how it refuses calls.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<GateInterceptorFactory>(GateOptions{so.auth_token, max_health_watchers}));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) return Fail("--listen: cannot serve on " + listen);
  // Probes may ask for the whole server ("") or for the service by name.
  server->GetHealthCheckService()->SetServingStatus(latentd::v1::DecodeService::service_full_name(), true);

  const bool unix_socket = absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:");
  const std::string host = unix_socket ? listen : listen.substr(0, listen.rfind(':'));
  const std::string address = unix_socket ? listen : absl::StrCat(host, ":", port);
  const int64_t page_bytes = info.kv_bytes_per_token * kernels::kPageSize;
  spdlog::info(
      "latentd {} serving on {} | backend {} device {} | model {} layers {} h_q {} h_kv {} {} scale {:.6g} | "
      "KV pool {} pages of 64 tokens ({:.2f} GiB), kv dtype {}, {} bytes per token | max_batch {} | tls {} | auth {}",
      kVersion, address, info.backend, eo.device, model_preset, info.model.num_layers, info.model.num_heads_q,
      info.model.num_heads_kv, kernels::DTypeName(info.model.dtype), info.model.softmax_scale, info.total_pages,
      static_cast<double>(info.total_pages * page_bytes) / (1 << 30),
      kernels::KvDTypeName(info.kv_dtype, info.model.dtype), info.kv_bytes_per_token, info.max_batch_size,
      cert_path.empty() ? "off" : "on", so.auth_token.empty() ? "off" : "on (" + token->source + ")");
  if (!so.auth_token.empty() && cert_path.empty()) {
    spdlog::warn(
        "auth token set without TLS (--tls_cert/--tls_key): the token crosses the network in clear text unless "
        "the listen address is loopback ({} is {})",
        listen, IsLoopback(host) ? "loopback" : "NOT loopback");
  }
  // Up before the port file appears, so whoever waits for it can scrape at once.
  std::unique_ptr<MetricsExporter> metrics;
  if (!metrics_listen.empty()) {
    auto started = MetricsExporter::Start(metrics_listen, engine.get(), &service, kVersion);
    if (!started.ok()) return Fail(std::string(started.status().message()));
    metrics = std::move(*started);
    spdlog::info("Prometheus metrics on http://{}/metrics", metrics->address());
  }
  if (const std::string pf = absl::GetFlag(FLAGS_port_file); !pf.empty()) {
    // Written to a temporary name and renamed so a reader never sees a partial file.
    const std::string tmp = pf + ".tmp";
    std::ofstream(tmp) << port << "\n";
    std::rename(tmp.c_str(), pf.c_str());
  }
  // Under a Type=notify systemd unit, start-up is complete once the port is bound.
  if (std::string err = NotifySystemd(absl::StrCat("READY=1\nSTATUS=serving on ", address)); !err.empty()) {
    spdlog::warn("{}", err);
  }

  // Housekeeping thread: the idle-sequence TTL (a client that vanished leaks nothing for
  // longer than this) and a periodic stats line.
  absl::Notification stop_housekeeping;
  const int64_t ttl_s = absl::GetFlag(FLAGS_sequence_ttl_s);
  const int64_t stats_s = absl::GetFlag(FLAGS_stats_interval_s);
  const int64_t stall_s = absl::GetFlag(FLAGS_stream_stall_timeout_s);
  const int64_t import_stall_s = absl::GetFlag(FLAGS_import_stall_timeout_s);
  const int64_t offload_idle_s = absl::GetFlag(FLAGS_offload_idle_s);
  std::thread housekeeping([&] {
    pthread_setname_np(pthread_self(), "latentd-house");
    const absl::Duration ttl = absl::Seconds(ttl_s);
    const absl::Duration stall = absl::Seconds(stall_s);
    // Fine enough for short test timeouts, rare enough not to contend with the scheduler.
    absl::Duration period = absl::Seconds(1);
    if (ttl_s > 0) period = std::min(period, std::clamp(ttl / 8, absl::Milliseconds(100), absl::Seconds(1)));
    const absl::Duration offload_idle = absl::Seconds(offload_idle_s);
    if (offload_idle_s > 0)
      period = std::min(period, std::clamp(offload_idle / 8, absl::Milliseconds(100), absl::Seconds(1)));
    if (stall_s > 0) period = std::min(period, std::clamp(stall / 8, absl::Milliseconds(100), absl::Seconds(1)));
    const absl::Duration import_stall = absl::Seconds(import_stall_s);
    if (import_stall_s > 0)
      period = std::min(period, std::clamp(import_stall / 8, absl::Milliseconds(100), absl::Seconds(1)));
    absl::Time next_stats = absl::Now() + absl::Seconds(stats_s);
    uint64_t last_steps = 0;
    while (!stop_housekeeping.WaitForNotificationWithTimeout(period)) {
      if (ttl_s > 0) {
        const int released = engine->ReleaseIdleSequences(ttl);
        if (released > 0) spdlog::info("released {} sequences idle for over {}s", released, ttl_s);
      }
      if (offload_idle_s > 0) {
        const int moved = engine->OffloadIdleSequences(offload_idle);
        if (moved > 0) spdlog::info("moved {} sequences idle for over {}s to the host tier", moved, offload_idle_s);
      }
      // Spare buffers of idle streams go back (a burst does not keep its memory).
      service.TrimIdleStreams();
      if (import_stall_s > 0) {
        const int cancelled = service.CancelStalledImports(import_stall);
        if (cancelled > 0) {
          spdlog::warn("cancelled {} ImportSequence streams whose client sent no chunk for {}s", cancelled,
                       import_stall_s);
        }
      }
      if (stall_s > 0) {
        const int cancelled = service.CancelStalledStreams(stall);
        if (cancelled > 0) {
          spdlog::warn("cancelled {} Decode streams whose client took no response for {}s", cancelled, stall_s);
        }
      }
      if (stats_s > 0 && absl::Now() >= next_stats) {
        next_stats = absl::Now() + absl::Seconds(stats_s);
        const engine::EngineMetrics m = engine->Metrics();
        if (m.steps_completed == last_steps) continue;  // quiet while idle
        last_steps = m.steps_completed;
        spdlog::info(
            "stats: {:.0f} steps/s, {} steps, {} batches | queue wait p50/p99 {:.0f}/{:.0f} us, exec p50/p99 "
            "{:.0f}/{:.0f} us | {} sequences, pages {} used {} free | rejected: queue {} pages {} invalid {} "
            "deadline {} cancelled {} | {} streams | auth failures {}",
            m.steps_per_second, m.steps_completed, m.batches, m.queue_wait_us_p50, m.queue_wait_us_p99,
            m.exec_us_p50, m.exec_us_p99, m.sequences, m.pages_used, m.pages_free, m.rejected_queue_full,
            m.rejected_out_of_pages, m.rejected_invalid, m.rejected_deadline, m.dropped_cancelled,
            service.OpenStreams(), AuthFailures());
      }
    }
  });

  // SIGTERM/SIGINT are blocked in every thread (see main) and taken here.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  int sig = 0;
  sigwait(&signals, &sig);

  const absl::Time drain_start = absl::Now();
  const engine::EngineMetrics before = engine->Metrics();
  const uint64_t undelivered_before = service.UndeliveredResults();
  spdlog::info("{} received: draining (health NOT_SERVING, new work UNAVAILABLE)", strsignal(sig));
  // A second signal means the operator will not wait for the drain: exit at once.
  absl::Notification drain_over;
  std::thread second_signal([&] {
    pthread_setname_np(pthread_self(), "latentd-signal");
    const timespec poll = {0, 100 * 1000 * 1000};
    while (!drain_over.HasBeenNotified()) {
      const int again = sigtimedwait(&signals, nullptr, &poll);
      if (again != SIGTERM && again != SIGINT) continue;
      spdlog::error("{} received during the drain: exiting now with code {}, accepted steps not waited for",
                    strsignal(again), 128 + again);
      spdlog::default_logger()->flush();
      std::fflush(nullptr);
      std::_Exit(128 + again);
    }
  });
  server->GetHealthCheckService()->SetServingStatus(false);
  NotifySystemd("STOPPING=1\nSTATUS=draining");
  service.BeginDrain();
  const absl::Duration drain_timeout = absl::Seconds(absl::GetFlag(FLAGS_drain_timeout_s));
  const bool drained = engine->Drain(drain_timeout);
  // Streams finish once their last results are written; give them what is left.
  const absl::Time streams_deadline = std::max(drain_start + drain_timeout, absl::Now() + absl::Seconds(2));
  while (drained && service.OpenStreams() > 0 && absl::Now() < streams_deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  // The handoff: clients that saw the drain export their sequences to other daemons
  // (and release them here). It ends when no sequence is left, when exports have been
  // idle for --drain_handoff_s, or --drain_timeout_s from now at the latest.
  const absl::Duration handoff_idle = absl::Seconds(absl::GetFlag(FLAGS_drain_handoff_s));
  if (drained && handoff_idle > absl::ZeroDuration()) {
    const absl::Time handoff_start = absl::Now();
    absl::Time last_export = handoff_start;
    uint64_t started = service.ExportsStarted();
    int64_t left = engine->Metrics().sequences;
    while (left > 0 && absl::Now() < handoff_start + drain_timeout) {
      const uint64_t now_started = service.ExportsStarted();
      if (now_started != started || service.OpenExports() > 0) last_export = absl::Now();
      started = now_started;
      if (absl::Now() - last_export > handoff_idle) break;
      absl::SleepFor(absl::Milliseconds(20));
      left = engine->Metrics().sequences;
    }
    spdlog::info("handoff: {} sequences left after {:.3f}s; {} exported since the signal", left,
                 absl::ToDoubleSeconds(absl::Now() - handoff_start),
                 engine->Metrics().sequences_exported - before.sequences_exported);
  }
  if (drained) {
    server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    stop_housekeeping.Notify();
    housekeeping.join();
  }
  // What became of the steps accepted before the drain ended: completed steps whose
  // result reached no client, steps dropped unlaunched because their client went away,
  // and (on a timeout) steps still queued were not delivered.
  const engine::EngineMetrics m = engine->Metrics();
  const uint64_t completed = m.steps_completed - before.steps_completed;
  const uint64_t undeliverable = service.UndeliveredResults() - undelivered_before;
  const uint64_t dropped = m.dropped_cancelled - before.dropped_cancelled;
  const uint64_t queued = drained ? 0 : static_cast<uint64_t>(std::max<int64_t>(0, m.queued_steps));
  const uint64_t delivered = completed > undeliverable ? completed - undeliverable : 0;
  const uint64_t not_delivered = undeliverable + dropped + queued;
  const int exit_code = drained && not_delivered == 0 ? 0 : 1;
  drain_over.Notify();
  second_signal.join();
  const std::string summary = absl::StrCat(
      m.steps_completed, " steps completed in total; since the signal ", delivered, " accepted steps delivered, ",
      not_delivered, " not delivered (", undeliverable, " results whose client was gone, ", dropped,
      " dropped unlaunched as their client went away, ", queued, " still queued); exit code ", exit_code);
  if (!drained) {
    // Steps still inside the engine reference stream buffers; stopping the server now
    // would wait on them forever.
    spdlog::error("drain timed out after {}s: {}", absl::GetFlag(FLAGS_drain_timeout_s), summary);
    spdlog::default_logger()->flush();
    std::fflush(nullptr);
    std::_Exit(exit_code);
  }
  spdlog::log(exit_code == 0 ? spdlog::level::info : spdlog::level::warn, "drained in {:.3f}s: {}",
              absl::ToDoubleSeconds(absl::Now() - drain_start), summary);
  if (metrics != nullptr) metrics->Stop();  // it reads the service and the engine
  server.reset();
  engine.reset();
  return exit_code;
}

}  // namespace
}  // namespace latentd::server

int main(int argc, char** argv) {
  // Block the shutdown signals before any thread starts so that only sigwait sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // OpenBLAS's workers predate this mask; started again, they take it.
  latentd::engine::layer::RestartBlasThreads();

  spdlog::set_default_logger(spdlog::stderr_color_mt("latentd"));
  spdlog::set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ %v");
  absl::SetProgramUsageMessage(
      "MLA decode attention over gRPC (latentd.v1.DecodeService).\n"
      "  latentd [--model=NAME [--tensor_parallel=N]] [--flagfile=FILE] [--flag=value ...]\n"
      "  --help lists the daemon's flags, --helpfull every library's too, --version the version.");
  // absl's --help lists the flags of a file named after the program (latentd.cc); the
  // daemon's are in server/main.cc. --version prints kVersion and exits 0.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) { return absl::EndsWith(file, "server/main.cc"); };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  usage.version_string = [] { return absl::StrCat("latentd ", latentd::server::kVersion, "\n"); };
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);
  latentd::server::SetLockOrderChecks(absl::GetFlag(FLAGS_lock_order_checks));
  return latentd::server::Run();
}
