// Hand-written reading of DecodeRequest/AppendKvRequest and writing of StepResult, with
// the same field numbers as proto/latentd.proto. Unknown fields are skipped, not kept
// (protobuf would keep them: a message of tiny unknown fields grows ~8x in memory).
#include "proto/wire.h"

#include <algorithm>
#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace latentd::wire {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;

constexpr int kVarint = WireFormatLite::WIRETYPE_VARINT;
constexpr int kLen = WireFormatLite::WIRETYPE_LENGTH_DELIMITED;

// DecodeRequest / DecodeStep / StepResult / AppendKvRequest field numbers.
constexpr int kRequestSteps = 1;
constexpr int kStepRequestId = 1, kStepSequenceId = 2, kStepLayer = 3, kStepQ = 4, kStepKv = 5, kStepCausal = 6,
              kStepTimeoutMs = 7, kStepTrace = 8, kStepRegion = 9, kStepHidden = 10, kStepPosition = 11;
constexpr int kRequestOpenRegion = 2, kResponseRegion = 2, kRegionPath = 1, kRegionBytes = 2,
              kRegionRingBytes = 3, kRegionHandoffSocket = 4, kRegionTicket = 5;
constexpr int kRequestRingEntries = 4;
constexpr int kRequestOpenCudaRegion = 3, kCudaHandle = 1, kCudaOffset = 2, kCudaBytes = 3;
constexpr int kResultRequestId = 1, kResultOut = 2, kResultLse = 3, kResultCode = 4, kResultMessage = 5,
              kResultTiming = 6;
constexpr int kAppendSequenceId = 1, kAppendLayer = 2, kAppendKv = 3, kAppendHidden = 4;

absl::Status Malformed(const CodedInputStream& in, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": malformed protobuf at byte ", in.CurrentPosition(), "; expected a serialized ", what));
}

// Reads a length-delimited field into *dst when it fits in `bound` bytes, else skips it.
// *size gets its length on the wire either way.
bool ReadBoundedBytes(CodedInputStream* in, int64_t bound, std::string* dst, int64_t* size) {
  uint32_t len = 0;
  if (!in->ReadVarint32(&len) || len > static_cast<uint32_t>(INT_MAX)) return false;
  *size = len;
  if (static_cast<int64_t>(len) > bound) {
    dst->clear();
    return in->Skip(static_cast<int>(len));
  }
  return in->ReadString(dst, static_cast<int>(len));
}

// As ReadBoundedBytes, but into `raw` (cap bytes) when the field fits there; *in_raw says
// where it went (the string is cleared then).
bool ReadBoundedBytesTo(CodedInputStream* in, int64_t bound, char* raw, int64_t cap, std::string* dst,
                        int64_t* size, bool* in_raw) {
  *in_raw = false;
  if (raw == nullptr) return ReadBoundedBytes(in, bound, dst, size);
  uint32_t len = 0;
  if (!in->ReadVarint32(&len) || len > static_cast<uint32_t>(INT_MAX)) return false;
  *size = len;
  dst->clear();
  if (static_cast<int64_t>(len) > bound) return in->Skip(static_cast<int>(len));
  if (static_cast<int64_t>(len) > cap) return in->ReadString(dst, static_cast<int>(len));
  *in_raw = true;
  return in->ReadRaw(raw, static_cast<int>(len));
}

// Reads fields until the current limit; false when the bytes are malformed.
template <typename OnField>
bool ReadFields(CodedInputStream* in, OnField on_field) {
  for (;;) {
    const uint32_t tag = in->ReadTag();
    if (tag == 0) return in->ConsumedEntireMessage();
    const int field = WireFormatLite::GetTagFieldNumber(tag);
    const int type = WireFormatLite::GetTagWireType(tag);
    bool handled = false;
    if (!on_field(field, type, &handled)) return false;
    if (!handled && !WireFormatLite::SkipField(in, tag)) return false;
  }
}

