// gemm: the matrix products of a training step (linear layers, their gradients, Conv1D's addmm)
// called on cuBLASLt directly, with one plan per shape kept for the process.
//
// Why: a training step of a 124M-parameter model makes ~250 GEMM calls, and through torch each costs
// 20-25 us of host time on the GPU machine (Python binding, dispatcher, ATen's matmul folding, and
// cuBLAS choosing a kernel on every call) against ~5 us for a kforge launcher. Those steps are bound
// by host time, so the GEMMs' host cost is step time. Here a call looks its plan up by shape (matmul
// descriptor, layouts and the kernel cuBLASLt's heuristic chose, made once) and launches it.
//
// Same arithmetic as torch: fp32 accumulation (fp32 inputs: TF32 only where torch allows it), the
// workspace and handle torch's own cuBLASLt calls use on this stream, PyTorch's current stream.
// Anything off the fast path goes to the ATen op that computes the same thing: other dtypes or
// devices, empty or unaligned matrices, strides that are neither row- nor column-major, torch's
// non-default split-K / fp32-precision settings, a cuBLASLt without a kernel for the shape.
#include <cublasLt.h>
#include <dlfcn.h>

#include <ATen/Context.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "../runtime/cuda_api.h"
#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

constexpr const char* kOp = "gemm";

// ---- cuBLASLt, found in the process (torch loads it) -------------------------------------------
struct LtApi {
  cublasStatus_t (*MatmulDescCreate)(cublasLtMatmulDesc_t*, cublasComputeType_t, cudaDataType_t);
  cublasStatus_t (*MatmulDescSetAttribute)(cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t,
                                           const void*, size_t);
  cublasStatus_t (*MatrixLayoutCreate)(cublasLtMatrixLayout_t*, cudaDataType, uint64_t, uint64_t,
                                       int64_t);
  cublasStatus_t (*MatmulDescDestroy)(cublasLtMatmulDesc_t);
  cublasStatus_t (*MatrixLayoutDestroy)(cublasLtMatrixLayout_t);
  cublasStatus_t (*MatmulPreferenceCreate)(cublasLtMatmulPreference_t*);
  cublasStatus_t (*MatmulPreferenceDestroy)(cublasLtMatmulPreference_t);
  cublasStatus_t (*MatmulPreferenceSetAttribute)(cublasLtMatmulPreference_t,
                                                 cublasLtMatmulPreferenceAttributes_t, const void*,
                                                 size_t);
  cublasStatus_t (*MatmulAlgoGetHeuristic)(cublasLtHandle_t, cublasLtMatmulDesc_t,
                                           cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                           cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                                           cublasLtMatmulPreference_t, int,
                                           cublasLtMatmulHeuristicResult_t*, int*);
  cublasStatus_t (*Matmul)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void*, const void*,
                           cublasLtMatrixLayout_t, const void*, cublasLtMatrixLayout_t, const void*,
                           const void*, cublasLtMatrixLayout_t, void*, cublasLtMatrixLayout_t,
                           const cublasLtMatmulAlgo_t*, void*, size_t, cudaStream_t);
  size_t (*GetVersion)();  // optional (0 when absent): names the tuning record
};

