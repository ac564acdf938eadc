// Shared helpers of the attention backends; see backend_common.h.
#include "engine/backend_common.h"

#include <algorithm>
#include <cstring>

#include "kernels/params.h"

namespace latentd::engine {

kv::KvCacheConfig PoolShape(const BackendOptions& o) {
  kv::KvCacheConfig c;
  c.num_layers = o.model.num_layers;
  c.num_heads_kv = o.model.num_heads_kv;
  c.bytes_per_value = kernels::DTypeBytes(o.model.dtype);
  c.kv_dtype = o.kv_dtype;
  c.dtype = o.model.dtype;
  return c;
}

int64_t PageBytes(const BackendOptions& o) { return PoolShape(o).page_bytes(); }

absl::StatusOr<int64_t> PoolPages(const BackendOptions& o, int64_t available_bytes) {
  const int64_t page = PageBytes(o);
  int64_t pages = 0;
  if (o.kv_pages > 0) {
    pages = o.kv_pages;
  } else if (o.kv_bytes > 0) {
    pages = o.kv_bytes / page;
  } else if (o.kv_memory_fraction > 0) {
    if (o.kv_memory_fraction > 1.0)
      return absl::InvalidArgumentError("kv_memory_fraction: expected a value in (0, 1]");
    pages = static_cast<int64_t>(o.kv_memory_fraction * static_cast<double>(available_bytes)) / page;
  }
  if (pages < 1)
    return absl::InvalidArgumentError("kv pool: expected at least one page of " + std::to_string(page) +
                                      " bytes from kv_pages, kv_bytes or kv_memory_fraction");
  // Physical page ids (layer * pages + page) are int32 in the kernel's block table.
  if (pages * o.model.num_layers > INT32_MAX)
    return absl::InvalidArgumentError("kv pool: num_layers * pages must stay below 2^31");
  return pages;
}

void GroupBatch(const Batch& batch, std::vector<int>* order, std::vector<LaunchGroup>* groups) {
  order->clear();
  groups->clear();
  for (int i = 0; i < static_cast<int>(batch.entries.size()); ++i)
    if (batch.entries[i].status.ok()) order->push_back(i);
  // s_q = 1 makes the causal flag irrelevant: normalise so those steps share a launch.
  auto key = [&](int i) {
    const DecodeStep* s = batch.entries[i].step;
    return std::make_pair(s->s_q, s->s_q > 1 && s->causal);
  };
  // Ties broken by index: the stable order without stable_sort's temporary buffer (the
  // hot path allocates nothing).
  std::sort(order->begin(), order->end(), [&](int a, int b) {
    const auto ka = key(a), kb = key(b);
    return ka != kb ? ka < kb : a < b;
  });
  int token = 0;
  for (int k = 0; k < static_cast<int>(order->size()); ++k) {
    const auto kk = key((*order)[k]);
    if (groups->empty() || groups->back().s_q != kk.first || groups->back().causal != kk.second) {
      LaunchGroup g;
      g.s_q = kk.first;
      g.causal = kk.second;
      g.first_entry = k;
      g.first_token = token;
      groups->push_back(g);
    }
    ++groups->back().num_entries;
    token += kk.first;
  }
}

int MaxTablePages(const Batch& batch) {
  int width = 1;
  for (const auto& e : batch.entries)
    if (e.status.ok()) width = std::max(width, e.table_pages);
  return width;
}

void WritePhysicalTable(const BatchEntry& e, int width, int32_t* row) {
  for (int j = 0; j < e.table_pages; ++j) row[j] = static_cast<int32_t>(e.table[j] + e.page_offset);
  std::fill(row + e.table_pages, row + width, 0);
}

kernels::MlaDecodeParams GroupShape(const ModelConfig& model, const kv::KvCacheConfig& kv, const LaunchGroup& g,
                                    int width) {
  kernels::MlaDecodeParams p;
  p.dtype = model.dtype;
  p.kv_dtype = kv.kv_dtype;
  p.batch = g.num_entries;
  p.s_q = g.s_q;
  p.h_q = model.num_heads_q;
  p.h_kv = model.num_heads_kv;
  p.num_pages = static_cast<int>(kv.physical_pages());
  p.max_pages_per_seq = width;
  p.softmax_scale = model.softmax_scale;
  p.causal = g.causal;
  p.p_rounding = model.p_rounding;
  kernels::SetContiguousStrides(&p);  // kv strides follow p.kv_dtype
  return p;
}

void CopyResults(Batch& batch, const std::vector<int>& order, int h_q, const char* out, const float* lse) {
  const size_t out_row = size_t(h_q) * kernels::kHeadDimV * 2;
  int token = 0;
  for (int k : order) {
    BatchEntry& e = batch.entries[k];
    const int s_q = e.step->s_q;
    if (e.status.ok() && !OutputsDeviceDirect(*e.step)) {  // else the device wrote them in place
      std::memcpy(e.step->out.host(), out + size_t(token) * out_row, size_t(s_q) * out_row);
      std::memcpy(e.step->lse.host(), lse + size_t(token) * h_q, size_t(s_q) * h_q * sizeof(float));
    }
    token += s_q;
  }
}

}  // namespace latentd::engine