bool ReadStep(CodedInputStream* in, const StepBounds& b, StepFields* out) {
  out->request_id = 0;
  out->layer = 0;
  out->causal = false;
  out->timeout_ms = 0;
  out->trace = false;
  out->has_region = false;
  out->region_s_q = 0;
  out->q_offset = out->kv_offset = out->out_offset = out->lse_offset = 0;
  out->sequence_id_bytes = out->q_bytes = out->kv_bytes = 0;
  out->sequence_id->clear();
  out->q->clear();
  out->kv->clear();
  out->q_raw = out->kv_raw = false;
  out->has_hidden = out->region_layer_step = out->has_position = false;
  out->hidden_bytes = 0;
  out->hidden_offset = 0;
  out->position = 0;
  return ReadFields(in, [&](int field, int type, bool* handled) {
    uint64_t v = 0;
    if (type == kVarint && field == kStepPosition) {
      *handled = true;
      if (!in->ReadVarint64(&v)) return false;
      out->has_position = true;
      out->position = static_cast<int64_t>(v);
      return true;
    }
    if (type == kLen && field == kStepHidden) {
      // Into q's place: a layer step has no q (validation refuses both).
      *handled = true;
      out->has_hidden = true;
      int64_t q_bytes = out->q_bytes;
      const bool ok = ReadBoundedBytesTo(in, std::max(b.max_q_bytes, b.max_hidden_bytes), out->q_dst, out->q_cap,
                                         out->q, &out->hidden_bytes, &out->q_raw);
      out->q_bytes = q_bytes;
      return ok;
    }
    if (type == kVarint && (field == kStepRequestId || field == kStepLayer || field == kStepCausal ||
                            field == kStepTimeoutMs || field == kStepTrace)) {
      *handled = true;
      if (!in->ReadVarint64(&v)) return false;
      if (field == kStepRequestId) out->request_id = v;
      if (field == kStepLayer) out->layer = static_cast<int32_t>(v);  // protobuf's int32 truncation
      if (field == kStepCausal) out->causal = v != 0;
      if (field == kStepTimeoutMs) out->timeout_ms = static_cast<uint32_t>(v);
      if (field == kStepTrace) out->trace = v != 0;
      return true;
    }
    if (type == kLen && field == kStepRegion) {
      *handled = true;
      uint32_t len = 0;
      if (!in->ReadVarint32(&len) || len > static_cast<uint32_t>(INT_MAX)) return false;
      const CodedInputStream::Limit limit = in->PushLimit(static_cast<int>(len));
      out->has_region = true;
      const bool ok = ReadFields(in, [&](int f, int t, bool* h) {
        if (t != kVarint || f < 1 || f > 8) return true;
        *h = true;
        uint64_t x = 0;
        if (!in->ReadVarint64(&x)) return false;
        if (f == 6) out->region_layer_step = x != 0;
        if (f == 7) out->hidden_offset = x;
        if (f == 8) {
          out->has_position = true;
          out->position = static_cast<int64_t>(x);
        }
        if (f == 1) out->region_s_q = x > UINT32_MAX ? UINT32_MAX : static_cast<uint32_t>(x);
        if (f == 2) out->q_offset = x;
        if (f == 3) out->kv_offset = x;
        if (f == 4) out->out_offset = x;
        if (f == 5) out->lse_offset = x;
        return true;
      });
      in->PopLimit(limit);
      return ok;
    }
    if (type == kLen && (field == kStepSequenceId || field == kStepQ || field == kStepKv)) {
      *handled = true;
      if (field == kStepSequenceId) return ReadBoundedBytes(in, b.max_id_bytes, out->sequence_id, &out->sequence_id_bytes);
      if (field == kStepQ)
        return ReadBoundedBytesTo(in, b.max_q_bytes, out->q_dst, out->q_cap, out->q, &out->q_bytes, &out->q_raw);
      return ReadBoundedBytesTo(in, b.max_kv_bytes, out->kv_dst, out->kv_cap, out->kv, &out->kv_bytes, &out->kv_raw);
    }
    return true;
  });
}

void Prepare(CodedInputStream* in) {
  // gRPC already bounds the message size; protobuf's default 64 MiB cap must not cut it.
  in->SetTotalBytesLimit(INT_MAX);
}

uint8_t* WriteBytesField(int field, const std::string* s, uint8_t* p) {
  if (s == nullptr || s->empty()) return p;
  p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED), p);
  return CodedOutputStream::WriteStringWithSizeToArray(*s, p);
}

size_t BytesFieldSize(const std::string* s) {
  if (s == nullptr || s->empty()) return 0;
  return 1 + CodedOutputStream::VarintSize32(static_cast<uint32_t>(s->size())) + s->size();
}

