// cosyserve::int8_rows: the LM's dynamic int8 Linear (Int8DynamicLinear) as one op, for
// CPUs with AVX-512 VNNI. Compiled at run time by cosyserve.models.native_int8, which
// loads it only where the CPU has the instructions it is built for.
//
// Every row of x gets fbgemm's bits: it is divided by its largest magnitude, quantized on
// the grid (input_scale, zero_point) as fbgemm quantizes (fma(x, 1/scale, zero point),
// rounded to nearest even, clamped to uint8), multiplied by the int8 weights in exact
// int32 sums, and scaled back as fbgemm and torch do: (sum - zero_point * column sum) *
// multiplier, times the row's magnitude, plus the bias in one rounding (torch's addcmul).
//
// Weights are packed by pack_int8_rows in VNNI order: for each block of 16 output rows,
// for each group of 4 inputs, the 16 rows' 4 bytes (64 bytes, one register). A block's
// bytes are contiguous, so one row of x streams every weight once, in order, with one
// multiply-add per 64 bytes and no sums across a register.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kLanes = 16;      // output rows per block (int32 lanes of a register)
constexpr int64_t kGroup = 4;       // inputs per lane per multiply-add
constexpr int kMaxTileRows = 12;    // rows of x per tile, one accumulator each
constexpr int64_t kPrefetchBytes = 2048;

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

struct Problem {
  const uint8_t* q;       // (rows, groups * 4) quantized rows
  const int8_t* weight;   // (blocks, groups, 16, 4)
  const int32_t* col_offsets;  // (blocks * 16,)
  const float* multipliers;    // (blocks * 16,)
  const float* bias;           // (blocks * 16,) or nullptr
  const float* row_scales;     // (rows,)
  int64_t groups;
  int64_t outs;
  int32_t zero_point;
  float* out;  // (rows, outs)
};

// Rows m0..m0+MB of x against one block of 16 output rows: the block's weights stream
// once, each 64 bytes multiplied with every row's 4 inputs broadcast to all lanes.
template <int MB>
inline void tile(const Problem& p, int64_t m0, int64_t block) {
  __m512i acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_si512();
  const int8_t* w = p.weight + block * p.groups * kLanes * kGroup;
  const int64_t ldq = p.groups * kGroup;
  const uint8_t* q = p.q + m0 * ldq;
  for (int64_t g = 0; g < p.groups; ++g) {
    // 2 KiB ahead: no change for one row, 8 rows 15-17 % faster (their multiply-adds
    // outlast the hardware prefetcher's lead). A prefetch past the end never faults.
    _mm_prefetch(reinterpret_cast<const char*>(w + g * kLanes * kGroup + kPrefetchBytes), _MM_HINT_T0);
    const __m512i wv = _mm512_loadu_si512(w + g * kLanes * kGroup);
    for (int m = 0; m < MB; ++m) {
      int32_t four;
      std::memcpy(&four, q + m * ldq + g * kGroup, sizeof(four));
      acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_set1_epi32(four), wv);
    }
  }
  const int64_t n0 = block * kLanes;
  const int64_t valid = std::min<int64_t>(kLanes, p.outs - n0);
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set1_epi32(p.zero_point), _mm512_loadu_si512(p.col_offsets + n0));
  const __m512 multipliers = _mm512_loadu_ps(p.multipliers + n0);
  for (int m = 0; m < MB; ++m) {
    const __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m], offsets)), multipliers);
    const __m512 scale = _mm512_set1_ps(p.row_scales[m0 + m]);
    const __m512 result = p.bias ? _mm512_fmadd_ps(y, scale, _mm512_loadu_ps(p.bias + n0)) : _mm512_mul_ps(y, scale);
    _mm512_mask_storeu_ps(p.out + (m0 + m) * p.outs + n0, mask, result);
  }
}

inline void tile_rows(int rows, const Problem& p, int64_t m0, int64_t block) {
  switch (rows) {
    case 1: tile<1>(p, m0, block); break;
    case 2: tile<2>(p, m0, block); break;
    case 3: tile<3>(p, m0, block); break;
    case 4: tile<4>(p, m0, block); break;
    case 5: tile<5>(p, m0, block); break;
    case 6: tile<6>(p, m0, block); break;
    case 7: tile<7>(p, m0, block); break;
    case 8: tile<8>(p, m0, block); break;
    case 9: tile<9>(p, m0, block); break;
    case 10: tile<10>(p, m0, block); break;
    case 11: tile<11>(p, m0, block); break;
    default: tile<12>(p, m0, block); break;
  }
}