// Null when no libcublasLt is loaded or loadable (then every call takes the ATen path).
const LtApi* lt() {
  static const LtApi* api = []() -> const LtApi* {
    // The library torch loaded (its handle is used with these functions): by soname if loaded, else
    // whatever the process resolves, else one opened here.
    const char* names[] = {"libcublasLt.so.13", "libcublasLt.so.12"};
    void* lib = nullptr;
    for (const char* name : names)
      if ((lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD))) break;
    if (!lib && dlsym(RTLD_DEFAULT, "cublasLtMatmul")) lib = RTLD_DEFAULT;
    for (const char* name : names)
      if (!lib) lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return nullptr;
    static LtApi a;
    bool ok = true;
    auto get = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
      ok = ok && fn;
    };
    get(a.MatmulDescCreate, "cublasLtMatmulDescCreate");
    get(a.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
    get(a.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
    get(a.MatmulDescDestroy, "cublasLtMatmulDescDestroy");
    get(a.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
    get(a.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
    get(a.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
    get(a.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
    get(a.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
    get(a.Matmul, "cublasLtMatmul");
    a.GetVersion = reinterpret_cast<size_t (*)()>(dlsym(lib, "cublasLtGetVersion"));
    return ok ? &a : nullptr;
  }();
  return api;
}

// ---- operands ----------------------------------------------------------------------------------
// A 2-D view as cuBLAS sees it: row-major (element (i, j) at i * ld + j) or column-major (i + j *
// ld). Size-1 dimensions take any stride.
struct Operand {
  bool row_major;
  int64_t ld;
};

bool as_operand(const at::Tensor& t, Operand& o) {
  const int64_t r = t.size(0), c = t.size(1);
  const int64_t s0 = t.stride(0), s1 = t.stride(1);
  if (c == 1 || s1 == 1) {
    o = {true, r == 1 ? std::max<int64_t>(c, 1) : s0};
    return o.ld >= std::max<int64_t>(c, 1);
  }
  if (r == 1 || s0 == 1) {
    o = {false, s1};
    return o.ld >= std::max<int64_t>(r, 1);
  }
  return false;
}

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

bool fast_dtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat;
}

// 16-byte aligned address and leading dimension: the alignment every plan is chosen for.
bool aligned(const void* p, int64_t ld, int64_t elem) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0 && (ld * elem) % 16 == 0;
}

// Compute type for inputs of `t` under torch's current settings; false when torch asks for what
// the plans do not do (non-default split-K reduction, bf16 inside fp32 matmuls): the ATen path.
bool compute_type(at::ScalarType t, cublasComputeType_t& ct) {
  auto& ctx = at::globalContext();
  if (t == at::kFloat) {
    if (ctx.float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
        at::Float32Precision::BF16)
      return false;
    ct = ctx.allowTF32CuBLAS() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    return true;
  }
  const auto allowed = t == at::kHalf ? ctx.allowFP16ReductionCuBLAS() : ctx.allowBF16ReductionCuBLAS();
  ct = CUBLAS_COMPUTE_32F;
  return allowed == at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK;
}

// ---- plans -------------------------------------------------------------------------------------
// `tune`: made while tuning was on. Tuned and untuned plans of a shape are kept apart, so that a
// process can switch between them (the bench's kforge and kforge+tune rows, timed alternately).
struct Key {
  int64_t m, n, k, lda, ldb, ldd;
  bool a_row, b_row, bias, accumulate, tune;
  int8_t ab_type, d_type, compute, device;
  bool operator==(const Key& o) const {
    return m == o.m && n == o.n && k == o.k && lda == o.lda && ldb == o.ldb && ldd == o.ldd &&
           a_row == o.a_row && b_row == o.b_row && bias == o.bias && accumulate == o.accumulate &&
           tune == o.tune && ab_type == o.ab_type && d_type == o.d_type && compute == o.compute &&
           device == o.device;
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldd})
      h = (h ^ static_cast<size_t>(v)) * 1099511628211ull;
    const int64_t bits = k.a_row | k.b_row << 1 | k.bias << 2 | k.accumulate << 3 | int64_t(k.tune) << 36 |
                         int64_t(k.ab_type) << 4 | int64_t(k.d_type) << 12 |
                         int64_t(k.compute) << 20 | int64_t(k.device) << 28;
    return (h ^ static_cast<size_t>(bits)) * 1099511628211ull;
  }
};

// Descriptors are never destroyed: one per shape for the process, as the kernels are.
struct Plan {
  bool ok = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};  // what calls launch: candidates[chosen]
  size_t workspace = 0;
  // The heuristic's answers, best first; an untuned plan runs the first (what torch's cuBLASLt path
  // would). Tuning (KFORGE_GEMM_TUNE) times each on the call's operands once and keeps the fastest.
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;
  int chosen = 0;
  bool tuned = false;         // tuning chose (or there was one candidate, or timing failed)
  bool tuning = false;        // a thread is timing the candidates; calls meanwhile run the first
  bool restored = false;      // the choice came from the tuning record (not timed in this process)
  std::vector<float> times_us;  // per candidate, from tuning (-1: not launchable; empty: not timed)
};

// Candidates asked of the heuristic per shape when tuning.
constexpr int kCandidates = 8;

// D (m x n, row-major, ld ldd) = A (m x k) @ B (k x n) [+ bias (n)] [+ D]. cuBLAS is column-major,
// so it computes D^T = B^T @ A^T: its first operand is B, its second A. A row-major matrix read
// column-major is its own transpose, so a row-major operand needs no transpose and a column-major
// one does.
Plan make_plan(const Key& key, cublasLtHandle_t handle, size_t workspace, int want) {
  const LtApi& L = *lt();
  Plan p;
  const auto ab = static_cast<cudaDataType_t>(key.ab_type), dt = static_cast<cudaDataType_t>(key.d_type);
  if (L.MatmulDescCreate(&p.desc, static_cast<cublasComputeType_t>(key.compute), CUDA_R_32F) !=
      CUBLAS_STATUS_SUCCESS)
    return p;
  const cublasOperation_t op_first = key.b_row ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t op_second = key.a_row ? CUBLAS_OP_N : CUBLAS_OP_T;
  L.MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof op_first);
  L.MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof op_second);
  if (key.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    L.MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi);
    const cudaDataType_t bias_type = dt;
    L.MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof bias_type);
  }
  // Stored shapes (rows x cols, column-major): B is (n x k) when row-major, else (k x n); A is
  // (k x m) when row-major, else (m x k); D^T is (n x m).
  const bool made =
      L.MatrixLayoutCreate(&p.a, ab, key.b_row ? key.n : key.k, key.b_row ? key.k : key.n, key.ldb) ==
          CUBLAS_STATUS_SUCCESS &&
      L.MatrixLayoutCreate(&p.b, ab, key.a_row ? key.k : key.m, key.a_row ? key.m : key.k, key.lda) ==
          CUBLAS_STATUS_SUCCESS &&
      L.MatrixLayoutCreate(&p.d, dt, key.n, key.m, key.ldd) == CUBLAS_STATUS_SUCCESS;
  if (!made) return p;
  cublasLtMatmulPreference_t pref = nullptr;
  if (L.MatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return p;
  const uint64_t ws = workspace;
  L.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  const uint32_t align = 16;  // every call's pointers are 16-byte aligned (checked per call)
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    L.MatmulPreferenceSetAttribute(pref, attr, &align, sizeof align);
  std::vector<cublasLtMatmulHeuristicResult_t> results(std::max(want, 1));
  int found = 0;
  const cublasStatus_t s = L.MatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.d, p.d, pref,
                                                    static_cast<int>(results.size()), results.data(), &found);
  L.MatmulPreferenceDestroy(pref);
  if (s != CUBLAS_STATUS_SUCCESS) return p;
  for (int i = 0; i < found; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS) p.candidates.push_back(results[i]);
  if (p.candidates.empty()) return p;
  p.algo = p.candidates[0].algo;
  p.workspace = p.candidates[0].workspaceSize;
  p.ok = true;
  return p;
}

