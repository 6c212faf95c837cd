// The kernels of cuda/ run on the CPU emulator (emulator.h) against scalar references: the
// experts' GEMM that reads the segment offsets on the device, the combine's ascending-expert
// order, greedy argmax with refused rows, paged attention (GQA and MLA, prefill and decode
// tiles, windows, sinks, split and not), the router (softmax top-k, bias, ties, capacity; every
// family's scoring: sigmoid, correction bias, groups, scale),
// segment offsets and permute, RMSNorm (residual and strided rows), RoPE and MLA's RoPE (both
// pairings), the KV and latent writes, the activations, the families' elementwise options, the
// embedding and the logits rows' gather. Built and run by
// scripts/emulate-kernels.sh over copies of the sources with `extern __shared__` made global.
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <tuple>
#include <functional>
#include <limits>
#include <string>

#include "emulator.h"
#include "common.cuh"
#include "moe_gemm.cu"
#include "moe_permute.cu"
#include "sampling.cu"
#include "paged_attention.cu"
#include "moe_router.cu"
#include "rmsnorm.cu"
#include "rope.cu"
#include "mla.cu"
#include "kv_cache.cu"
#include "swiglu.cu"
#include "elementwise.cu"
#include "embedding.cu"

static int failures = 0;

static void expect(bool ok, const std::string& what) {
    if (!ok) {
        std::printf("FAIL %s\n", what.c_str());
        ++failures;
    }
}

// Seeded values in [-scale, scale).
static std::vector<float> random(size_t n, uint64_t seed, float scale) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull | 1;
    std::vector<float> v(n);
    for (auto& x : v) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x = ((float)(s >> 40) / (float)(1ull << 24) * 2.0f - 1.0f) * scale;
    }
    return v;
}

template <typename T> T from(float v);
template <> float from<float>(float v) { return v; }
template <> __nv_bfloat16 from<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
static std::vector<T> rounded(std::vector<float>& v) {
    std::vector<T> t(v.size());
    for (size_t i = 0; i < v.size(); ++i) t[i] = from<T>(v[i]), v[i] = to_f32(t[i]);
    return t;
}

// Largest |got - want| relative to the largest |want|.
template <typename T>
static double rel_error(const std::vector<T>& got, const std::vector<float>& want) {
    double err = 0, norm = 1e-30;
    for (size_t i = 0; i < want.size(); ++i) {
        err = std::max(err, (double)std::fabs(to_f32(got[i]) - want[i]));
        norm = std::max(norm, (double)std::fabs(want[i]));
    }
    return err / norm;
}

template <typename T> static double tolerance();
template <> double tolerance<float>() { return 1e-5; }
template <> double tolerance<__nv_bfloat16>() { return 1e-2; }
template <typename T> static const char* name();
template <> const char* name<float>() { return "f32"; }
template <> const char* name<__nv_bfloat16>() { return "bf16"; }

template <typename T>
static void grouped_gemm() {
    const int rows_per_expert[] = {0, 1, MOE_GEMM_ROWS, MOE_GEMM_ROWS + 1, 40, 3};
    const int experts = 6;
    std::vector<int> offsets{0};
    for (int r : rows_per_expert) offsets.push_back(offsets.back() + r);
    const int rows = offsets.back();
    for (auto [n, k] : {std::pair{50, 64}, std::pair{24, 37}}) {
        auto xf = random((size_t)rows * k, 11 + k, 1.0f);
        auto x = rounded<T>(xf);
        std::vector<std::vector<float>> wf(experts);
        std::vector<std::vector<T>> w(experts);
        std::vector<unsigned long long> ptrs(experts);
        for (int e = 0; e < experts; ++e) {
            wf[e] = random((size_t)n * k, 100 + e, 0.5f);
            w[e] = rounded<T>(wf[e]);
            ptrs[e] = (unsigned long long)w[e].data();
        }
        std::vector<T> y((size_t)rows * n, from<T>(-7.0f));
        emu::launch({(unsigned)((n + 15) / 16), (unsigned)experts, 1}, {256, 1, 1}, [&] {
            moe_grouped_gemm<T>(x.data(), ptrs.data(), y.data(), offsets.data(), n, k);
        });
        std::vector<float> want((size_t)rows * n);
        for (int e = 0; e < experts; ++e)
            for (int r = offsets[e]; r < offsets[e + 1]; ++r)
                for (int j = 0; j < n; ++j) {
                    float s = 0;
                    for (int i = 0; i < k; ++i) s += xf[(size_t)r * k + i] * wf[e][(size_t)j * k + i];
                    want[(size_t)r * n + j] = s;
                }
        const double err = rel_error(y, want);
        for (size_t i = 0; i < want.size() && getenv("EMU_DEBUG"); ++i)
            if (std::fabs(to_f32(y[i]) - want[i]) > 1e-2) {
                std::printf("row %zu col %zu: got %f want %f\n", i / n, i % n, to_f32(y[i]), want[i]);
                break;
            }
        expect(err < tolerance<T>(), std::string("moe_grouped_gemm ") + name<T>() + " n " +
                                         std::to_string(n) + " k " + std::to_string(k) +
                                         ": error " + std::to_string(err));
    }
}

