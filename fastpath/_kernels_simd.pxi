# The float32 loops of fastpath._kernels, in C that the compiler vectorises (included by
# _kernels.pyx).
#
# Every transcendental is plain arithmetic (range reduction + polynomial, selects instead of
# branches), so no libm call blocks vectorisation and no -ffast-math is needed: NaN, +-inf,
# -0.0 and subnormals follow IEEE arithmetic. Largest errors found against float64
# references over every third float32 of the range (with and without FMA): exp 1.2 ulp
# (subnormal results included), erf 1.4 ulp, tanh 1.6 ulp, gelu 2.5 ulp for x >= 0 and
# 4 ulp on [-1, 0) (relative 5e-6 below, where x Phi(x) is small; there 1 + erf is not
# formed, so gelu is more accurate than the erf form numpy and PyTorch evaluate).
# With GCC 12+ on x86-64 Linux each entry point is compiled for several targets
# (target_clones: x86-64-v4 (AVX-512) where it pays, -v3 (AVX2 + FMA), the baseline) and the
# loader picks the one the CPU runs; elsewhere the baseline is built. Results may differ in
# the last ulp between those variants (FMA contraction), except sum and mean (no products).
#
# Sums. Every float32 sum (sum and mean of rows, and the sums inside softmax and
# layer_norm) runs one loop, dtk_sum: DTK_SUM_LANES float32 lanes over blocks of
# DTK_SUM_BLOCK elements (lane j takes elements j, j + DTK_SUM_LANES, ...: independent
# additions the compiler vectorises), the lanes added pairwise, the block totals and the
# elements past the last whole group of lanes added in float64, rounded to float32 once.
# Each lane adds DTK_SUM_BLOCK / DTK_SUM_LANES = 16 elements per block, as each of numpy's
# 8 pairwise accumulators does, and the float64 total keeps long rows accurate: the error
# is at most about 21 u sum(|x|) (u = 2^-24) at any length, where numpy's pairwise bound
# grows as (16 + log2(n / 128)) u sum(|x|). The order is not numpy's, so a sum may differ
# from numpy's add.reduce in the last bits (and a float32 lane can overflow where numpy's
# accumulator does not, or the reverse); dtensor therefore runs the sum and mean of float32
# rows here in both dispatch modes wherever the extension is built. The sum and mean of
# fewer than DTK_SUM_LANES elements add them as numpy does (dtk_short_sum: numpy's bits);
# softmax and layer_norm add such short rows in float64 (the log of a sum near 1 needs its
# low bits).