// Tuning: on/off for the process (kforge.ops.gemm sets it from KFORGE_GEMM_TUNE at import).
std::atomic<bool> tune_on{false};
// A candidate replaces the heuristic's first only when it is this much faster: timing noise alone
// should not change which kernel (and so which rounding) a shape gets from one process to the next.
constexpr float kTuneMargin = 0.97f;
constexpr int kTuneReps = 5;

void destroy(const Plan& p) {
  const LtApi& L = *lt();
  if (p.desc) L.MatmulDescDestroy(p.desc);
  for (auto layout : {p.a, p.b, p.d})
    if (layout) L.MatrixLayoutDestroy(layout);
}

struct TuneResult {
  int chosen = 0;
  std::vector<float> times_us;
  std::optional<cublasLtMatmulHeuristicResult_t> pick;  // the chosen candidate; none: keep the first
};

// Times the heuristic's candidates for `key` on this call's operands and picks the fastest, the
// first unless another is kTuneMargin faster. Runs without plans_mutex, on descriptors of its own
// (the shared plan's bias pointer stays the callers'). Each candidate: a warm-up, then kTuneReps
// launches between two events, all queued back to back after the stream has drained, then one
// synchronisation. Outputs go to `d` itself, which the call overwrites afterwards, or, for an
// accumulating plan, to a zeroed scratch from torch's allocator. Never throws: a failure (out of
// memory for the scratch, an event error) leaves the heuristic's first. The thread's capture mode
// is relaxed meanwhile, so that a graph another thread is capturing is not invalidated by the
// allocation or the synchronisation.
TuneResult tune_candidates(const Key& key, const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                           const at::Tensor& d, cublasLtHandle_t handle, const c10::cuda::CUDAStream& stream) {
  TuneResult r;
  const LtApi& L = *lt();
  const size_t ws_size = at::cuda::getCUDABlasLtWorkspaceSize();
  Plan own = make_plan(key, handle, ws_size, kCandidates);
  try {
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    if (!own.ok) throw std::runtime_error("no plan");
    if (key.bias) {
      const void* ptr = bias.data_ptr();
      L.MatmulDescSetAttribute(own.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, sizeof ptr);
    }
    void* workspace = at::cuda::getCUDABlasLtWorkspace();
    const at::Tensor out = key.accumulate ? at::zeros({key.m * key.ldd}, d.options()) : d;
    const float one = 1.0f, beta = key.accumulate ? 1.0f : 0.0f;
    auto run = [&](const cublasLtMatmulHeuristicResult_t& c) {
      return L.Matmul(handle, own.desc, &one, b.data_ptr(), own.a, a.data_ptr(), own.b, &beta, out.data_ptr(),
                      own.d, out.data_ptr(), own.d, &c.algo, workspace, c.workspaceSize,
                      stream.stream()) == CUBLAS_STATUS_SUCCESS;
    };
    const size_t n = own.candidates.size();
    std::vector<c10::cuda::CUDAEvent> start, stop;
    start.reserve(n);
    stop.reserve(n);
    std::vector<bool> launched(n, false);
    stream.synchronize();  // the step's queued work first: every candidate then starts alike
    for (size_t i = 0; i < n; ++i) {
      start.emplace_back(cudaEventDefault);
      stop.emplace_back(cudaEventDefault);
      const auto& c = own.candidates[i];
      if (c.workspaceSize > ws_size || !run(c)) continue;  // warm-up; one that cannot launch is never chosen
      start[i].record(stream);
      bool ok = true;
      for (int rep = 0; rep < kTuneReps && ok; ++rep) ok = run(c);
      stop[i].record(stream);
      launched[i] = ok;
    }
    stream.synchronize();
    r.times_us.assign(n, -1.0f);
    for (size_t i = 0; i < n; ++i)
      if (launched[i]) r.times_us[i] = 1000.0f * start[i].elapsed_time(stop[i]) / kTuneReps;
    int best = 0;
    for (size_t i = 1; i < n; ++i) {
      const float t = r.times_us[i];
      if (t >= 0 && (r.times_us[best] < 0 || t < r.times_us[best])) best = static_cast<int>(i);
    }
    if (best != 0 && r.times_us[0] >= 0 && r.times_us[best] >= kTuneMargin * r.times_us[0]) best = 0;
    r.chosen = best;
    if (r.times_us[best] >= 0) r.pick = own.candidates[best];
  } catch (const std::exception&) {
    r = TuneResult{};
  }
  destroy(own);
  return r;
}