// Each token's pairs summed in ascending expert order, whatever order the router ranked them.
static void unpermute_order() {
    const int tokens = 3, top_k = 4, hidden = 40;
    const std::vector<int> ids = {5, 1, 7, 2, 0, 3, 6, 4, 2, 6, 1, 0};  // best first
    std::vector<float> weights = random(tokens * top_k, 3, 1.0f);
    // Segment e holds the pairs of expert e in token order.
    std::vector<int> counts(8, 0), slots(tokens * top_k);
    for (int p = 0; p < tokens * top_k; ++p) slots[p] = counts[ids[p]]++;
    std::vector<int> offsets{0};
    for (int c : counts) offsets.push_back(offsets.back() + c);
    auto expert_out = random((size_t)offsets.back() * hidden, 4, 100.0f);
    std::vector<float> out(tokens * hidden);
    emu::launch({tokens, 1, 1}, {32, 1, 1}, [&] {
        moe_unpermute<float>(expert_out.data(), ids.data(), weights.data(), slots.data(),
                             offsets.data(), out.data(), top_k, hidden, 1);
    });
    bool same = true;
    for (int t = 0; t < tokens; ++t) {
        std::vector<int> order = {0, 1, 2, 3};
        std::stable_sort(order.begin(), order.end(),
                         [&](int a, int b) { return ids[t * top_k + a] < ids[t * top_k + b]; });
        for (int i = 0; i < hidden; ++i) {
            float acc = 0;
            for (int j : order) {
                const int p = t * top_k + j;
                acc += weights[p] * expert_out[(size_t)(offsets[ids[p]] + slots[p]) * hidden + i];
            }
            same &= acc == out[t * hidden + i];
        }
    }
    expect(same, "moe_unpermute sums each token's pairs in ascending expert order, bit for bit");
}

static void greedy_argmax() {
    const int vocab = 3000, rows = 5;
    const float inf = std::numeric_limits<float>::infinity();
    auto logits = random((size_t)rows * vocab, 9, 5.0f);
    logits[0 * vocab + 1234] = 9.0f, logits[0 * vocab + 2000] = 9.0f;  // a tie: the lower id
    logits[1 * vocab + 17] = std::nanf("");
    logits[2 * vocab + 2999] = inf;
    for (int i = 0; i < vocab; ++i) logits[3 * vocab + i] = -inf;
    std::vector<int> ids(rows);
    std::vector<float> logprobs(rows);
    emu::launch({rows, 1, 1}, {1024, 1, 1}, [&] {
        argmax_logprob<float>(logits.data(), ids.data(), logprobs.data(), vocab);
    });
    expect(ids[0] == 1234, "argmax ties go to the lower id (" + std::to_string(ids[0]) + ")");
    expect(ids[1] == -1 && ids[2] == -1 && ids[3] == -1,
           "rows with NaN, +inf or only -inf are refused");
    int best = 0;
    double sum = 0;
    for (int i = 0; i < vocab; ++i)
        if (logits[4 * vocab + i] > logits[4 * vocab + best]) best = i;
    for (int i = 0; i < vocab; ++i) sum += std::exp((double)logits[4 * vocab + i] - logits[4 * vocab + best]);
    expect(ids[4] == best && std::fabs(logprobs[4] + std::log(sum)) < 1e-4,
           "argmax and its logprob");
}

// One step's tokens over a paged cache: sequences of `lengths` on shuffled blocks of 16.
struct AttentionCase {
    int heads, kv_heads, d, dv, window = 0;
    bool sinks = false, latent = false;
    std::vector<int> lengths;
    std::vector<std::pair<int, int>> tokens;  // (sequence, position)
};

