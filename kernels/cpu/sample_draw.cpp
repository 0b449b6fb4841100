// The sampled rows of a step: each row's temperature-scaled distribution, cut by its top-k,
// top-p and min-p, inverted at its uniform (float64, keyed by seed and position upstream).
// Reference: engine/sampling_draw.py draw() (the torch path), which this follows exactly but
// for float rounding: a row without a cut is inverted in vocabulary order, a cut row in order
// of falling probability over its kept tokens. tests/engine/test_sample_draw_kernel.py holds
// the two together.
//
// Why: the torch path made a float32 copy, a scaled copy, a softmax and a padded float64
// two-level search, five or six passes over [rows, vocab] that no longer fit in a cache once a
// step samples many rows: 42 ms of a 104-row decode step on SmolLM2's 49,152-token vocabulary,
// against about a third of that for the model's forward. Here a row is read twice (its maximum;
// its exponentials, kept in a per-thread buffer) and the search runs over block sums.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vector_math.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 256;  // entries per block of the search over an uncut row
// Nats below the row's most likely token within which a cut row's candidates are first looked
// for; each try that does not hold the kept set doubles it, and the last takes every token.
constexpr float kFirstSpan = 8.0f;
constexpr int kSpans = 3;  // 8, 16, 32 nats, then all
// A top-p row first orders only this many of its candidates: usually its kept set.
constexpr int64_t kHead = 64;
// Bins of a top-p row whose candidates are many (a flat distribution: thousands of tokens in
// its 95%). Sorting them all cost 3.7-4 ms a row (16 rows of SmolLM2's vocabulary, Gaussian
// logits, top_p 0.95, one thread: 59-65 ms against 0.64 ms uncut); binned by their depth below
// the top, only the bin where top-p's mass runs out and the one the draw falls in are sorted.
constexpr int64_t kBins = 4096;
// Candidates in a top-k row's first span past which its top-k set is found by bins of its
// exponentials (collect_top_k) rather than by an nth_element over them all.
constexpr int64_t kManyForTopK = 4096;

inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) {
  uint16_t half;
  std::memcpy(&half, &v, sizeof(half));
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
float row_max(const T* row, int64_t n) {
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, -std::numeric_limits<float>::infinity());
  const int64_t whole = n / kLanes * kLanes;
  for (int64_t i = 0; i < whole; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const float v = as_float(row[i + j]);
      lanes[j] = lanes[j] < v ? v : lanes[j];
    }
  }
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < kLanes; ++j) best = best < lanes[j] ? lanes[j] : best;
  for (int64_t i = whole; i < n; ++i) best = std::max(best, as_float(row[i]));
  return best;
}

// e[i] = exp(x[i] / temperature - top) for i in [begin, end) (a whole number of lanes, or the
// tail), zero where that is below -87 (masked tokens: -inf); returns their sum.
template <typename T>
double exponentials(const T* row, int64_t begin, int64_t end, float temperature, float top,
                    float* e) {
  float lanes[kLanes] = {};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const float d = as_float(row[i + j]) / temperature - top;
      const float v = d >= -87.0f ? splitserve_cpu::exp_nonpositive(d) : 0.0f;
      e[i + j] = v;
      lanes[j] += v;
    }
  }
  double sum = 0.0;
  for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
  for (; i < end; ++i) {
    const float d = as_float(row[i]) / temperature - top;
    e[i] = d >= -87.0f ? splitserve_cpu::exp_nonpositive(d) : 0.0f;
    sum += e[i];
  }
  return sum;
}

// An index with zero mass (the target rounded to or past the total) becomes the last entry
// with mass before it, or the first one after it if none is before (sampling_draw._kept).
int64_t with_mass(const float* e, int64_t n, int64_t at) {
  if (e[at] > 0.0f) return at;
  for (int64_t i = at; i >= 0; --i) {
    if (e[i] > 0.0f) return i;
  }
  for (int64_t i = at; i < n; ++i) {
    if (e[i] > 0.0f) return i;
  }
  return at;
}