// ---- the tuning record: each tuned shape's kernel, kept on disk -----------------------------------
// Tuning picks by timing, so two processes could pick different kernels for a shape (and round
// differently). Each pick is appended to kforge's cache directory, one text file per GPU model and
// cuBLASLt version, a line per shape: the key's fields, the chosen algo's bytes in hex, its workspace.
// A later process with tuning on takes a shape's kernel from there when cuBLASLt's heuristic still
// offers it (the candidates are compared byte for byte), without timing; the first line of a shape
// wins, so processes that timed a shape side by side (each appending its own pick) are followed by
// processes that all run the first. Appends are one write(2) of a whole line to a file opened
// O_APPEND, so processes interleave whole lines; a line that does not parse is skipped. Nothing here
// is fatal: no record means timing as before. set_tune(forget) turns the record off for the process.
using AlgoBytes = std::array<uint64_t, sizeof(cublasLtMatmulAlgo_t) / sizeof(uint64_t)>;
static_assert(sizeof(cublasLtMatmulAlgo_t) % sizeof(uint64_t) == 0);

// Built and parsed by hand with C stdio, as the runtime does (no iostreams: see program.cpp's
// read_file): a number written through a string stream crashed the first tuned call on a GPU machine.
std::string key_text(const Key& k) {
  std::string t;
  for (int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldd, int64_t(k.a_row), int64_t(k.b_row), int64_t(k.bias),
                    int64_t(k.accumulate), int64_t(k.ab_type), int64_t(k.d_type), int64_t(k.compute)})
    t += (t.empty() ? "" : " ") + std::to_string(v);
  return t;
}

AlgoBytes algo_bytes(const cublasLtMatmulAlgo_t& a) {
  AlgoBytes b;
  std::memcpy(b.data(), &a, sizeof a);
  return b;
}

struct TuneRecord {
  std::string dir;   // the cache directory it was read from ("": no disk cache)
  std::string path;  // empty: no record (disk cache off, or set_tune(forget))
  bool loaded = false;
  std::unordered_map<std::string, std::pair<AlgoBytes, size_t>> chosen;  // key_text -> algo, workspace
};

std::unordered_map<int, TuneRecord>& tune_records() {
  static std::unordered_map<int, TuneRecord> records;
  return records;
}
bool record_off = false;  // set_tune(forget): no record read or written (tests time afresh)

// The record of `device`, read on first use and again when the cache directory changed (plans_mutex
// held by the caller).
TuneRecord& tune_record(int device) {
  TuneRecord& r = tune_records()[device];
  const Config& cfg = config();
  const std::string dir = cfg.disk_cache && !record_off ? cfg.cache_dir : "";
  if (r.loaded && r.dir == dir) return r;
  r = TuneRecord{dir, "", true, {}};
  if (dir.empty()) return r;
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);  // torch's cached copy
  std::string name = prop->name;
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  const LtApi* L = lt();
  const size_t version = L && L->GetVersion ? L->GetVersion() : 0;
  r.path = dir + "/gemm-tuning-" + name + "-sm" + std::to_string(prop->major * 10 + prop->minor) +
           "-cublaslt" + std::to_string(version) + ".txt";
  FILE* in = std::fopen(r.path.c_str(), "r");
  if (!in) return r;
  char* buf = nullptr;
  size_t cap = 0;
  while (::getline(&buf, &cap, in) > 0) {
    char* bar = std::strchr(buf, '|');
    if (!bar) continue;
    AlgoBytes b{};
    const char* p = bar + 1;
    bool ok = true;
    for (uint64_t& w : b) {
      char* end = nullptr;
      w = std::strtoull(p, &end, 16);
      ok = ok && end != p;
      p = end;
    }
    char* end = nullptr;
    const size_t ws = std::strtoull(p, &end, 10);
    ok = ok && end != p;
    if (ok) r.chosen.emplace(std::string(buf, bar), std::make_pair(b, ws));  // a shape's first line wins
  }
  std::free(buf);
  std::fclose(in);
  return r;
}