// The StepTiming fields in order, every one written as sfixed64 (so the size is fixed).
void TimingFields(const Timing& t, int64_t (&v)[8]) {
  const int64_t f[8] = {t.received_us, t.parsed_us,   t.submitted_us, t.batched_us,
                        t.launched_us, t.finished_us, t.completed_us, t.response_us};
  for (int i = 0; i < 8; ++i) v[i] = f[i];
}

constexpr size_t kTimingBody = 8 * (1 + 8);

uint8_t* EncodeTiming(const Timing& t, uint8_t* p) {
  p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(kResultTiming, WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
                                         p);
  p = CodedOutputStream::WriteVarint32ToArray(static_cast<uint32_t>(kTimingBody), p);
  int64_t v[8];
  TimingFields(t, v);
  for (int i = 0; i < 8; ++i) {
    p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(i + 1, WireFormatLite::WIRETYPE_FIXED64), p);
    p = CodedOutputStream::WriteLittleEndian64ToArray(static_cast<uint64_t>(v[i]), p);
  }
  return p;
}

size_t TimingFieldSize() { return 1 + CodedOutputStream::VarintSize32(static_cast<uint32_t>(kTimingBody)) + kTimingBody; }

size_t BytesSize(size_t n) { return n == 0 ? 0 : 1 + CodedOutputStream::VarintSize32(static_cast<uint32_t>(n)) + n; }

size_t ResultBodySize(const ResultView& r) {
  size_t n = 0;
  if (r.timing != nullptr) n += TimingFieldSize();
  if (r.request_id != 0) n += 1 + CodedOutputStream::VarintSize64(r.request_id);
  n += BytesFieldSize(r.out) + BytesFieldSize(r.lse) + BytesFieldSize(r.message);
  if (r.code != 0) n += 1 + CodedOutputStream::VarintSize64(static_cast<uint64_t>(static_cast<int64_t>(r.code)));
  return n;
}

}  // namespace

// The fields of one CudaRegion message (the stream is limited to it).
bool ReadCudaRegion(CodedInputStream* in, CudaRegionFields* out) {
  return ReadFields(in, [&](int field, int type, bool* handled) {
    if (field == kCudaHandle && type == kLen) {
      *handled = true;
      return ReadBoundedBytes(in, CudaRegionFields::kMaxIpcHandleBytes, &out->handle, &out->handle_bytes);
    }
    if ((field == kCudaOffset || field == kCudaBytes) && type == kVarint) {
      *handled = true;
      return in->ReadVarint64(field == kCudaOffset ? &out->offset : &out->bytes);
    }
    return true;
  });
}

absl::StatusOr<int> CountDecodeSteps(google::protobuf::io::ZeroCopyInputStream* stream, int limit,
                                     uint64_t* open_region_bytes, CudaRegionFields* cuda_region,
                                     uint64_t* region_ring_entries) {
  CodedInputStream in(stream);
  Prepare(&in);
  int count = 0;
  if (open_region_bytes != nullptr) *open_region_bytes = 0;
  if (cuda_region != nullptr) *cuda_region = CudaRegionFields();
  if (region_ring_entries != nullptr) *region_ring_entries = 0;
  const bool ok = ReadFields(&in, [&](int field, int type, bool* handled) {
    if (field == kRequestOpenCudaRegion && type == kLen) {
      *handled = true;
      uint32_t len = 0;
      if (!in.ReadVarint32(&len) || len > static_cast<uint32_t>(INT_MAX)) return false;
      if (cuda_region == nullptr) return in.Skip(static_cast<int>(len));
      const CodedInputStream::Limit lim = in.PushLimit(static_cast<int>(len));
      cuda_region->present = true;
      if (!ReadCudaRegion(&in, cuda_region) || !in.ConsumedEntireMessage()) return false;
      in.PopLimit(lim);
      return true;
    }
    if (field == kRequestRingEntries && type == kVarint) {
      *handled = true;
      uint64_t v = 0;
      if (!in.ReadVarint64(&v)) return false;
      if (region_ring_entries != nullptr) *region_ring_entries = v;
      return true;
    }
    if (field == kRequestOpenRegion && type == kVarint) {
      *handled = true;
      uint64_t v = 0;
      if (!in.ReadVarint64(&v)) return false;
      if (open_region_bytes != nullptr) *open_region_bytes = v;
      return true;
    }
    if (field != kRequestSteps || type != kLen) return true;
    *handled = true;
    uint32_t len = 0;
    if (!in.ReadVarint32(&len) || len > static_cast<uint32_t>(INT_MAX)) return false;
    ++count;
    if (count > limit) return false;  // stop early; reported below
    return in.Skip(static_cast<int>(len));
  });
  if (count > limit) return count;
  if (!ok) return Malformed(in, "DecodeRequest");
  return count;
}