// An uncut row: the first token whose cumulative mass passes u times the total, found block by
// block over the sums and then within one block.
int64_t invert_uncut(const float* e, const double* blocks, int64_t n, double u) {
  const int64_t count = (n + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < count; ++b) total += blocks[b];
  const double target = u * total;
  double ahead = 0.0;
  int64_t b = 0;
  while (b < count - 1 && ahead + blocks[b] <= target) ahead += blocks[b++];
  const int64_t end = std::min(n, (b + 1) * kBlock);
  int64_t at = end - 1;
  for (int64_t i = b * kBlock; i < end; ++i) {
    ahead += e[i];
    if (ahead > target) {
      at = i;
      break;
    }
  }
  return with_mass(e, n, at);
}

struct Candidate {
  float scaled;  // x / temperature
  int32_t index;
};

// Falling probability; equal ones by index (their order is free: sampling_draw's may differ).
inline bool before_in_order(const Candidate& a, const Candidate& b) {
  return a.scaled > b.scaled || (a.scaled == b.scaled && a.index < b.index);
}

// The tokens with mass e >= floor (all with any mass when floor is 0). Stops, returning false,
// once more than `limit` are found (0: no limit).
template <typename T>
bool collect(const T* row, const float* e, int64_t n, float temperature, float floor,
             std::vector<Candidate>& candidates, int64_t limit = 0) {
  candidates.clear();
  const float least = floor > 0.0f ? floor : std::numeric_limits<float>::denorm_min();
  const auto take = [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      if (e[j] >= least) candidates.push_back({as_float(row[j]) / temperature, static_cast<int32_t>(j)});
    }
  };
  const size_t most = limit > 0 ? static_cast<size_t>(limit) : std::numeric_limits<size_t>::max();
  constexpr int64_t kChunk = 4 * kLanes;
  const int64_t whole = n / kChunk * kChunk;
  for (int64_t i = 0; i < whole; i += kChunk) {
    int32_t hits = 0;  // most chunks hold none
    for (int64_t j = 0; j < kChunk; ++j) hits += e[i + j] >= least ? 1 : 0;
    if (hits) take(i, i + kChunk);
    if (candidates.size() > most) return false;
  }
  take(whole, n);
  return candidates.size() <= most;
}

// Scratch a thread reuses from row to row.
struct Scratch {
  std::vector<Candidate> candidates, binned;
  std::vector<int64_t> starts;  // kBins + 1 offsets into binned
  std::vector<int64_t> fill;    // the next free slot of each bin while filling binned
  std::vector<double> mass;     // each bin's probability
  std::vector<char> sorted;     // which bins of binned are sorted
  std::vector<int64_t> counts;  // collect_top_k's tokens per bin
};

// Sorts binned[starts[b], starts[b + 1]) in the draw's order (once: `sorted` remembers).
inline void sort_bin(Scratch& s, int64_t b) {
  if (!s.sorted[b]) {
    std::sort(s.binned.begin() + s.starts[b], s.binned.begin() + s.starts[b + 1], before_in_order);
    s.sorted[b] = 1;
  }
}