// Appends `key`'s chosen kernel to the record (called without plans_mutex; `path` copied under it).
void record_choice(const std::string& path, const std::string& key, const cublasLtMatmulAlgo_t& algo, size_t ws) {
  if (path.empty()) return;
  std::string line = key + "|";
  char word[24];
  for (uint64_t w : algo_bytes(algo)) {
    std::snprintf(word, sizeof word, " %llx", static_cast<unsigned long long>(w));
    line += word;
  }
  line += " " + std::to_string(ws) + "\n";
  ::mkdir(path.substr(0, path.rfind('/')).c_str(), 0755);  // usually there already (the kernel cache)
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  (void)!::write(fd, line.data(), line.size());
  ::close(fd);
}

// Takes `key`'s kernel from the tuning record when one of the plan's candidates is it (plans_mutex
// held): the plan is then tuned, with no times of its own.
bool restore_choice(const Key& key, Plan& plan) {
  const TuneRecord& rec = tune_record(key.device);
  const auto it = rec.chosen.find(key_text(key));
  if (it == rec.chosen.end()) return false;
  for (size_t i = 0; i < plan.candidates.size(); ++i) {
    if (algo_bytes(plan.candidates[i].algo) != it->second.first) continue;
    plan.chosen = static_cast<int>(i);
    plan.algo = plan.candidates[i].algo;
    plan.workspace = plan.candidates[i].workspaceSize;
    plan.tuned = plan.restored = true;
    return true;
  }
  return false;  // cuBLASLt no longer offers that kernel here: time the candidates again
}

// Whether `stream` is being captured into a CUDA graph, or its status cannot be read (the legacy
// default stream while another stream captures): no tuning then.
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &status);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so torch's next check does not see it
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

std::mutex plans_mutex;
std::unordered_map<Key, Plan, KeyHash>& plans() {
  static std::unordered_map<Key, Plan, KeyHash> m;
  return m;
}

// Counters (kforge.ops.gemm.stats): calls that took a plan, and calls that went to ATen.
std::atomic<int64_t> fast_calls{0}, aten_calls{0};

// D = A @ B [+ bias] [+ D when accumulate] on cuBLASLt; false (nothing launched) when this call is
// off the fast path. a: (m, k), b: (k, n), d: (m, n) contiguous row-major, bias: (n,) or undefined.
bool lt_gemm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, at::Tensor& d,
             bool accumulate) {
  const LtApi* L = lt();
  if (!L || !a.is_cuda() || !fast_dtype(a.scalar_type()) || b.scalar_type() != a.scalar_type() ||
      b.device() != a.device() || d.device() != a.device())
    return false;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (m == 0 || n == 0 || k == 0) return false;
  Operand oa, ob;
  if (!as_operand(a, oa) || !as_operand(b, ob)) return false;
  if (d.stride(1) != 1 && n != 1) return false;
  const int64_t ldd = m == 1 ? n : d.stride(0);
  if (ldd < n) return false;
  const int64_t ea = a.element_size(), ed = d.element_size();
  if (!aligned(a.data_ptr(), oa.ld, ea) || !aligned(b.data_ptr(), ob.ld, ea) ||
      !aligned(d.data_ptr(), ldd, ed))
    return false;
  if (bias.defined() && (!aligned16(bias) || bias.scalar_type() != d.scalar_type() ||
                         bias.stride(0) != 1 || bias.device() != a.device()))
    return false;
  cublasComputeType_t ct;
  if (!compute_type(a.scalar_type(), ct)) return false;

  const c10::cuda::CUDAGuard guard(a.device());
  const bool tuning = tune_on.load(std::memory_order_relaxed);
  const Key key{m, n, k, oa.ld, ob.ld, ldd, oa.row_major, ob.row_major, bias.defined(), accumulate, tuning,
                static_cast<int8_t>(cuda_type(a.scalar_type())),
                static_cast<int8_t>(cuda_type(d.scalar_type())), static_cast<int8_t>(ct),
                static_cast<int8_t>(a.get_device())};
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const c10::cuda::CUDAStream cstream = c10::cuda::getCurrentCUDAStream(a.get_device());
  const cudaStream_t stream = cstream.stream();
  // Looks the plan up (made on a shape's first call) and, unless this call is to tune it first,
  // launches it under the lock: the bias pointer lives in the shared descriptor.
  auto lookup_and_launch = [&](bool may_tune) -> int {  // 1 launched, 0 off the fast path, 2 tune first
    std::lock_guard<std::mutex> lock(plans_mutex);
    auto it = plans().find(key);
    if (it == plans().end())
      it = plans().emplace(key, make_plan(key, handle, at::cuda::getCUDABlasLtWorkspaceSize(),
                                          tuning ? kCandidates : 1)).first;
    Plan* plan = &it->second;
    if (!plan->ok) return 0;
    if (may_tune && tuning && !plan->tuned && !plan->tuning) {
      if (plan->candidates.size() < 2) {
        plan->tuned = true;  // nothing to choose
      } else if (restore_choice(key, *plan)) {
        // an earlier process's pick, still among the heuristic's candidates
      } else if (!capturing(stream)) {
        plan->tuning = true;  // other calls of this shape run the heuristic's first meanwhile
        return 2;
      }
    }
    // torch's workspace for this stream, looked up (a locked map) only for kernels that use one
    void* workspace = plan->workspace ? at::cuda::getCUDABlasLtWorkspace() : nullptr;
    if (bias.defined()) {
      const void* ptr = bias.data_ptr();
      L->MatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, sizeof ptr);
    }
    const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    const cublasStatus_t s =
        L->Matmul(handle, plan->desc, &one, b.data_ptr(), plan->a, a.data_ptr(), plan->b, &beta,
                  d.data_ptr(), plan->d, d.data_ptr(), plan->d, &plan->algo, workspace,
                  plan->workspace, stream);
    KF_CHECK(s == CUBLAS_STATUS_SUCCESS, kOp, "cublasLtMatmul failed (status ", static_cast<int>(s),
             ") for (", m, " x ", k, ") @ (", k, " x ", n, "), ", a.scalar_type());
    return 1;
  };
  int done = lookup_and_launch(true);
  if (done == 0) return false;
  if (done == 2) {
    TuneResult r = tune_candidates(key, a, b, bias, d, handle, cstream);
    std::string record_path;
    {
      std::lock_guard<std::mutex> lock(plans_mutex);
      auto it = plans().find(key);  // gone if set_tune(forget) ran meanwhile: made again below
      if (it != plans().end()) {
        Plan& p = it->second;
        if (r.pick) {
          p.chosen = r.chosen;
          p.algo = r.pick->algo;
          p.workspace = r.pick->workspaceSize;
          TuneRecord& rec = tune_record(key.device);
          // first pick wins here too (another thread may have restored or timed this key's twin)
          rec.chosen.emplace(key_text(key), std::make_pair(algo_bytes(p.algo), p.workspace));
          record_path = rec.path;
        }
        p.times_us = std::move(r.times_us);
        p.tuned = true;
        p.tuning = false;
      }
    }
    if (r.pick) record_choice(record_path, key_text(key), r.pick->algo, r.pick->workspaceSize);
    if (lookup_and_launch(false) == 0) return false;
  }
  fast_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void check_matrices(const at::Tensor& a, const at::Tensor& b, const char* what) {
  KF_CHECK(a.defined() && b.defined(), kOp, what, ": undefined operand");
  KF_CHECK(a.dim() == 2 && b.dim() == 2, kOp, what, ": operands must be matrices, got ", a.dim(),
           "-D and ", b.dim(), "-D");
  KF_CHECK(a.size(1) == b.size(0), kOp, what, ": shapes ", a.sizes(), " and ", b.sizes(),
           " cannot be multiplied");
}