absl::StatusOr<bool> DecodeStepReader::Next(const StepBounds& bounds, StepFields* out) {
  // A fresh CodedInputStream per step hands back unread bytes to in_ when it goes away.
  CodedInputStream in(in_);
  Prepare(&in);
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) {
      if (in.ConsumedEntireMessage()) return false;
      return Malformed(in, "DecodeRequest");
    }
    if (WireFormatLite::GetTagFieldNumber(tag) != kRequestSteps || WireFormatLite::GetTagWireType(tag) != kLen) {
      if (!WireFormatLite::SkipField(&in, tag)) return Malformed(in, "DecodeRequest");
      continue;
    }
    uint32_t len = 0;
    if (!in.ReadVarint32(&len) || len > static_cast<uint32_t>(INT_MAX)) return Malformed(in, "DecodeRequest");
    const CodedInputStream::Limit limit = in.PushLimit(static_cast<int>(len));
    if (!ReadStep(&in, bounds, out)) return Malformed(in, "DecodeStep");
    in.PopLimit(limit);
    return true;
  }
}

absl::Status ReadAppendKvRequest(google::protobuf::io::ZeroCopyInputStream* stream, int64_t max_id_bytes,
                                 AppendFields* out) {
  CodedInputStream in(stream);
  Prepare(&in);
  out->layer = 0;
  out->sequence_id_bytes = 0;
  out->sequence_id->clear();
  out->kv->clear();
  out->hidden_bytes = 0;
  if (out->hidden != nullptr) out->hidden->clear();
  const bool ok = ReadFields(&in, [&](int field, int type, bool* handled) {
    if (type == kLen && field == kAppendHidden && out->hidden != nullptr) {
      *handled = true;
      return ReadBoundedBytes(&in, INT_MAX, out->hidden, &out->hidden_bytes);
    }
    if (type == kVarint && field == kAppendLayer) {
      *handled = true;
      uint64_t v = 0;
      if (!in.ReadVarint64(&v)) return false;
      out->layer = static_cast<int32_t>(v);
      return true;
    }
    if (type == kLen && field == kAppendSequenceId) {
      *handled = true;
      return ReadBoundedBytes(&in, max_id_bytes, out->sequence_id, &out->sequence_id_bytes);
    }
    if (type == kLen && field == kAppendKv) {
      *handled = true;
      int64_t size = 0;
      return ReadBoundedBytes(&in, INT_MAX, out->kv, &size);
    }
    return true;
  });
  if (!ok) return Malformed(in, "AppendKvRequest");
  return absl::OkStatus();
}

std::string EncodeRegionResponse(const std::string& path, uint64_t bytes, uint64_t ring_bytes,
                                 const std::string& handoff_socket, const std::string& ticket) {
  size_t body = 1 + CodedOutputStream::VarintSize32(static_cast<uint32_t>(path.size())) + path.size() + 1 +
                CodedOutputStream::VarintSize64(bytes);
  if (ring_bytes != 0) body += 1 + CodedOutputStream::VarintSize64(ring_bytes);
  for (const std::string* f : {&handoff_socket, &ticket}) {
    if (!f->empty()) body += 1 + CodedOutputStream::VarintSize32(static_cast<uint32_t>(f->size())) + f->size();
  }
  std::string out(1 + CodedOutputStream::VarintSize32(static_cast<uint32_t>(body)) + body, '\0');
  uint8_t* p = reinterpret_cast<uint8_t*>(&out[0]);
  p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(kResponseRegion, WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
                                         p);
  p = CodedOutputStream::WriteVarint32ToArray(static_cast<uint32_t>(body), p);
  p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(kRegionPath, WireFormatLite::WIRETYPE_LENGTH_DELIMITED), p);
  p = CodedOutputStream::WriteStringWithSizeToArray(path, p);
  p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(kRegionBytes, WireFormatLite::WIRETYPE_VARINT), p);
  p = CodedOutputStream::WriteVarint64ToArray(bytes, p);
  if (ring_bytes != 0) {
    p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(kRegionRingBytes, WireFormatLite::WIRETYPE_VARINT), p);
    p = CodedOutputStream::WriteVarint64ToArray(ring_bytes, p);
  }
  const std::pair<int, const std::string*> strings[] = {{kRegionHandoffSocket, &handoff_socket},
                                                        {kRegionTicket, &ticket}};
  for (const auto& [field, value] : strings) {
    if (value->empty()) continue;
    p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(field, WireFormatLite::WIRETYPE_LENGTH_DELIMITED), p);
    p = CodedOutputStream::WriteStringWithSizeToArray(*value, p);
  }
  return out;
}