// Row x divided by its largest magnitude and quantized into q (the padding past
// in_features stays zero). Returns the magnitude, at least 1e-30 (NaN propagates).
float quantize_row(const float* x, int64_t in_features, float inverse, float zero_point, uint8_t* q) {
  float largest = 0.0f;
  for (int64_t k = 0; k < in_features; ++k) {
    const float a = std::fabs(x[k]);
    largest = (std::isnan(a) || a > largest) ? a : largest;
  }
  const float scale = std::isnan(largest) ? largest : std::max(largest, 1e-30f);
  for (int64_t k = 0; k < in_features; ++k) {
    const float v = std::nearbyint(std::fma(x[k] / scale, inverse, zero_point));
    q[k] = static_cast<uint8_t>(std::isnan(v) ? 0.0f : std::min(255.0f, std::max(0.0f, v)));
  }
  return scale;
}

void check_vector(const at::Tensor& t, at::ScalarType dtype, int64_t size, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 1 && t.numel() == size && t.is_contiguous(), name,
              " must be a contiguous vector of the packed weight's padded outputs");
}

at::Tensor int8_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& col_offsets,
                     const at::Tensor& multipliers, const std::optional<at::Tensor>& bias, int64_t outs,
                     double input_scale, int64_t zero_point) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (M, in) float32");
  TORCH_CHECK(weight.dim() == 4 && weight.scalar_type() == at::kChar && weight.is_contiguous() &&
                  weight.size(2) == kLanes && weight.size(3) == kGroup,
              "weight must come from pack_int8_rows");
  const int64_t rows = x.size(0), in_features = x.size(1);
  const int64_t blocks = weight.size(0), groups = weight.size(1);
  TORCH_CHECK(groups == (in_features + kGroup - 1) / kGroup, "x's width does not match the weight's");
  TORCH_CHECK(outs > blocks * kLanes - kLanes && outs <= blocks * kLanes, "outs does not match the weight");
  check_vector(col_offsets, at::kInt, blocks * kLanes, "col_offsets");
  check_vector(multipliers, at::kFloat, blocks * kLanes, "multipliers");
  if (bias) check_vector(*bias, at::kFloat, blocks * kLanes, "bias");
  const at::Tensor xc = x.contiguous();
  at::Tensor q = at::zeros({rows, groups * kGroup}, x.options().dtype(at::kByte));
  at::Tensor scales = at::empty({rows}, x.options());
  at::Tensor out = at::empty({rows, outs}, x.options());
  const float inverse = 1.0f / static_cast<float>(input_scale);
  const float* xp = xc.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      sp[m] = quantize_row(xp + m * in_features, in_features, inverse, static_cast<float>(zero_point),
                           qp + m * groups * kGroup);
  });
  const Problem p{qp, weight.data_ptr<int8_t>(), col_offsets.data_ptr<int32_t>(), multipliers.data_ptr<float>(),
                  bias ? bias->data_ptr<float>() : nullptr, sp, groups, outs, static_cast<int32_t>(zero_point),
                  out.data_ptr<float>()};
  // Each thread streams a contiguous run of blocks.
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxTileRows) {
        tile_rows(static_cast<int>(std::min<int64_t>(kMaxTileRows, rows - m0)), p, m0, block);
      }
    }
  });
  return out;
}

// weight (out, in) int8 -> (blocks, groups, 16, 4) int8, zero-padded.
at::Tensor pack_int8_rows(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "weight must be (out, in) int8");
  const int64_t outs = weight.size(0), in_features = weight.size(1);
  const int64_t padded_outs = round_up(outs, kLanes), padded_in = round_up(in_features, kGroup);
  at::Tensor padded = at::zeros({padded_outs, padded_in}, weight.options());
  padded.narrow(0, 0, outs).narrow(1, 0, in_features).copy_(weight);
  // (blocks, 16, groups, 4) -> (blocks, groups, 16, 4)
  return padded.view({padded_outs / kLanes, kLanes, padded_in / kGroup, kGroup}).transpose(1, 2).contiguous();
}

}  // namespace

TORCH_LIBRARY(cosyserve, m) {
  m.def("int8_rows(Tensor x, Tensor weight, Tensor col_offsets, Tensor multipliers, Tensor? bias, int outs, "
        "float input_scale, int zero_point) -> Tensor");
  m.def("pack_int8_rows(Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(cosyserve, CPU, m) {
  m.impl("int8_rows", &int8_rows);
  m.impl("pack_int8_rows", &pack_int8_rows);
}