template <typename T>
static void attention(const AttentionCase& c, int partition_len, const std::string& what) {
    const int bs = 16, max_blocks = 20, n = (int)c.tokens.size();
    const int num_blocks = (int)c.lengths.size() * max_blocks + 1;
    std::vector<int> table(c.lengths.size() * max_blocks);
    auto order = random(num_blocks, 77, 1.0f);
    std::vector<int> free(num_blocks - 1);
    for (int i = 0; i < num_blocks - 1; ++i) free[i] = i + 1;
    std::sort(free.begin(), free.end(), [&](int a, int b) { return order[a] < order[b]; });
    for (size_t s = 0, next = 0; s < c.lengths.size(); ++s)
        for (int b = 0; b < max_blocks; ++b) table[s * max_blocks + b] = free[next++];
    // Keys and values: GQA rows hold kv_heads × d keys and as many values; MLA's one latent row
    // (width d) is its key and its first dv elements its value.
    const int k_row = c.latent ? c.d : c.kv_heads * c.d, v_row = c.latent ? c.d : c.kv_heads * c.dv;
    auto kf = random((size_t)num_blocks * bs * k_row, 21, 1.0f);
    auto vf = c.latent ? kf : random((size_t)num_blocks * bs * v_row, 22, 1.0f);
    auto qf = random((size_t)n * c.heads * c.d, 20, 1.0f);
    auto k = rounded<T>(kf);
    auto v = c.latent ? k : rounded<T>(vf);
    if (c.latent) vf = kf;
    auto q = rounded<T>(qf);
    std::vector<float> sinks = random(c.heads, 23, 3.0f);
    sinks[0] = 12.0f;
    std::vector<int> seq(n), pos(n);
    for (int t = 0; t < n; ++t) seq[t] = c.tokens[t].first, pos[t] = c.tokens[t].second;
    // The host's tiles (ops::attention_tiles with ops::rows_per_block).
    const int group = c.heads / c.kv_heads, hb = std::min(group, MAX_ROWS);
    const int tq = std::max(1, MAX_ROWS / hb);
    std::vector<int> tiles;
    for (int t = 0; t < n;) {
        int end = t + 1;
        while (end < n && end - t < tq && seq[end] == seq[t]) ++end;
        tiles.push_back(t), tiles.push_back(end - t);
        t = end;
    }
    int context = 0;
    for (int p : pos) context = std::max(context, p + 1);
    const int parts = partition_len > 0 ? (context + partition_len - 1) / partition_len : 1;
    PagedAttentionParams p{c.heads, c.kv_heads, c.d, c.dv, k_row, v_row, bs, max_blocks,
                           c.window, 1.0f / std::sqrt((float)c.d), hb, parts,
                           partition_len > 0 ? partition_len : context};
    std::vector<float> partials((size_t)n * c.heads * parts * (c.dv + 2), std::nanf(""));
    std::vector<T> out((size_t)n * c.heads * c.dv, from<T>(-7.0f));
    const unsigned chunks = (group + hb - 1) / hb;
    emu::launch({(unsigned)tiles.size() / 2, (unsigned)c.kv_heads * chunks, (unsigned)parts},
                {128, 1, 1}, [&] {
                    paged_attention<T>(out.data(), partials.data(), q.data(), k.data(), v.data(),
                                       table.data(), seq.data(), pos.data(), tiles.data(),
                                       c.sinks ? sinks.data() : nullptr, p);
                });
    if (parts > 1)
        emu::launch({(unsigned)n, (unsigned)c.heads, 1}, {128, 1, 1}, [&] {
            paged_attention_reduce<T>(out.data(), partials.data(), c.sinks ? sinks.data() : nullptr,
                                      c.heads, parts, c.dv);
        });
    std::vector<float> want((size_t)n * c.heads * c.dv, 0.0f);
    for (int t = 0; t < n; ++t)
        for (int h = 0; h < c.heads; ++h) {
            const int g = h / group, first = c.window ? std::max(0, pos[t] + 1 - c.window) : 0;
            std::vector<double> scores;
            std::vector<size_t> rows;
            for (int j = first; j <= pos[t]; ++j) {
                const size_t slot = (size_t)table[seq[t] * max_blocks + j / bs] * bs + j % bs;
                double s = 0;
                for (int i = 0; i < c.d; ++i)
                    s += qf[((size_t)t * c.heads + h) * c.d + i] *
                         kf[slot * k_row + (c.latent ? 0 : g * c.d) + i];
                scores.push_back(s * p.scale);
                rows.push_back(slot);
            }
            double m = c.sinks ? sinks[h] : -1e300, sum = 0;
            for (double s : scores) m = std::max(m, s);
            for (double& s : scores) sum += (s = std::exp(s - m));
            if (c.sinks) sum += std::exp(sinks[h] - m);
            for (size_t j = 0; j < rows.size(); ++j)
                for (int i = 0; i < c.dv; ++i)
                    want[((size_t)t * c.heads + h) * c.dv + i] +=
                        (float)(scores[j] / sum * vf[rows[j] * v_row + (c.latent ? 0 : g * c.dv) + i]);
        }
    const double err = rel_error(out, want);
    expect(err < tolerance<T>(), "paged_attention " + std::string(name<T>()) + " " + what +
                                     " partitions " + std::to_string(parts) + ": error " +
                                     std::to_string(err));
}