// A top-p or min-p row without a top-k over many candidates (all tokens with mass when `whole`), as
// invert_cut's ordered walk draws it, without ordering them all. Candidates go into bins by
// their depth below the top, (top - scaled) x a positive factor, truncated: a monotone map, so
// bin by bin, each sorted, is the order of falling probability, ties by index included. Top-p
// keeps a prefix of that order: whole bins while the mass before the bin and in it stays below
// top_p, then part of the bin where it runs out, sorted. Min-p drops a suffix of the order, so
// its tokens are left out of the bins first. The draw walks whole bins by their mass and sorts
// only the one it falls in. Returns the token, or -1 when every candidate was kept and the
// span may not hold the kept set (widen it). Sums run bin by bin, so a uniform on a rounded
// boundary may pick a neighbour of the ordered walk's token.
int64_t invert_top_p_binned(const float* e, double normaliser, float top, float top_p,
                            float min_p, bool whole, double u, Scratch& s) {
  std::vector<Candidate>& candidates = s.candidates;
  float deepest = top, top_e = 0.0f;
  for (const Candidate& c : candidates) {
    deepest = std::min(deepest, c.scaled);
    top_e = std::max(top_e, e[c.index]);
  }
  const double least = static_cast<double>(min_p) * (top_e / normaliser);  // min-p's floor
  const float depth = top - deepest;
  const float factor = depth > 0.0f ? static_cast<float>(kBins - 1) / depth : 0.0f;
  const auto bin_of = [&](const Candidate& c) {
    return std::min<int64_t>(kBins - 1, static_cast<int64_t>((top - c.scaled) * factor));
  };
  // Top-p 1 (a min-p row) keeps what min-p keeps, however the sums round.
  const double cut = top_p >= 1.0f ? std::numeric_limits<double>::infinity() : top_p;
  // Min-p's drops leave the candidates (the next span collects them afresh).
  const size_t collected = candidates.size();
  candidates.erase(std::remove_if(candidates.begin(), candidates.end(),
                                  [&](const Candidate& c) { return e[c.index] / normaliser < least; }),
                   candidates.end());
  bool dropped = candidates.size() < collected;  // the kept set ends among the candidates
  double kept_mass = 0.0;
  for (const Candidate& c : candidates) kept_mass += e[c.index] / normaliser;
  // Every candidate kept, short of the top-p mass: widen before binning (flat rows, at first).
  if (!whole && !dropped && kept_mass < cut) return -1;
  s.starts.assign(kBins + 1, 0);
  s.mass.assign(kBins, 0.0);
  for (const Candidate& c : candidates) {
    const int64_t b = bin_of(c);
    ++s.starts[b + 1];
    s.mass[b] += e[c.index] / normaliser;
  }
  for (int64_t b = 0; b < kBins; ++b) s.starts[b + 1] += s.starts[b];
  s.binned.resize(candidates.size());
  s.fill.assign(s.starts.begin(), s.starts.end() - 1);
  for (const Candidate& c : candidates) s.binned[s.fill[bin_of(c)]++] = c;
  s.sorted.assign(kBins, 0);
  double before = 0.0;
  int64_t edge = -1, kept_in_edge = 0, last = -1;
  for (int64_t b = 0; b < kBins; ++b) {
    if (s.starts[b] == s.starts[b + 1]) continue;
    if (edge >= 0) {  // a token after the kept set: top-p dropped it
      dropped = true;
      break;
    }
    last = b;
    if (before + s.mass[b] < cut) {
      before += s.mass[b];
      continue;
    }
    sort_bin(s, b);
    edge = b;
    for (int64_t j = s.starts[b]; j < s.starts[b + 1]; ++j) {
      if (!(before < cut)) {
        dropped = true;
        break;
      }
      before += e[s.binned[j].index] / normaliser;
      ++kept_in_edge;
    }
  }
  if (!whole && !dropped) return -1;
  const double target = u * before;
  double ahead = 0.0;
  for (int64_t b = 0; b <= last; ++b) {
    if (s.starts[b] == s.starts[b + 1]) continue;
    const int64_t end = b == edge ? s.starts[b] + kept_in_edge : s.starts[b + 1];
    if (b != edge && ahead + s.mass[b] <= target) {
      ahead += s.mass[b];
      continue;
    }
    sort_bin(s, b);
    for (int64_t j = s.starts[b]; j < end; ++j) {
      ahead += e[s.binned[j].index] / normaliser;
      if (ahead > target) return s.binned[j].index;
    }
  }
  // Rounding left the target past every kept token: the last of them.
  if (edge >= 0) return s.binned[s.starts[edge] + kept_in_edge - 1].index;
  sort_bin(s, last);
  return s.binned[s.starts[last + 1] - 1].index;
}