at::Tensor out_for(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype) {
  return new_output({a.size(0), b.size(1)}, a.options().dtype(dtype));
}

// a @ b (2-D).
at::Tensor gemm_mm(const at::Tensor& a, const at::Tensor& b) {
  check_matrices(a, b, "mm");
  if (a.is_cuda() && b.scalar_type() == a.scalar_type()) {
    at::Tensor d = out_for(a, b, a.scalar_type());
    if (lt_gemm(a, b, at::Tensor(), d, false)) return d;
  }
  aten_calls.fetch_add(1, std::memory_order_relaxed);
  return at::mm(a, b);
}

// a @ b stored as float32, for 16-bit a and b (the fp32 weight gradients of autocast).
at::Tensor gemm_mm_widen(const at::Tensor& a, const at::Tensor& b) {
  check_matrices(a, b, "mm_widen");
  if (a.is_cuda() && (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf)) {
    at::Tensor d = out_for(a, b, at::kFloat);
    if (lt_gemm(a, b, at::Tensor(), d, false)) return d;
    aten_calls.fetch_add(1, std::memory_order_relaxed);
    return at::mm(a, b, at::kFloat);
  }
  aten_calls.fetch_add(1, std::memory_order_relaxed);
  return at::mm(a.to(at::kFloat), b.to(at::kFloat));
}

// c += a @ b in place; returns c.
at::Tensor gemm_addmm_(at::Tensor c, const at::Tensor& a, const at::Tensor& b) {
  check_matrices(a, b, "addmm_");
  KF_CHECK(c.dim() == 2 && c.size(0) == a.size(0) && c.size(1) == b.size(1), kOp,
           "addmm_: accumulator of shape ", c.sizes(), " for a product of shape (", a.size(0), ", ",
           b.size(1), ")");
  if (c.is_cuda() && c.scalar_type() == a.scalar_type() && c.is_contiguous() &&
      lt_gemm(a, b, at::Tensor(), c, true))
    return c;
  aten_calls.fetch_add(1, std::memory_order_relaxed);
  return c.addmm_(a, b);
}

// bias + a @ b, bias 1-D of b's columns (Hugging Face's Conv1D); other biases: ATen's addmm.
at::Tensor gemm_addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b) {
  check_matrices(a, b, "addmm");
  if (a.is_cuda() && bias.dim() == 1 && bias.size(0) == b.size(1) &&
      bias.scalar_type() == a.scalar_type()) {
    at::Tensor d = out_for(a, b, a.scalar_type());
    if (lt_gemm(a, b, bias, d, false)) return d;
  }
  aten_calls.fetch_add(1, std::memory_order_relaxed);
  return at::addmm(bias, a, b);
}