template <typename T>
static void attention_cases() {
    AttentionCase gqa{8, 2, 32, 32};
    // A decode at 300, a prefill of the last 6 of 40, a whole prompt of 5.
    gqa.lengths = {300, 40, 5};
    gqa.tokens = {{0, 299}};
    for (int p = 34; p < 40; ++p) gqa.tokens.push_back({1, p});
    for (int p = 0; p < 5; ++p) gqa.tokens.push_back({2, p});
    for (int split : {0, 128, 64}) attention<T>(gqa, split, "GQA 8/2");
    AttentionCase windowed = gqa;
    windowed.window = 100;
    windowed.sinks = true;
    for (int split : {0, 128}) attention<T>(windowed, split, "GQA window 100, sinks");
    AttentionCase mha = gqa;
    mha.heads = mha.kv_heads = 2;  // a tile of 8 tokens per block
    attention<T>(mha, 0, "MHA");
    AttentionCase mla{16, 1, 40, 32};
    mla.latent = true;
    mla.lengths = gqa.lengths;
    mla.tokens = gqa.tokens;
    for (int split : {0, 128}) attention<T>(mla, split, "MLA 16 heads");
    AttentionCase single{4, 4, 16, 16};
    single.lengths = {1};
    single.tokens = {{0, 0}};
    attention<T>(single, 0, "context 1");
}

// The router against the CPU's softmax top-k (ties to the lower expert), then the segment
// offsets and permute over its choices; with a capacity, each expert's slots are 0..count in
// some arrival order and those past the capacity are dropped with the weights renormalised.
static void router_and_permute() {
    for (auto [tokens, experts, top_k, capacity] :
         {std::tuple{37, 8, 2, 0}, std::tuple{21, 60, 6, 0}, std::tuple{40, 8, 2, 7}}) {
        auto logits = random((size_t)tokens * experts, 5 + experts, 2.0f);
        logits[3 * experts + 1] = logits[3 * experts + 4] = 9.0f;  // a tie
        auto bias = random(experts, 6, 0.5f);
        std::vector<int> ids(tokens * top_k), slots(tokens * top_k), counts(experts, 0);
        std::vector<float> weights(tokens * top_k);
        emu::launch({(unsigned)(tokens + 3) / 4, 1, 1}, {128, 1, 1}, [&] {
            route_top_k<float>(logits.data(), bias.data(), nullptr, ids.data(), weights.data(),
                               slots.data(), counts.data(), tokens, experts, top_k, capacity, 1,
                               0, 1, 1, 1.0f);
        });
        bool same = true;
        std::vector<std::vector<int>> seen(experts);
        for (int t = 0; t < tokens; ++t) {
            std::vector<double> prob(experts);
            double m = -1e300, sum = 0;
            for (int e = 0; e < experts; ++e)
                m = std::max(m, prob[e] = logits[t * experts + e] + bias[e]);
            for (auto& p : prob) sum += (p = std::exp(p - m));
            std::vector<int> order(experts);
            for (int e = 0; e < experts; ++e) order[e] = e;
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return prob[a] > prob[b]; });
            double kept = 0;
            for (int j = 0; j < top_k; ++j) {
                same &= ids[t * top_k + j] == order[j];
                const int slot = slots[t * top_k + j];
                seen[order[j]].push_back(slot);
                if (slot >= 0) kept += prob[order[j]] / sum;
            }
            for (int j = 0; j < top_k; ++j) {
                const double want = slots[t * top_k + j] >= 0 ? prob[order[j]] / sum / kept : 0.0;
                same &= std::fabs(weights[t * top_k + j] - want) < 1e-5;
            }
        }
        for (int e = 0; e < experts; ++e) {
            same &= counts[e] == (int)seen[e].size();
            std::vector<int> got = seen[e], want;
            std::sort(got.begin(), got.end());
            for (int i = 0; i < counts[e]; ++i) want.push_back(capacity && i >= capacity ? -1 : i);
            std::sort(want.begin(), want.end());
            same &= got == want;
        }
        const std::string what = "router " + std::to_string(tokens) + " tokens, " +
                                 std::to_string(experts) + " experts, top " + std::to_string(top_k) +
                                 ", capacity " + std::to_string(capacity);
        expect(same, what);
        // Offsets and permute: every kept pair's row holds its token's activations.
        const int hidden = 24;
        std::vector<int> offsets(experts + 1), pair_of_row(tokens * top_k, -1);
        emu::launch({1, 1, 1}, {32, 1, 1}, [&] {
            moe_segment_offsets(counts.data(), offsets.data(), experts, capacity);
        });
        auto x = random((size_t)tokens * hidden, 8, 1.0f);
        std::vector<float> permuted((size_t)tokens * top_k * hidden, -7.0f);
        emu::launch({(unsigned)(tokens * top_k), 1, 1}, {32, 1, 1}, [&] {
            moe_permute<float>(x.data(), ids.data(), slots.data(), offsets.data(),
                               permuted.data(), pair_of_row.data(), top_k, hidden);
        });
        bool placed = true;
        int kept_pairs = 0;
        for (int e = 0; e < experts; ++e) {
            const int c = capacity ? std::min(counts[e], capacity) : counts[e];
            placed &= offsets[e + 1] - offsets[e] == c;
            kept_pairs += c;
        }
        for (int row = 0; row < kept_pairs; ++row) {
            const int pair = pair_of_row[row];
            placed &= pair >= 0 && slots[pair] >= 0 &&
                      offsets[ids[pair]] + slots[pair] == row &&
                      std::equal(x.begin() + (size_t)(pair / top_k) * hidden,
                                 x.begin() + (size_t)(pair / top_k + 1) * hidden,
                                 permuted.begin() + (size_t)row * hidden);
        }
        expect(placed, "offsets and permute after the " + what);
    }
}