// A top-k row's candidates: its k most likely tokens, every token tied with the k-th, and a
// few more, found by counting tokens in bins of their exponential's float bits (for positive
// floats a monotone map, 64 bins an octave, no division or log) and taking the bins up to the
// one where the count reaches k, and the next (exp_nonpositive may round a hair out of order).
// A flat row has tens of thousands of tokens within the first span; collected and cut by an
// nth_element, they cost 0.5 ms a row (16 rows of N(0, 1) logits at temperature 0.7 and top_k
// 50: 7.8 ms, the torch path 2.0 ms).
template <typename T>
void collect_top_k(const T* row, const float* e, int64_t n, float temperature, int64_t k,
                   Scratch& s) {
  constexpr int kShift = 17;  // of the 23 mantissa bits, the top 6 stay: 64 bins an octave
  constexpr int64_t kOctaveBins = (int64_t{0x3F800000} >> kShift) + 1;  // 1.0 down to 0
  const auto bin_of = [](float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    return std::max<int64_t>(0, (int64_t{0x3F800000} - static_cast<int64_t>(bits)) >> kShift);
  };
  std::vector<int64_t>& counts = s.counts;
  counts.assign(kOctaveBins, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (e[i] > 0.0f) ++counts[bin_of(e[i])];
  }
  int64_t last = kOctaveBins - 1, seen = 0;
  for (int64_t b = 0; b < kOctaveBins; ++b) {
    seen += counts[b];
    if (seen >= k) {
      last = b + 1;
      break;
    }
  }
  s.candidates.clear();
  for (int64_t i = 0; i < n; ++i) {
    if (e[i] > 0.0f && bin_of(e[i]) <= last)
      s.candidates.push_back({as_float(row[i]) / temperature, static_cast<int32_t>(i)});
  }
}

// The mass of what min-p keeps among `count` tokens' exponentials, read through `at`: those
// with e >= min_p times the largest e among them.
template <typename At>
double min_p_mass(int64_t count, float min_p, At at) {
  float top_e = 0.0f;
  for (int64_t i = 0; i < count; ++i) top_e = std::max(top_e, at(i));
  const double floor = static_cast<double>(min_p) * top_e;
  double mass = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    if (static_cast<double>(at(i)) >= floor) mass += at(i);
  }
  return mass;
}