// F.linear: x (..., k) @ weight (n, k)^T [+ bias (n)], shaped (..., n).
at::Tensor gemm_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias_) {
  KF_CHECK(x.defined() && weight.defined() && weight.dim() == 2 && x.dim() >= 1 &&
               x.size(-1) == weight.size(1),
           kOp, "linear: input ", x.sizes(), " and weight ", weight.sizes(), " are not a linear layer's");
  const at::Tensor bias = bias_.has_value() ? *bias_ : at::Tensor();
  if (x.is_cuda() && x.dim() >= 2 && x.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
      (!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0) &&
                           bias.scalar_type() == x.scalar_type()))) {
    const int64_t k = x.size(-1), n = weight.size(0);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = n;
    at::Tensor d = new_output(shape, x.options());
    at::Tensor d2 = d.view({-1, n});
    if (lt_gemm(x.view({-1, k}), weight.t(), bias, d2, false)) return d;
  }
  aten_calls.fetch_add(1, std::memory_order_relaxed);
  return at::linear(x, weight, bias_);
}

// F.linear with the views a trace makes of its result in one call (kforge.ops.gemm's folding): the
// head split `reshape(y, (B, T, H, D))` then `permute(.., (0, 2, 1, 3))` costs two Python calls per
// projection in a forward that waits for its host. torch.reshape's rules: a view of the fresh output.
at::Tensor gemm_linear_views(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                             const std::vector<int64_t>& out_shape, const std::optional<std::vector<int64_t>>& perm) {
  at::Tensor y = gemm_linear(x, weight, bias);
  int64_t numel = 1;
  for (int64_t d : out_shape) numel = d < 0 || numel < 0 ? -1 : numel * d;
  KF_CHECK(numel == y.numel(), kOp, "linear_views: out_shape ", c10::IntArrayRef(out_shape),
           " does not hold the product of shape ", y.sizes());
  if (perm.has_value()) {
    std::vector<bool> seen(out_shape.size(), false);
    bool ok = perm->size() == out_shape.size();
    for (int64_t d : *perm) ok = ok && d >= 0 && d < static_cast<int64_t>(seen.size()) && !seen[d] && (seen[d] = true);
    KF_CHECK(ok, kOp, "linear_views: perm ", c10::IntArrayRef(*perm), " is not a permutation of ",
             out_shape.size(), " dimensions");
  }
  y = y.reshape(out_shape);
  return perm.has_value() ? y.permute(*perm) : y;
}

// (t reshaped to rows of `cols` elements)[.t()]: a view where torch.reshape would give one.
at::Tensor as_matrix(const at::Tensor& t, int64_t cols, bool transpose) {
  KF_CHECK(t.defined() && cols > 0 && t.numel() % cols == 0, kOp, "views: an operand of shape ", t.sizes(),
           " is not rows of ", cols, " elements");
  at::Tensor m = t.dim() == 2 && t.size(1) == cols ? t : t.reshape({-1, cols});
  return transpose ? m.t() : m;
}

// A GEMM with the views around it in one call (kforge.ops.gemm's folding): A = a as rows of `ka`
// (transposed when ta), B likewise; D = A @ B (`widen`: stored as float32), or c += A @ B in place
// when c is given; returned in `out_shape` when given (a view of D).
at::Tensor gemm_views(const at::Tensor& a, int64_t ka, bool ta, const at::Tensor& b, int64_t kb, bool tb,
                 const std::optional<at::Tensor>& c, bool widen,
                 const std::optional<std::vector<int64_t>>& out_shape) {
  const at::Tensor A = as_matrix(a, ka, ta), B = as_matrix(b, kb, tb);
  at::Tensor d;
  if (c.has_value() && c->defined()) {
    KF_CHECK(!widen, kOp, "views: an accumulation cannot widen");
    d = gemm_addmm_(c->dim() == 2 ? *c : c->view({-1, B.size(1)}), A, B);
  } else {
    d = widen ? gemm_mm_widen(A, B) : gemm_mm(A, B);
  }
  return out_shape.has_value() ? d.view(*out_shape) : d;
}

// Hugging Face's Conv1D with the views around it in one call: bias + (a as rows of `ka`) @ b, returned
// in `out_shape` when given (a view of D), for `x.view(-1, k)`, `addmm`, `.view(*lead, n)` (two
// Python view calls per projection otherwise).
at::Tensor gemm_addmm_views(const at::Tensor& bias, const at::Tensor& a, int64_t ka, const at::Tensor& b,
                            const std::optional<std::vector<int64_t>>& out_shape) {
  const at::Tensor d = gemm_addmm(bias, as_matrix(a, ka, false), b);
  return out_shape.has_value() ? d.view(*out_shape) : d;
}