// Every family's router against the CPU's (`moe/router.rs`: `Ranking::rank_scored`, then
// `capacity::assign` dropless): DeepSeek-V3's `noaux_tc` (sigmoid, ranked with the correction
// bias, 8 groups of 32 scored by their two best, 4 kept, weights from the unbiased scores,
// renormalised, scaled), GLM-4.5's (the same in one group), DeepSeek-V2's `group_limited_greedy`
// (softmax, groups by their best) and Qwen's softmax without renormalisation. Ties between
// groups and between experts go to the lower index. The bias moves the choice away from the
// plain scores, so a kernel that ranked without it, or weighted with it, would fail.
static void scored_routers() {
    struct Case {
        const char* name;
        int experts, top_k, sigmoid, groups, keep, renormalize;
        float scale;
    };
    for (const Case& c : {Case{"DeepSeek-V3 noaux_tc", 256, 8, 1, 8, 4, 1, 2.5f},
                          Case{"GLM-4.5 sigmoid, one group", 160, 8, 1, 1, 1, 1, 1.0f},
                          Case{"DeepSeek-V2 group_limited_greedy", 160, 6, 0, 8, 3, 1, 16.0f},
                          Case{"softmax, no renormalisation", 64, 8, 0, 1, 1, 0, 1.0f}}) {
        const int tokens = 23, E = c.experts, K = c.top_k;
        auto logits = random((size_t)tokens * E, 70 + E, 3.0f);
        // Token 0: every logit equal, so expert and group ties decide it.
        std::fill(logits.begin(), logits.begin() + E, 0.25f);
        // Token 1: group 0 holds the single best expert and nothing else, every other group
        // two good ones; by the sum of their two best (noaux_tc) group 0 is out, by its best it
        // would be in.
        const int size = E / c.groups;
        std::fill(logits.begin() + E, logits.begin() + 2 * E, -6.0f);
        logits[E] = 6.0f;
        for (int g = 1; g < c.groups; ++g) logits[E + g * size] = logits[E + g * size + 1] = 2.0f;
        auto correction = random(E, 71, 0.3f);
        std::fill(correction.begin(), correction.begin() + E / 2, 0.0f);
        std::vector<int> ids(tokens * K), slots(tokens * K), counts(E, 0);
        std::vector<float> weights(tokens * K);
        emu::launch({(unsigned)(tokens + 3) / 4, 1, 1}, {128, 1, 1}, [&] {
            route_top_k<float>(logits.data(), nullptr, c.sigmoid ? correction.data() : nullptr,
                               ids.data(), weights.data(), slots.data(), counts.data(), tokens,
                               E, K, 0, c.renormalize, c.sigmoid, c.groups, c.keep, c.scale);
        });
        bool same = true;
        for (int t = 0; t < tokens; ++t) {
            std::vector<float> score(E), choice(E);
            const float* row = &logits[(size_t)t * E];
            if (c.sigmoid) {
                for (int e = 0; e < E; ++e) score[e] = 1.0f / (1.0f + std::exp(-row[e]));
            } else {
                float m = row[0], sum = 0.0f;
                for (int e = 0; e < E; ++e) m = std::max(m, row[e]);
                for (int e = 0; e < E; ++e) sum += (score[e] = std::exp(row[e] - m));
                for (auto& v : score) v *= 1.0f / sum;
            }
            for (int e = 0; e < E; ++e) choice[e] = score[e] + (c.sigmoid ? correction[e] : 0.0f);
            std::vector<std::pair<float, int>> group_score;
            for (int g = 0; g < c.groups; ++g) {
                std::vector<float> m(choice.begin() + g * size, choice.begin() + (g + 1) * size);
                std::sort(m.begin(), m.end(), std::greater<float>());
                group_score.push_back({c.sigmoid && size > 1 ? m[0] + m[1] : m[0], g});
            }
            std::stable_sort(group_score.begin(), group_score.end(),
                             [](auto a, auto b) { return a.first > b.first; });
            for (int j = c.keep; j < c.groups; ++j)
                for (int e = 0; e < size; ++e)
                    choice[group_score[j].second * size + e] = -INFINITY;
            std::vector<int> order(E);
            for (int e = 0; e < E; ++e) order[e] = e;
            std::stable_sort(order.begin(), order.end(),
                             [&](int a, int b) { return choice[a] > choice[b]; });
            float kept = 0.0f;
            for (int j = 0; j < K; ++j) kept += score[order[j]];
            for (int j = 0; j < K; ++j) {
                const float w = (c.renormalize ? score[order[j]] / kept : score[order[j]]) * c.scale;
                same &= ids[t * K + j] == order[j];
                // The warp sums the softmax's denominator in another order than the CPU: a row
                // of one large and many tiny probabilities differs by a few 1e-6.
                same &= std::fabs(weights[t * K + j] - w) <= 1e-5f * std::max(1.0f, c.scale);
                same &= slots[t * K + j] >= 0;
            }
        }
        expect(same, std::string("router: ") + c.name);
        // Token 0's tie: the lowest experts of the lowest groups.
        if (!c.sigmoid) expect(ids[0] == 0 && ids[1] == 1, std::string("router ties: ") + c.name);
        if (c.sigmoid && c.groups > 1)
            expect(std::find(&ids[K], &ids[2 * K], 0) == &ids[2 * K],
                   std::string("router: group 0 out by its two best: ") + c.name);
    }
}