cdef extern from *:
    """
    #include <math.h>
    #include <stdint.h>
    #include <string.h>

    #if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__) \\
        && defined(__linux__) && defined(__GLIBC__)
    #define DTK_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", \\
                                                    "default")))
    /* the reductions and layer_norm: their AVX-512 variants measured no faster */
    #define DTK_CLONES_NARROW __attribute__((target_clones("arch=x86-64-v3", "default")))
    #else
    #define DTK_CLONES
    #define DTK_CLONES_NARROW
    #endif
    #if defined(__GNUC__)
    #define DTK_INLINE static inline __attribute__((always_inline))
    #else
    #define DTK_INLINE static inline
    #endif

    #define DTK_LANES 32       /* lanes of a maximum */
    #define DTK_SUM_LANES 16   /* float32 partial sums of one block of a sum */
    #define DTK_SUM_BLOCK 256  /* elements per block of a sum */
    #define DTK_GROUP 4096   /* elements of the short rows a softmax processes together */
    #define DTK_SHORT 64     /* rows shorter than this are short */

    enum { DTK_RELU = 0, DTK_ERF = 1, DTK_GELU = 2, DTK_GELU_TANH = 3 };
    enum { DTK_SUM = 0, DTK_MEAN = 1, DTK_MAX = 2 };

    DTK_INLINE float dtk_from_bits(int32_t b) {
        float f;
        memcpy(&f, &b, sizeof f);
        return f;
    }

    /* e^r for |r| <= ln2/2 (and a little beyond): 1 + r P(r), P fitted for relative error
       (9e-9). */
    DTK_INLINE float dtk_exp_poly(float r) {
        float p = 1.3947590487077832e-3f;
        p = p * r + 8.38641170412302e-3f;
        p = p * r + 4.166630655527115e-2f;
        p = p * r + 1.6666215658187866e-1f;
        p = p * r + 0.5f;
        p = p * r + 1.0000001192092896f;
        return p * r + 1.0f;
    }

    /* r * 2^k for a normal r and a normal result: k joins the exponent bits. */
    DTK_INLINE float dtk_ldexp_normal(float r, int32_t k) {
        uint32_t b;
        memcpy(&b, &r, sizeof b);
        b += (uint32_t)k << 23;
        memcpy(&r, &b, sizeof r);
        return r;
    }

    /* 2^x for finite x in [-126, 127] (normal results): x = k + r, |r| <= 1/2, 2^r as
       1 + r P(r) (relative error 6e-9). */
    DTK_INLINE float dtk_exp2_normal(float x) {
        const float magic = 12582912.0f;            /* 1.5 * 2^23: rounds to an integer */
        float t = x + magic;
        float r = x - (t - magic);
        int32_t tb, mb = 0x4B400000;                /* the bits of magic */
        memcpy(&tb, &t, sizeof tb);
        float p = 1.5511640231125057e-4f;
        p = p * r + 1.3411360559985042e-3f;
        p = p * r + 9.617876261472702e-3f;
        p = p * r + 5.5502865463495255e-2f;
        p = p * r + 2.4022652208805084e-1f;
        p = p * r + 6.931472420692444e-1f;
        return dtk_ldexp_normal(p * r + 1.0f, tb - mb);
    }

    /* x = k ln2 + r with |r| <= ln2/2 (Cody-Waite); returns r, k in *k. The rounding to an
       integer adds 1.5 * 2^23, whose low mantissa bits then hold k (no float-to-int cast,
       so a NaN gives some k and no undefined behaviour). Valid for |x| < 2^21. */
    DTK_INLINE float dtk_exp_reduce(float x, int32_t* k) {
        const float magic = 12582912.0f;
        float t = x * 1.44269504088896341f + magic;
        float n = t - magic;
        int32_t tb, mb = 0x4B400000;                /* the bits of magic */
        memcpy(&tb, &t, sizeof tb);
        *k = tb - mb;
        float r = x - n * 0.693359375f;
        return r - n * -2.12194440e-4f;
    }

    /* exp(x) for finite x in [-87.3, 88.7] (normal results). */
    DTK_INLINE float dtk_exp_normal(float x) {
        int32_t k;
        float p = dtk_exp_poly(dtk_exp_reduce(x, &k));
        return dtk_ldexp_normal(p, k);
    }

    /* exp(x) for every float: NaN gives NaN, x > 88.73 (and +inf) inf, x < -103.98 (and
       -inf) 0; 2^k is applied as two normal powers of two, so that subnormal results are
       rounded once. */
    DTK_INLINE float dtk_expf(float x) {
        float xc = x > 88.8f ? 88.8f : x;           /* NaN passes both clamps */
        xc = xc < -104.0f ? -104.0f : xc;
        int32_t k;
        float p = dtk_exp_poly(dtk_exp_reduce(xc, &k));
        int32_t k1 = k >> 1, k2 = k - k1;           /* k in [-150, 128] */
        return p * dtk_from_bits((k1 + 127) << 23) * dtk_from_bits((k2 + 127) << 23);
    }

    /* erf(x): x + x * P(x^2) for |x| < 0.875; beyond, 1 - 2^Q(|x| - 0.875) with
       Q ~ log2(erfc), fitted for the absolute error of erfc, |x| clamped to 4 (erf
       rounds to 1 from 3.92 on). NaN takes the first branch. */
    DTK_INLINE float dtk_erff(float x) {
        float ax = fabsf(x), s = x * x;
        float p = -6.25088345259428e-4f;
        p = p * s + 5.0378115847706795e-3f;
        p = p * s - 2.6792293414473534e-2f;
        p = p * s + 1.1282359808683395e-1f;
        p = p * s - 3.7612518668174744e-1f;
        p = p * s + 1.2837913632392883e-1f;
        float small = x + x * p;
        float u = (ax < 4.0f ? ax : 4.0f) - 0.875f;    /* below 0: a value not taken */
        float q = 3.008548519574106e-4f;
        q = q * u - 2.986604580655694e-3f;
        q = q * u + 1.6235696151852608e-2f;
        q = q * u - 6.763336062431335e-2f;
        q = q * u - 1.192442536354065f;
        q = q * u - 3.506067991256714f;
        q = q * u - 2.211398124694824f;
        float big = copysignf(1.0f - dtk_exp2_normal(q), x);   /* q in [-26.1, -2.2] */
        return ax >= 0.875f ? big : small;
    }

    /* tanh(x): x + x^3 P(x^2) for |x| < 0.55; 1 - 2 / (exp(2|x|) + 1) beyond, |x|
       clamped to 9.5 (tanh rounds to 1 from 9.01 on). NaN takes the first branch. */
    DTK_INLINE float dtk_tanhf(float x) {
        float ax = fabsf(x), s = x * x;
        float p = -6.202021148055792e-3f;
        p = p * s + 2.101181261241436e-2f;
        p = p * s - 5.3834691643714905e-2f;
        p = p * s + 1.3332366943359375e-1f;
        p = p * s - 3.333330750465393e-1f;
        float small = x + x * s * p;
        float t = ax < 9.5f ? ax : 9.5f;
        float big = copysignf(1.0f - 2.0f / (dtk_exp_normal(t + t) + 1.0f), x);
        return ax >= 0.55f ? big : small;
    }

    /* gelu(x) = x Phi(x) = x/2 (1 + erf(x / sqrt(2))). With t = |x| / sqrt(2) and
       E = erfc(t) = 2^Q(t) (Q ~ log2(erfc) on [0, 4], fitted for the absolute error of E
       and for its relative error where E > 0.01), 1 + erf(x / sqrt(2)) is E for x < 0 (no
       cancellation) and 2 - E for x >= 0. From t = 4 on E is 0 (erf is +-1 in float32),
       so gelu(-inf) is NaN (0 * -inf), as the erf form gives. */
    DTK_INLINE float dtk_gelu(float x) {
        float t = fabsf(x) * 0.70710678118654752f;
        t = t < 4.0f ? t : 4.0f;                      /* NaN -> 4 */
        float q = -8.005587233128608e-7f;
        q = q * t + 1.718150633678306e-5f;
        q = q * t - 1.581739488756284e-4f;
        q = q * t + 7.930670981295407e-4f;
        q = q * t - 2.061388920992613e-3f;
        q = q * t - 2.577669802121818e-4f;
        q = q * t + 2.8009269386529922e-2f;
        q = q * t - 1.4843209087848663e-1f;
        q = q * t - 9.184165000915527e-1f;
        q = q * t - 1.6279094219207764f;
        q = q * t + 8.528321160383712e-9f;
        float e = t < 4.0f ? dtk_exp2_normal(q) : 0.0f;  /* q in [-26, 0] */
        return (x < 0.0f ? e : 2.0f - e) * (x * 0.5f);
    }

    DTK_CLONES static void dtk_unary_f32(int kind, const float* x, float* y, Py_ssize_t n) {
        Py_ssize_t i;
        const float s2 = 0.79788456080286536f, c = 0.044715f;
        switch (kind) {
        case DTK_RELU:
            for (i = 0; i < n; i++) {
                float v = x[i];
                y[i] = ((v > 0.0f) | (v != v)) ? v : 0.0f;    /* NaN stays, -0 -> 0 */
            }
            break;
        case DTK_ERF:
            for (i = 0; i < n; i++) y[i] = dtk_erff(x[i]);
            break;
        case DTK_GELU:
            for (i = 0; i < n; i++) y[i] = dtk_gelu(x[i]);
            break;
        default:
            for (i = 0; i < n; i++) {
                float v = x[i], h = v * 0.5f;
                y[i] = (dtk_tanhf((v * v * c + 1.0f) * v * s2) + 1.0f) * h;
            }
        }
    }

    /* The sum of the DTK_SUM_LANES partial sums of a block, pairwise. */
    DTK_INLINE float dtk_lanes_sum(const float* acc) {
        float a8[8], a4[4];
        int j;
        for (j = 0; j < 8; j++) a8[j] = acc[j] + acc[j + 8];
        for (j = 0; j < 4; j++) a4[j] = a8[j] + a8[j + 4];
        return (a4[0] + a4[2]) + (a4[1] + a4[3]);
    }

    /* The sum of n < DTK_SUM_LANES floats as numpy's pairwise sum adds them (a leaf of its
       recursion, added to 0): below 8 one by one; from 8 on, the first 8 combined as
       ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), then the rest one by one. */
    DTK_INLINE float dtk_short_sum(const float* a, Py_ssize_t n) {
        float res = 0.0f;
        Py_ssize_t i;
        if (n < 8) {
            for (i = 0; i < n; i++) res += a[i];
            return res;
        }
        res = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        for (i = 8; i < n; i++) res += a[i];
        return 0.0f + res;                      /* numpy's 0 + sum: -0.0 sums to +0.0 */
    }

    /* The sum of n floats (see the summation note above). */
    DTK_INLINE double dtk_sum(const float* p, Py_ssize_t n) {
        double total = 0.0;
        Py_ssize_t i;
        int j;
        while (n >= DTK_SUM_LANES) {
            Py_ssize_t len = n < DTK_SUM_BLOCK ? n - n % DTK_SUM_LANES : DTK_SUM_BLOCK;
            float acc[DTK_SUM_LANES] = {0.0f};
            for (i = 0; i < len; i += DTK_SUM_LANES)
                for (j = 0; j < DTK_SUM_LANES; j++) acc[j] += p[i + j];
            total += dtk_lanes_sum(acc);
            p += len;
            n -= len;
        }
        for (; n > 0; n--) total += *p++;
        return total;
    }

    /* The sum of (p[i] - m)^2 over n floats, accumulated as dtk_sum does. */
    DTK_INLINE double dtk_sumsq(const float* p, Py_ssize_t n, float m) {
        double total = 0.0;
        Py_ssize_t i;
        int j;
        while (n >= DTK_SUM_LANES) {
            Py_ssize_t len = n < DTK_SUM_BLOCK ? n - n % DTK_SUM_LANES : DTK_SUM_BLOCK;
            float acc[DTK_SUM_LANES] = {0.0f};
            for (i = 0; i < len; i += DTK_SUM_LANES)
                for (j = 0; j < DTK_SUM_LANES; j++) {
                    float d = p[i + j] - m;
                    acc[j] += d * d;
                }
            total += dtk_lanes_sum(acc);
            p += len;
            n -= len;
        }
        for (; n > 0; n--) {
            float d = *p++ - m;
            total += d * d;
        }
        return total;
    }

    /* max(a, v) that keeps a NaN once it has seen one (numpy's and PyTorch's max). */
    DTK_INLINE float dtk_nanmax(float a, float v) {
        return ((v > a) | (v != v)) ? v : a;
    }

    /* The int32 whose signed order is the order of the non-NaN floats (its own inverse). */
    DTK_INLINE int32_t dtk_order_key(int32_t b) {
        return b ^ ((b >> 31) & 0x7FFFFFFF);
    }

    /* The maximum of n >= 1 floats; NaN when any is NaN. Lanes of floats take the
       multiples of DTK_LANES; the lanes and the rest are folded by an int max of order keys
       and an OR of NaN flags, reductions compilers vectorise and keep branch-free (a float
       select may become a branch that random data mispredicts). */
    DTK_INLINE float dtk_max(const float* p, Py_ssize_t n) {
        int32_t kmax = INT32_MIN, b;
        int nan = 0;
        float m;
        Py_ssize_t i = 0;
        int j;
        if (n >= DTK_LANES) {
            float acc[DTK_LANES];
            for (j = 0; j < DTK_LANES; j++) acc[j] = -INFINITY;
            for (; i + DTK_LANES <= n; i += DTK_LANES)
                for (j = 0; j < DTK_LANES; j++) acc[j] = dtk_nanmax(acc[j], p[i + j]);
            for (j = 0; j < DTK_LANES; j++) {
                memcpy(&b, &acc[j], sizeof b);
                b = dtk_order_key(b);
                kmax = b > kmax ? b : kmax;
                nan |= acc[j] != acc[j];
            }
        }
        for (; i < n; i++) {
            memcpy(&b, &p[i], sizeof b);
            b = dtk_order_key(b);
            kmax = b > kmax ? b : kmax;
            nan |= p[i] != p[i];
        }
        kmax = dtk_order_key(kmax);
        memcpy(&m, &kmax, sizeof m);
        return nan ? NAN : m;
    }

    /* sum (dtk_sum rounded to float32; dtk_short_sum below DTK_SUM_LANES), mean (that sum
       / n in float32) or max of `rows` contiguous rows of n >= 1. */
    DTK_CLONES_NARROW static void dtk_reduce_f32(int kind, const float* x, float* y,
                                                 Py_ssize_t rows, Py_ssize_t n) {
        Py_ssize_t r;
        if (kind == DTK_MAX) {
            for (r = 0; r < rows; r++, x += n) y[r] = dtk_max(x, n);
            return;
        }
        for (r = 0; r < rows; r++, x += n) {
            float s = n < DTK_SUM_LANES ? dtk_short_sum(x, n) : (float)dtk_sum(x, n);
            y[r] = kind == DTK_SUM ? s : s / (float)n;
        }
    }

    /* y = exp(x - m) over n floats, where every x - m is <= 0 or NaN (m is the maximum of
       x): dtk_exp_normal for chunks where every x - m >= -87.3 (the usual case), dtk_expf
       for the chunks where one is not. y may be x. */
    DTK_INLINE void dtk_exp_shifted(const float* x, float m, float* y, Py_ssize_t n) {
        Py_ssize_t i0, i;
        for (i0 = 0; i0 < n; i0 += 256) {
            Py_ssize_t len = n - i0 < 256 ? n - i0 : 256;
            const float* xc = x + i0;
            float* yc = y + i0;
            int out = 0;
            for (i = 0; i < len; i++) out |= !(xc[i] - m >= -87.3f);
            if (out)
                for (i = 0; i < len; i++) yc[i] = dtk_expf(xc[i] - m);
            else
                for (i = 0; i < len; i++) yc[i] = dtk_exp_normal(xc[i] - m);
        }
    }

    /* softmax (or log_softmax) of `rows` contiguous rows of n >= 1: with m the row's
       maximum, exp(x - m) / sum or (x - m) - log(sum). Rows of at least DTK_SHORT take one
       pass per step; shorter rows are taken in groups of about DTK_GROUP elements, so that
       the exp loop runs over the whole group. */
    DTK_CLONES static void dtk_softmax_f32(const float* x, float* y, Py_ssize_t rows,
                                           Py_ssize_t n, int take_log) {
        float tmp[DTK_GROUP];
        Py_ssize_t r0, r, i;
        if (n >= DTK_SHORT) {
            for (r = 0; r < rows; r++, x += n, y += n) {
                float m = dtk_max(x, n);
                if (!take_log) {
                    dtk_exp_shifted(x, m, y, n);
                    float inv = (float)(1.0 / dtk_sum(y, n));
                    for (i = 0; i < n; i++) y[i] *= inv;
                } else {
                    double s = 0.0;
                    for (i = 0; i < n; i += DTK_GROUP) {
                        Py_ssize_t len = n - i < DTK_GROUP ? n - i : DTK_GROUP;
                        dtk_exp_shifted(x + i, m, tmp, len);
                        s += dtk_sum(tmp, len);
                    }
                    float ls = (float)log(s);
                    for (i = 0; i < n; i++) y[i] = (x[i] - m) - ls;
                }
            }
            return;
        }
        Py_ssize_t g = DTK_GROUP / n;
        for (r0 = 0; r0 < rows; r0 += g) {
            Py_ssize_t gr = rows - r0 < g ? rows - r0 : g;
            float* yg = y + r0 * n;
            for (r = 0; r < gr; r++) {
                const float* xr = x + (r0 + r) * n;
                float* yr = yg + r * n;
                float m = dtk_max(xr, n);
                for (i = 0; i < n; i++) yr[i] = xr[i] - m;
            }
            float* e = take_log ? tmp : yg;
            dtk_exp_shifted(yg, 0.0f, e, gr * n);
            for (r = 0; r < gr; r++) {
                float* yr = yg + r * n;
                double s = dtk_sum(e + r * n, n);
                if (!take_log) {
                    float inv = (float)(1.0 / s);
                    for (i = 0; i < n; i++) yr[i] *= inv;
                } else {
                    float ls = (float)log(s);
                    for (i = 0; i < n; i++) yr[i] -= ls;
                }
            }
        }
    }

    /* layer_norm over rows of n >= 1: (x - mean) / sqrt(var + eps) [* w] [+ b], the biased
       variance from a second pass over x - mean. */
    DTK_CLONES_NARROW static void dtk_layer_norm_f32(const float* x, float* y, Py_ssize_t rows,
                                                     Py_ssize_t n, const float* w,
                                                     const float* b, double eps) {
        Py_ssize_t r, i;
        for (r = 0; r < rows; r++, x += n, y += n) {
            float m = (float)(dtk_sum(x, n) / (double)n);
            float rs = (float)(1.0 / sqrt(dtk_sumsq(x, n, m) / (double)n + eps));
            if (w != NULL && b != NULL)
                for (i = 0; i < n; i++) y[i] = (x[i] - m) * rs * w[i] + b[i];
            else if (w != NULL)
                for (i = 0; i < n; i++) y[i] = (x[i] - m) * rs * w[i];
            else if (b != NULL)
                for (i = 0; i < n; i++) y[i] = (x[i] - m) * rs + b[i];
            else
                for (i = 0; i < n; i++) y[i] = (x[i] - m) * rs;
        }
    }

    /* The gradient of gelu: g * d/dx gelu(x) over n elements. Exact form:
       Phi(x) + x phi(x) = (1 + erf(x / sqrt(2))) / 2 + x exp(-x^2 / 2) / sqrt(2 pi); tanh form
       (t = tanh(k (x + c x^3)), k = sqrt(2 / pi)): (1 + t) / 2 + x / 2 (1 - t^2) k (1 + 3 c x^2),
       the terms of the formula dtensor's numpy twin evaluates, in one pass. */
    DTK_CLONES static void dtk_gelu_backward_f32(int tanh_form, const float* g, const float* x,
                                                 float* y, Py_ssize_t n) {
        Py_ssize_t i;
        const float s2 = 0.79788456080286536f, c = 0.044715f;
        const float r2 = 0.70710678118654752f, rpi = 0.39894228040143268f;
        if (tanh_form) {
            for (i = 0; i < n; i++) {
                float v = x[i], v2 = v * v;
                float t = dtk_tanhf((v + v2 * v * c) * s2);
                float d = (1.0f - t * t) * s2 * (v2 * (3.0f * c) + 1.0f);
                y[i] = g[i] * ((t + 1.0f) * 0.5f + v * 0.5f * d);
            }
        } else {
            for (i = 0; i < n; i++) {
                float v = x[i];
                float cdf = (dtk_erff(v * r2) + 1.0f) * 0.5f;
                float pdf = dtk_expf(v * v * -0.5f) * rpi;
                y[i] = g[i] * (cdf + v * pdf);
            }
        }
    }

    static void dtk_gelu_backward_f64(int tanh_form, const double* g, const double* x,
                                      double* y, Py_ssize_t n) {
        Py_ssize_t i;
        const double s2 = 0.79788456080286536, c = 0.044715;
        const double r2 = 0.70710678118654752, rpi = 0.39894228040143268;
        if (tanh_form) {
            for (i = 0; i < n; i++) {
                double v = x[i], v2 = v * v;
                double t = tanh((v + v2 * v * c) * s2);
                double d = (1.0 - t * t) * s2 * (v2 * (3.0 * c) + 1.0);
                y[i] = g[i] * ((t + 1.0) * 0.5 + v * 0.5 * d);
            }
        } else {
            for (i = 0; i < n; i++) {
                double v = x[i];
                y[i] = g[i] * ((erf(v * r2) + 1.0) * 0.5 + v * exp(v * v * -0.5) * rpi);
            }
        }
    }

    /* The backward of layer_norm over `rows` contiguous rows of n >= 1, from the forward's
       per-row mean and rstd: with gh = g [* w] and xh = (x - mean) * rstd,
       gx = rstd (gh - mean(gh) - xh mean(gh xh)); gw (n doubles, added to) += g xh summed
       over the rows (NULL: not wanted). The row means accumulate in float64. */
    DTK_CLONES_NARROW static void dtk_layer_norm_backward_f32(
            const float* g, const float* x, const float* mean, const float* rstd,
            const float* w, float* gx, double* gw, Py_ssize_t rows, Py_ssize_t n) {
        Py_ssize_t r, i;
        for (r = 0; r < rows; r++, g += n, x += n, gx += n) {
            float m = mean[r], rs = rstd[r];
            double a = 0.0, b = 0.0;
            for (i = 0; i < n; i++) {
                float gh = w != NULL ? g[i] * w[i] : g[i];
                float xh = (x[i] - m) * rs;
                a += gh;
                b += gh * xh;
                if (gw != NULL) gw[i] += g[i] * xh;
            }
            float ma = (float)(a / (double)n), mb = (float)(b / (double)n);
            for (i = 0; i < n; i++) {
                float gh = w != NULL ? g[i] * w[i] : g[i];
                float xh = (x[i] - m) * rs;
                gx[i] = rs * (gh - ma - xh * mb);
            }
        }
    }

    static void dtk_layer_norm_backward_f64(
            const double* g, const double* x, const double* mean, const double* rstd,
            const double* w, double* gx, double* gw, Py_ssize_t rows, Py_ssize_t n) {
        Py_ssize_t r, i;
        for (r = 0; r < rows; r++, g += n, x += n, gx += n) {
            double m = mean[r], rs = rstd[r], a = 0.0, b = 0.0;
            for (i = 0; i < n; i++) {
                double gh = w != NULL ? g[i] * w[i] : g[i];
                double xh = (x[i] - m) * rs;
                a += gh;
                b += gh * xh;
                if (gw != NULL) gw[i] += g[i] * xh;
            }
            double ma = a / (double)n, mb = b / (double)n;
            for (i = 0; i < n; i++) {
                double gh = w != NULL ? g[i] * w[i] : g[i];
                gx[i] = rs * (gh - ma - (x[i] - m) * rs * mb);
            }
        }
    }

    /* One Adam(W) step over n elements of a parameter p with gradient g and moments m, v
       (PyTorch's single-tensor order): p *= decay; m = beta1 m + (1 - beta1) g;
       v = beta2 v + (1 - beta2) g g; p -= step (m / (sqrt(v) / bc2_sqrt + eps)).
       `sign` -1 negates g (maximize); `l2` adds l2 * p to g first (Adam's weight decay). */
    #define DTK_ADAM_LOOP(T, SQRT, L2)                                                 \
        for (i = 0; i < n; i++) {                                                      \
            T pi = p[i], gi = g[i] * (T)sign;                                          \
            L2                                                                         \
            pi = pi * (T)decay;                                                        \
            T mi = m[i] * (T)beta1 + gi * (T)(1.0 - beta1);                            \
            T vi = v[i] * (T)beta2 + gi * gi * (T)(1.0 - beta2);                       \
            m[i] = mi;                                                                 \
            v[i] = vi;                                                                 \
            p[i] = pi + (T)(-step) * (mi / (SQRT(vi) / (T)bc2_sqrt + (T)eps));         \
        }
    #define DTK_ADAM_BODY(T, SQRT)                                                     \
        Py_ssize_t i;                                                                  \
        if (l2 != 0.0) {                                                               \
            DTK_ADAM_LOOP(T, SQRT, gi = gi + pi * (T)l2;)                              \
        } else {                                                                       \
            DTK_ADAM_LOOP(T, SQRT, )                                                   \
        }
    /* (sqrt is the vector instruction under -fno-math-errno, setup.py's flags; one loop
       per case of l2, so that no branch stays in the loop) */
    DTK_CLONES static void dtk_adam_f32(float* p, const float* g, float* m, float* v,
                                        Py_ssize_t n, double sign, double l2, double decay,
                                        double beta1, double beta2, double step,
                                        double bc2_sqrt, double eps) {
        DTK_ADAM_BODY(float, __builtin_sqrtf)
    }
    static void dtk_adam_f64(double* p, const double* g, double* m, double* v,
                             Py_ssize_t n, double sign, double l2, double decay,
                             double beta1, double beta2, double step,
                             double bc2_sqrt, double eps) {
        DTK_ADAM_BODY(double, __builtin_sqrt)
    }
    """
    int DTK_RELU, DTK_ERF, DTK_GELU, DTK_GELU_TANH
    int DTK_SUM, DTK_MEAN, DTK_MAX
    void dtk_unary_f32(int kind, const float* x, float* y, Py_ssize_t n) noexcept nogil
    void dtk_reduce_f32(int kind, const float* x, float* y, Py_ssize_t rows,
                        Py_ssize_t n) noexcept nogil
    void dtk_softmax_f32(const float* x, float* y, Py_ssize_t rows, Py_ssize_t n,
                         int take_log) noexcept nogil
    void dtk_layer_norm_f32(const float* x, float* y, Py_ssize_t rows, Py_ssize_t n,
                            const float* w, const float* b, double eps) noexcept nogil
    void dtk_gelu_backward_f32(int tanh_form, const float* g, const float* x, float* y,
                               Py_ssize_t n) noexcept nogil
    void dtk_gelu_backward_f64(int tanh_form, const double* g, const double* x, double* y,
                               Py_ssize_t n) noexcept nogil
    void dtk_layer_norm_backward_f32(const float* g, const float* x, const float* mean,
                                     const float* rstd, const float* w, float* gx, double* gw,
                                     Py_ssize_t rows, Py_ssize_t n) noexcept nogil
    void dtk_layer_norm_backward_f64(const double* g, const double* x, const double* mean,
                                     const double* rstd, const double* w, double* gx,
                                     double* gw, Py_ssize_t rows, Py_ssize_t n) noexcept nogil
    void dtk_adam_f32(float* p, const float* g, float* m, float* v, Py_ssize_t n,
                      double sign, double l2, double decay, double beta1, double beta2,
                      double step, double bc2_sqrt, double eps) noexcept nogil
    void dtk_adam_f64(double* p, const double* g, double* m, double* v, Py_ssize_t n,
                      double sign, double l2, double decay, double beta1, double beta2,
                      double step, double bc2_sqrt, double eps) noexcept nogil
    double dtk_sum(const float* p, Py_ssize_t n) noexcept nogil
    double dtk_sumsq(const float* p, Py_ssize_t n, float m) noexcept nogil