// A success result's body: request_id, out, lse (code 0 and no message are omitted),
// timing; the same order EncodeResult writes.
size_t SuccessBodySize(uint64_t request_id, size_t out_bytes, size_t lse_bytes, bool timing) {
  size_t n = 0;
  if (request_id != 0) n += 1 + CodedOutputStream::VarintSize64(request_id);
  n += BytesSize(out_bytes) + BytesSize(lse_bytes);
  if (timing) n += TimingFieldSize();
  return n;
}

ResultLayout SuccessLayout(uint64_t request_id, size_t out_bytes, size_t lse_bytes, bool timing) {
  const size_t body = SuccessBodySize(request_id, out_bytes, lse_bytes, timing);
  ResultLayout l;
  l.bytes = 1 + CodedOutputStream::VarintSize32(static_cast<uint32_t>(body)) + body;
  l.out_at = l.bytes - body;
  if (request_id != 0) l.out_at += 1 + CodedOutputStream::VarintSize64(request_id);
  if (out_bytes != 0) l.out_at += 1 + CodedOutputStream::VarintSize32(static_cast<uint32_t>(out_bytes));
  l.tail_at = l.out_at + out_bytes;
  return l;
}

void EncodeSuccessHead(uint64_t request_id, size_t out_bytes, size_t lse_bytes, bool timing, uint8_t* p) {
  const size_t body = SuccessBodySize(request_id, out_bytes, lse_bytes, timing);
  p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(kRequestSteps, WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
                                         p);
  p = CodedOutputStream::WriteVarint32ToArray(static_cast<uint32_t>(body), p);
  if (request_id != 0) {
    p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(kResultRequestId, WireFormatLite::WIRETYPE_VARINT), p);
    p = CodedOutputStream::WriteVarint64ToArray(request_id, p);
  }
  if (out_bytes != 0) {
    p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(kResultOut, WireFormatLite::WIRETYPE_LENGTH_DELIMITED), p);
    CodedOutputStream::WriteVarint32ToArray(static_cast<uint32_t>(out_bytes), p);
  }
}

void EncodeSuccessTail(const std::string& lse, const Timing* timing, uint8_t* p) {
  p = WriteBytesField(kResultLse, &lse, p);
  if (timing != nullptr) EncodeTiming(*timing, p);
}

size_t EncodedResultSize(const ResultView& r) {
  const size_t body = ResultBodySize(r);
  return 1 + CodedOutputStream::VarintSize32(static_cast<uint32_t>(body)) + body;
}

uint8_t* EncodeResult(const ResultView& r, uint8_t* p) {
  p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(kRequestSteps, WireFormatLite::WIRETYPE_LENGTH_DELIMITED),
                                         p);
  p = CodedOutputStream::WriteVarint32ToArray(static_cast<uint32_t>(ResultBodySize(r)), p);
  if (r.request_id != 0) {
    p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(kResultRequestId, WireFormatLite::WIRETYPE_VARINT), p);
    p = CodedOutputStream::WriteVarint64ToArray(r.request_id, p);
  }
  p = WriteBytesField(kResultOut, r.out, p);
  p = WriteBytesField(kResultLse, r.lse, p);
  if (r.code != 0) {
    p = CodedOutputStream::WriteTagToArray(WireFormatLite::MakeTag(kResultCode, WireFormatLite::WIRETYPE_VARINT), p);
    p = CodedOutputStream::WriteVarint64ToArray(static_cast<uint64_t>(static_cast<int64_t>(r.code)), p);
  }
  p = WriteBytesField(kResultMessage, r.message, p);
  if (r.timing != nullptr) p = EncodeTiming(*r.timing, p);
  return p;
}

}  // namespace latentd::wire