static void norms() {
    const int rows = 3, hidden = 300;
    auto residual = random(rows * hidden, 30, 2.0f), delta = random(rows * hidden, 31, 1.0f);
    auto weight = random(hidden, 32, 1.0f);
    std::vector<float> want_res(residual), out(rows * hidden), want(rows * hidden);
    for (int r = 0; r < rows; ++r) {
        double ss = 0;
        for (int i = 0; i < hidden; ++i) {
            want_res[r * hidden + i] += delta[r * hidden + i];
            ss += (double)want_res[r * hidden + i] * want_res[r * hidden + i];
        }
        const double inv = 1.0 / std::sqrt(ss / hidden + 1e-5);
        for (int i = 0; i < hidden; ++i) want[r * hidden + i] = (float)(weight[i] * want_res[r * hidden + i] * inv);
    }
    emu::launch({rows, 1, 1}, {256, 1, 1}, [&] {
        rms_norm_residual<float>(residual.data(), delta.data(), weight.data(), out.data(), hidden, 1e-5f);
    });
    expect(rel_error(residual, want_res) < 1e-6 && rel_error(out, want) < 1e-5,
           "rms_norm_residual adds the delta and normalises");
    // The leading 40 of rows 64 wide (MLA's kv_a_layernorm on the latent); the rest untouched.
    const int width = 40, stride = 64;
    auto x = random(rows * stride, 33, 1.0f);
    auto want_x = x;
    for (int r = 0; r < rows; ++r) {
        double ss = 0;
        for (int i = 0; i < width; ++i) ss += (double)x[r * stride + i] * x[r * stride + i];
        const double inv = 1.0 / std::sqrt(ss / width + 1e-6);
        for (int i = 0; i < width; ++i) want_x[r * stride + i] = (float)(weight[i] * x[r * stride + i] * inv);
    }
    emu::launch({rows, 1, 1}, {256, 1, 1}, [&] {
        rms_norm_rows<float>(x.data(), weight.data(), width, stride, 1e-6f);
    });
    expect(rel_error(x, want_x) < 1e-5, "rms_norm_rows on strided row prefixes");
}

// Rotates (a, b) by position × inv_freq[i], in double as the reference.
static void rotate(float& a, float& b, int pos, float inv_freq, float scaling) {
    const double angle = (double)((float)pos * inv_freq);
    const float s = (float)std::sin(angle) * scaling, c = (float)std::cos(angle) * scaling;
    const float x = a, y = b;
    a = x * c - y * s;
    b = y * c + x * s;
}