pybind11::dict stats() {
  pybind11::dict d;
  d["cublaslt"] = lt() != nullptr;
  d["fast_calls"] = fast_calls.load();
  d["aten_calls"] = aten_calls.load();
  std::lock_guard<std::mutex> lock(plans_mutex);
  int64_t ok = 0;
  for (const auto& [key, plan] : plans()) ok += plan.ok;
  int64_t tuned = 0, changed = 0, restored = 0;
  for (const auto& [key, plan] : plans()) {
    tuned += plan.tuned;
    changed += plan.tuned && plan.chosen != 0;
    restored += plan.restored;
  }
  d["plans"] = static_cast<int64_t>(plans().size());
  d["plans_without_kernel"] = static_cast<int64_t>(plans().size()) - ok;
  d["tune"] = tune_on.load();
  d["tuned"] = tuned;
  d["tuned_changed"] = changed;
  d["tuned_restored"] = restored;
  return d;
}

// Per tuned plan: shape, layouts, dtypes, compute type, the candidates' times (us; -1: not
// launchable; empty: one candidate, timing failed, or restored from the tuning record) and the one
// chosen, for kforge.ops.gemm.tuning().
pybind11::list tuning() {
  pybind11::list out;
  std::lock_guard<std::mutex> lock(plans_mutex);
  for (const auto& [key, plan] : plans()) {
    if (!plan.tuned) continue;
    pybind11::dict d;
    d["m"] = key.m;
    d["n"] = key.n;
    d["k"] = key.k;
    d["lda"] = key.lda;
    d["ldb"] = key.ldb;
    d["ldd"] = key.ldd;
    d["compute"] = static_cast<int>(key.compute);
    d["a_row_major"] = key.a_row;
    d["b_row_major"] = key.b_row;
    d["bias"] = key.bias;
    d["accumulate"] = key.accumulate;
    d["ab_type"] = static_cast<int>(key.ab_type);
    d["d_type"] = static_cast<int>(key.d_type);
    d["device"] = static_cast<int>(key.device);
    d["times_us"] = plan.times_us;
    d["chosen"] = plan.chosen;
    d["restored"] = plan.restored;
    out.append(d);
  }
  return out;
}

// Turns tuning on or off for the calls from now on (each setting keeps plans of its own); `forget`
// drops every plan and turns the tuning record off (tests: the next call of each shape makes, and
// with tuning on times, its plan afresh, and nothing is written to the user's cache).
void set_tune(bool on, bool forget) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  tune_on.store(on);
  if (forget) {
    plans().clear();  // descriptors leak, as for plans of a whole process
    tune_records().clear();
    record_off = true;
  }
}

}  // namespace

KFORGE_BIND_OP(gemm) {
  namespace py = pybind11;
  m.def("gemm_mm", &gemm_mm, "a @ b (2-D) on cuBLASLt with a cached plan; ATen's mm off the fast path",
        py::arg("a"), py::arg("b"));
  m.def("gemm_mm_widen", &gemm_mm_widen, "a @ b stored as float32 (16-bit a, b)", py::arg("a"), py::arg("b"));
  m.def("gemm_addmm_", &gemm_addmm_, "c += a @ b in place; returns c", py::arg("c"), py::arg("a"), py::arg("b"));
  m.def("gemm_addmm", &gemm_addmm, "bias + a @ b (bias 1-D: cuBLASLt's bias epilogue)", py::arg("bias"),
        py::arg("a"), py::arg("b"));
  m.def("gemm_linear", &gemm_linear, "F.linear(x, weight, bias) on cuBLASLt", py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none());
  m.def("gemm_linear_views", &gemm_linear_views,
        "F.linear(x, weight, bias) on cuBLASLt, reshaped to out_shape (torch.reshape's rules) and permuted "
        "by perm when given",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out_shape"), py::arg("perm"));
  m.def("gemm_addmm_views", &gemm_addmm_views,
        "bias + (a as rows of ka) @ b (Conv1D) on cuBLASLt, viewed as out_shape when given",
        py::arg("bias"), py::arg("a"), py::arg("ka"), py::arg("b"), py::arg("out_shape"));
  m.def("gemm_views", &gemm_views,
        "(a as rows of ka)[.T] @ (b as rows of kb)[.T], stored as float32 when widen, accumulated into c "
        "when given, viewed as out_shape when given",
        py::arg("a"), py::arg("ka"), py::arg("ta"), py::arg("b"), py::arg("kb"), py::arg("tb"), py::arg("c"),
        py::arg("widen"), py::arg("out_shape"));
  m.def("gemm_stats", &stats,
        "{cublaslt, fast_calls, aten_calls, plans, plans_without_kernel, tune, tuned, tuned_changed, "
        "tuned_restored}");
  m.def("gemm_tuning", &tuning,
        "per tuned plan: shape, layouts, dtypes, candidates' times (us), chosen, restored (taken from "
        "the tuning record in kforge's cache directory, not timed)");
  m.def("gemm_set_tune", &set_tune, "time the heuristic's candidates per shape and keep the fastest",
        py::arg("on").noconvert(), py::arg("forget").noconvert() = false);
}

}  // namespace kforge