// A cut row. The candidates are the tokens within a span of nats below the top (or, with a
// min-p and no top-k, those min-p keeps: e >= min_p, the top token's e being 1), cut to
// top-k's set (with every token tied with the k-th); min-p against the top token, then top-p
// over them in order of falling probability on the mass min-p and top-k left, renormalised
// (vLLM's order); the draw inverts the kept tokens in that order. A span that may not hold
// the kept set (fewer tokens than the top-k; without a top-k or a min-p, its last token still
// kept by top-p) is widened, up to every token.
template <typename T>
int64_t invert_cut(const T* row, const float* e, int64_t n, double total, float temperature,
                   float top, int64_t top_k, float top_p, float min_p, double u,
                   Scratch& scratch) {
  std::vector<Candidate>& candidates = scratch.candidates;
  const bool limited = top_k > 0 && top_k < n;
  const float min_p_floor = min_p > 0.0f ? min_p * (1.0f - 1e-6f) : 0.0f;  // rounding's margin
  // Top-p's cut in units of the normaliser: top_p times the share min-p keeps of its mass.
  const bool both = top_p < 1.0f && min_p > 0.0f;
  float cut_p = top_p;
  if (both && !limited) {
    const double kept = min_p_mass(n, min_p, [e](int64_t i) { return e[i]; });
    cut_p = static_cast<float>(top_p * kept / total);
  }
  float span = kFirstSpan;
  for (int attempt = 0; attempt <= kSpans; ++attempt, span *= 2.0f) {
    const float span_floor = attempt == kSpans ? 0.0f : splitserve_cpu::exp_nonpositive(-span);
    // With a min-p, no token below its floor is kept: that floor bounds the candidates, unless
    // a top-k needs its whole set (its mass renormalises the kept tokens').
    const bool bounded_by_min_p = !limited && min_p_floor > 0.0f && min_p_floor >= span_floor;
    // A top-k row with many tokens in its first span (a flat row) is binned instead.
    bool binned_top_k = false;
    if (!collect(row, e, n, temperature, bounded_by_min_p ? min_p_floor : span_floor, candidates,
                 limited && attempt == 0 ? kManyForTopK : 0)) {
      collect_top_k(row, e, n, temperature, top_k, scratch);
      binned_top_k = true;
    }
    int64_t count = static_cast<int64_t>(candidates.size());
    // The kept set lies among them (a top-k's binned candidates hold its set, ties included).
    bool whole = binned_top_k || bounded_by_min_p || span_floor == 0.0f;
    if (limited && count < top_k && !whole) continue;  // the top-k set may reach past them
    if (count == 0) break;  // nothing has mass: the top token, below
    double normaliser = total;
    if (limited && count > top_k) {
      std::nth_element(candidates.begin(), candidates.begin() + (top_k - 1), candidates.end(),
                       before_in_order);
      const float kth = candidates[top_k - 1].scaled;
      const auto tail = std::partition(candidates.begin() + top_k, candidates.end(),
                                       [kth](const Candidate& c) { return c.scaled >= kth; });
      candidates.erase(tail, candidates.end());
      count = static_cast<int64_t>(candidates.size());
    }
    if (limited) {  // top-k renormalises over its set (all of them are candidates now)
      normaliser = 0.0;
      for (const Candidate& c : candidates) normaliser += e[c.index];
      whole = true;
      if (both) {
        const auto at = [&](int64_t i) { return e[candidates[i].index]; };
        cut_p = static_cast<float>(top_p * min_p_mass(count, min_p, at) / normaliser);
      }
    }
    if (!limited && (top_p < 1.0f || min_p > 0.0f) && count > 2 * kHead) {
      const int64_t drawn = invert_top_p_binned(e, normaliser, top, cut_p, min_p, whole, u,
                                                scratch);
      if (drawn >= 0) return drawn;
      // Every candidate kept: the tokens beyond may be too. Flat rows get here, and one more
      // pass over all tokens costs less than the spans between.
      attempt = kSpans - 1;
      continue;
    }
    // Order: at first only the head of the candidates, which is enough when top-p drops its
    // last token; else all of them.
    int64_t ordered = count;
    if (top_p < 1.0f && count > 2 * kHead) {
      ordered = kHead;
      std::partial_sort(candidates.begin(), candidates.begin() + kHead, candidates.end(),
                        before_in_order);
    } else {
      std::sort(candidates.begin(), candidates.end(), before_in_order);
    }
    for (int pass = 0; pass < 2; ++pass) {
      double before = 0.0, kept_total = 0.0;
      const double first = e[candidates[0].index] / normaliser;
      int64_t kept_end = 0;  // the kept tokens are a prefix of the order (both cuts are)
      for (int64_t j = 0; j < ordered; ++j) {
        const double p = e[candidates[j].index] / normaliser;
        const bool keep = p > 0.0 && (cut_p >= 1.0f || before < cut_p) &&
                          p >= static_cast<double>(min_p) * first;
        if (!keep) break;
        before += p;
        kept_total += p;
        kept_end = j + 1;
      }
      if (kept_end == ordered && ordered < count) {  // the head is all kept: order the rest
        std::sort(candidates.begin() + ordered, candidates.end(), before_in_order);
        ordered = count;
        continue;
      }
      // Whole: every token was a candidate, or a top-k or min-p bounds them, or top-p
      // dropped one: every token after it has less mass and more ahead of it.
      if (!whole && kept_end == count) break;  // widen the span
      if (kept_end == 0) return candidates[0].index;
      const double target = u * kept_total;
      double ahead = 0.0;
      for (int64_t j = 0; j < kept_end; ++j) {
        ahead += e[candidates[j].index] / normaliser;
        if (ahead > target) return candidates[j].index;
      }
      return candidates[kept_end - 1].index;
    }
  }
  // No token has mass (every logit -inf or NaN): the first maximum, as the argmax would pick.
  for (int64_t i = 0; i < n; ++i) {
    if (as_float(row[i]) / temperature == top) return i;
  }
  return 0;
}