static void ropes() {
    const int tokens = 3, heads = 4, kv_heads = 2, d = 32, rotary = 16;
    std::vector<int> pos = {0, 7, 16383};
    std::vector<float> inv_freq(rotary / 2);
    for (int i = 0; i < rotary / 2; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / rotary);
    auto q = random(tokens * heads * d, 40, 1.0f), k = random(tokens * kv_heads * d, 41, 1.0f);
    auto wq = q, wk = k;
    for (int t = 0; t < tokens; ++t) {
        for (int h = 0; h < heads; ++h)
            for (int i = 0; i < rotary / 2; ++i)
                rotate(wq[(t * heads + h) * d + i], wq[(t * heads + h) * d + i + rotary / 2], pos[t], inv_freq[i], 1.0f);
        for (int h = 0; h < kv_heads; ++h)
            for (int i = 0; i < rotary / 2; ++i)
                rotate(wk[(t * kv_heads + h) * d + i], wk[(t * kv_heads + h) * d + i + rotary / 2], pos[t], inv_freq[i], 1.0f);
    }
    emu::launch({tokens, 1, 1}, {128, 1, 1}, [&] {
        rope<float>(q.data(), k.data(), pos.data(), inv_freq.data(), heads, kv_heads, d, rotary, 1.0f);
    });
    expect(rel_error(q, wq) < 1e-6 && rel_error(k, wk) < 1e-6, "rope on a partial rotary slice");
    // MLA: the rotary slice of each head's query and the latent row's shared key, both pairings.
    const int nope = 8, rope_dim = 8, qk = nope + rope_dim, rank = 12, latent = rank + rope_dim;
    for (int interleave : {0, 1}) {
        auto mq = random(tokens * heads * qk, 42, 1.0f), ml = random(tokens * latent, 43, 1.0f);
        auto wmq = mq, wml = ml;
        for (int t = 0; t < tokens; ++t)
            for (int h = 0; h <= heads; ++h) {
                float* base = h < heads ? &wmq[(t * heads + h) * qk + nope] : &wml[t * latent + rank];
                for (int i = 0; i < rope_dim / 2; ++i) {
                    const int a = interleave ? 2 * i : i, b = interleave ? 2 * i + 1 : i + rope_dim / 2;
                    rotate(base[a], base[b], pos[t], inv_freq[i], 1.25f);
                }
            }
        emu::launch({tokens, 1, 1}, {128, 1, 1}, [&] {
            mla_rope<float>(mq.data(), ml.data(), pos.data(), inv_freq.data(), heads, qk, nope,
                            rope_dim, latent, rank, interleave, 1.25f);
        });
        expect(rel_error(mq, wmq) < 1e-6 && rel_error(ml, wml) < 1e-6,
               "mla_rope, interleave " + std::to_string(interleave));
        // The rotary queries beside the absorbed ones.
        std::vector<float> lq(tokens * heads * latent, -7.0f);
        emu::launch({tokens, 1, 1}, {128, 1, 1}, [&] {
            mla_copy_rope<float>(mq.data(), lq.data(), heads, qk, nope, rope_dim, latent, rank);
        });
        bool copied = true;
        for (int r = 0; r < tokens * heads; ++r)
            for (int i = 0; i < latent; ++i)
                copied &= lq[r * latent + i] == (i < rank ? -7.0f : mq[r * qk + nope + i - rank]);
        expect(copied, "mla_copy_rope");
    }
}

static void cache_writes() {
    const int tokens = 3, width = 40, slots = 10;
    std::vector<long long> slot = {7, -1, 2};
    auto k = random(tokens * width, 50, 1.0f), v = random(tokens * width, 51, 1.0f);
    std::vector<float> kc(slots * width, -7.0f), vc(slots * width, -7.0f), lc(slots * width, -7.0f);
    emu::launch({tokens, 1, 1}, {32, 1, 1}, [&] {
        write_kv<float>(k.data(), v.data(), kc.data(), vc.data(), slot.data(), width);
        write_latent<float>(k.data(), lc.data(), slot.data(), width);
    });
    bool ok = true;
    for (int s = 0; s < slots; ++s)
        for (int i = 0; i < width; ++i) {
            const int t = s == 7 ? 0 : s == 2 ? 2 : -1;
            ok &= kc[s * width + i] == (t < 0 ? -7.0f : k[t * width + i]);
            ok &= vc[s * width + i] == (t < 0 ? -7.0f : v[t * width + i]);
            ok &= lc[s * width + i] == kc[s * width + i];
        }
    expect(ok, "write_kv and write_latent by slot (-1 writes nothing)");
}

// Grid-stride elementwise kernels over a grid smaller than the data.
static void elementwise() {
    const int rows = 5, inter = 70, width = 2 * inter;
    auto gate_up = random(rows * width, 60, 4.0f);
    std::vector<float> out(rows * inter), out2(rows * inter), want(rows * inter), want2(rows * inter);
    for (int r = 0; r < rows; ++r)
        for (int i = 0; i < inter; ++i) {
            const float g = gate_up[r * width + i], u = gate_up[r * width + inter + i];
            want[r * inter + i] = g / (1.0f + std::exp(-g)) * u;
            const float gc = std::min(g, 3.0f), uc = std::min(std::max(u, -3.0f), 3.0f);
            want2[r * inter + i] = gc / (1.0f + std::exp(-1.702f * gc)) * (uc + 1.0f);
        }
    emu::launch({2, 1, 1}, {64, 1, 1}, [&] {
        silu_mul<float>(gate_up.data(), out.data(), rows, inter);
        clamped_swiglu<float>(gate_up.data(), out2.data(), rows, inter, 1.702f, 3.0f);
    });
    expect(rel_error(out, want) < 1e-6, "silu_mul");
    expect(rel_error(out2, want2) < 1e-6, "clamped_swiglu (GPT-OSS)");
    // A projection's bias; the experts' biases per segment; clip_qkv; the shared expert's add.
    const int w = 24;
    auto x = random(rows * w, 61, 5.0f), bias = random(w, 62, 1.0f);
    auto segment_bias = random(3 * w, 63, 1.0f), src = random(rows * w, 64, 1.0f);
    auto gate = random(rows, 65, 2.0f);
    std::vector<int> offsets = {0, 2, 2, 5};  // segment 1 is empty
    auto a = x, b = x, c = x, d = x, e = x;
    c[3] = std::nanf("");
    emu::launch({2, 1, 1}, {32, 1, 1}, [&] {
        add_bias<float>(a.data(), bias.data(), rows, w);
        add_segment_bias<float>(b.data(), segment_bias.data(), offsets.data(), 3, w);
        clamp_values<float>(c.data(), (long long)rows * w, 2.0f);
        add_gated<float>(d.data(), src.data(), gate.data(), rows, w);
        add_gated<float>(e.data(), src.data(), nullptr, rows, w);
    });
    bool ok = std::isnan(c[3]);
    for (int r = 0; r < rows; ++r)
        for (int i = 0; i < w; ++i) {
            const int at = r * w + i, seg = r < 2 ? 0 : 2;
            const float g = 1.0f / (1.0f + std::exp(-gate[r]));
            ok &= std::fabs(a[at] - (x[at] + bias[i])) < 1e-6;
            ok &= std::fabs(b[at] - (x[at] + segment_bias[seg * w + i])) < 1e-6;
            ok &= at == 3 || c[at] == std::min(std::max(x[at], -2.0f), 2.0f);
            ok &= std::fabs(d[at] - (x[at] + g * src[at])) < 1e-5;
            ok &= std::fabs(e[at] - (x[at] + src[at])) < 1e-6;
        }
    expect(ok, "add_bias, add_segment_bias, clamp (NaN kept), add_gated");
    // Embedding rows and the logits rows' gather.
    const int vocab = 9, hidden = 40;
    auto table = random(vocab * hidden, 66, 1.0f);
    std::vector<unsigned> ids = {3, 0, 8, 3};
    std::vector<float> emb(ids.size() * hidden), gathered(2 * hidden);
    std::vector<int> pick = {3, 1};
    emu::launch({(unsigned)ids.size(), 1, 1}, {32, 1, 1}, [&] {
        embedding<float>(table.data(), ids.data(), emb.data(), hidden);
    });
    emu::launch({2, 1, 1}, {32, 1, 1}, [&] {
        gather_rows_f32(emb.data(), pick.data(), gathered.data(), hidden);
    });
    bool rows_ok = true;
    for (size_t t = 0; t < ids.size(); ++t)
        rows_ok &= std::equal(emb.begin() + t * hidden, emb.begin() + (t + 1) * hidden,
                              table.begin() + ids[t] * hidden);
    for (int r = 0; r < 2; ++r)
        rows_ok &= std::equal(gathered.begin() + r * hidden, gathered.begin() + (r + 1) * hidden,
                              emb.begin() + pick[r] * hidden);
    expect(rows_ok, "embedding and gather_rows");
}

int main() {
    elementwise();
    router_and_permute();
    scored_routers();
    norms();
    ropes();
    cache_writes();
    grouped_gemm<float>();
    grouped_gemm<__nv_bfloat16>();
    unpermute_order();
    greedy_argmax();
    attention_cases<float>();
    attention_cases<__nv_bfloat16>();
    std::printf("emulated kernels: %s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