template <typename T>
void draw_rows(const at::Tensor& logits, const int64_t* rows, int64_t count, const float* temps,
               const int64_t* top_ks, const float* top_ps, const float* min_ps,
               const double* uniforms, int64_t* out) {
  const auto* data = logits.data_ptr<T>();
  const int64_t n = logits.size(1), stride = logits.stride(0);
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(n);
    std::vector<double> blocks((n + kBlock - 1) / kBlock);
    Scratch scratch;
    for (int64_t r = begin; r < end; ++r) {
      const T* row = data + rows[r] * stride;
      const float temperature = temps[r];
      const float top = row_max(row, n) / temperature;
      double total = 0.0;
      for (int64_t b = 0; b < static_cast<int64_t>(blocks.size()); ++b) {
        blocks[b] = exponentials(row, b * kBlock, std::min(n, (b + 1) * kBlock), temperature,
                                 top, e.data());
        total += blocks[b];
      }
      const bool cut = top_ks[r] > 0 || top_ps[r] < 1.0f || min_ps[r] > 0.0f;
      if (!std::isfinite(top) || !(total > 0.0)) {
        // Every logit -inf (or a NaN): the cut path's fallback, the first maximum.
        out[r] = invert_cut(row, e.data(), n, total, temperature, top, 0, 1.0f, 0.0f, 0.0,
                            scratch);
      } else if (cut) {
        out[r] = invert_cut(row, e.data(), n, total, temperature, top, top_ks[r], top_ps[r],
                            min_ps[r], uniforms[r], scratch);
      } else {
        out[r] = invert_uncut(e.data(), blocks.data(), n, uniforms[r]);
      }
    }
  });
}

at::Tensor sample_draw(const at::Tensor& logits, const at::Tensor& rows,
                       const at::Tensor& temperatures, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p,
                       const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, vocab] with vocab > 0");
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat,
              "sample_draw takes bfloat16 or float32 logits");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "vocab too large for 32-bit indices");
  const int64_t count = rows.numel();
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be int64 [count]");
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat && temperatures.numel() == count &&
                  top_k.scalar_type() == at::kLong && top_k.numel() == count &&
                  top_p.scalar_type() == at::kFloat && top_p.numel() == count &&
                  min_p.scalar_type() == at::kFloat && min_p.numel() == count &&
                  uniforms.scalar_type() == at::kDouble && uniforms.numel() == count,
              "per-row settings: temperatures, top_p, min_p float32, top_k int64, uniforms "
              "float64, one per row");
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const at::Tensor r = rows.contiguous(), t = temperatures.contiguous(), k = top_k.contiguous();
  const at::Tensor p = top_p.contiguous(), m = min_p.contiguous(), u = uniforms.contiguous();
  const int64_t* row_ids = r.data_ptr<int64_t>();
  const float* temps = t.data_ptr<float>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < x.size(0), "row ", row_ids[i], " out of range");
    TORCH_CHECK(temps[i] > 0.0f, "a sampled row needs a temperature above 0, got ", temps[i]);
  }
  at::Tensor out = at::empty({count}, logits.options().dtype(at::kLong));
  if (count == 0) return out;
  AT_DISPATCH_SWITCH(x.scalar_type(), "sample_draw",
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        draw_rows<c10::BFloat16>(x, row_ids, count, temps, k.data_ptr<int64_t>(),
                                 p.data_ptr<float>(), m.data_ptr<float>(),
                                 u.data_ptr<double>(), out.data_ptr<int64_t>());
      })
      AT_DISPATCH_CASE(at::kFloat, [&] {
        draw_rows<float>(x, row_ids, count, temps, k.data_ptr<int64_t>(), p.data_ptr<float>(),
                         m.data_ptr<float>(), u.data_ptr<double>(), out.data_ptr<int64_t>());
      }));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("sample_draw(Tensor logits, Tensor rows, Tensor temperatures, Tensor top_k, "
        "Tensor top_p, Tensor min_p, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) { m.impl("sample_draw", &sample_draw); }
