// program.h: the runtime's interface to op launchers.
//
// A Program is one kernel source (kernels_src/<name>.cu) plus its NVRTC options. A Kernel is one
// templated __global__ function of that program, instantiated per element type through NVRTC name
// expressions ("gelu_forward_kernel<{T}>" becomes "gelu_forward_kernel<float>", "<bf16>", "<half>").
// Programs and kernels are declared as namespace-scope statics in src/ops/<op>.cpp; the runtime
// compiles a program the first time one of its kernels is needed on a device of a given
// architecture, and resolves CUfunction handles once per (kernel, dtype, device).
#pragma once

#include <cuda.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace kforge {

// Base class of every error the runtime raises; bound to Python as kforge.KforgeError.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// NVRTC rejected a kernel source; what() names the kernel and carries the full NVRTC log.
struct CompileError : Error {
  using Error::Error;
};

// Element types kernels are instantiated for, named as kernels_src/common.cuh names them.
enum class DType : int { f32 = 0, bf16 = 1, f16 = 2 };
constexpr int kNumDTypes = 3;
const char* dtype_name(DType t);  // "float", "bf16", "half"

struct ProgramOptions {
  bool fast_math = false;             // --use_fast_math (only where the op tolerates it)
  std::vector<std::string> extra;     // further NVRTC options
};

class Program;
namespace detail {
struct Compiled;  // CUBINs + lowered names of one program for one architecture
}

// Launch geometry (cuda.h's Dim3 lives in the runtime headers, which the runtime does not need).
struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
  Dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// One templated kernel of a program, resolved per (dtype, device).
class Kernel {
 public:
  // `pattern` contains "{T}" where the element type goes; `dtypes` lists those to instantiate.
  // A pattern without "{T}" is instantiated once and used for every dtype.
  Kernel(Program& program, std::string pattern,
         std::vector<DType> dtypes = {DType::f32, DType::bf16, DType::f16});

  // CUfunction for `dtype` on CUDA device `device` (compiling / loading on first use).
  CUfunction function(DType dtype, int device);
  bool supports(DType dtype) const { return index_[static_cast<int>(dtype)] >= 0; }
  const std::string& pattern() const { return pattern_; }

  // Launch on `stream` (the caller passes PyTorch's current stream). Args are passed by value and
  // must match the kernel's parameter types exactly (pointers, int, long long, float).
  //
  // On Hopper and later every launch is a programmatic dependent of the kernel before it on the
  // stream: its blocks are scheduled as that kernel's blocks retire rather than after the grid has
  // completed and flushed, which hides about 1 us of launch gap a call (H200, BENCHMARKS.md). So
  // every kernel of kernels_src/ MUST begin with kf_wait_prior_grids() (common.cuh), which returns
  // once the previous kernel has finished and its writes are visible: the results are those of a
  // plain launch (tests/test_runtime.py checks the call is each kernel's first statement).
  // Plain launches where unsupported (compute capability < 9.0, a driver without cuLaunchKernelEx)
  // or when config().dependent_launch is off (KFORGE_DEPENDENT_LAUNCH=0, read by kforge._env; A/B).
  template <typename... Args>
  void launch(DType dtype, int device, CUstream stream, Dim3 grid, Dim3 block, size_t smem,
              Args... args) {
    void* params[] = {static_cast<void*>(&args)..., nullptr};
    launch_raw(dtype, device, stream, grid, block, smem, params);
  }
  void launch_raw(DType dtype, int device, CUstream stream, Dim3 grid, Dim3 block, size_t smem,
                  void** params);

 private:
  CUresult try_launch(DType dtype, int device, CUstream stream, Dim3 grid, Dim3 block, size_t smem,
                      void** params);
  friend class Program;
  static constexpr int kMaxDevices = 64;
  Program& program_;
  std::string pattern_;
  std::array<int, kNumDTypes> index_{};  // name-expression index in the program, -1 if absent
  // Resolved handles; written once under the program's lock, then read without locking.
  std::array<std::array<std::atomic<CUfunction>, kMaxDevices>, kNumDTypes> fn_{};
  std::array<std::array<std::atomic<int>, kMaxDevices>, kNumDTypes> smem_limit_{};
};

// Summary of one compiled program, for kforge.cache_info().
struct CacheEntryInfo {
  std::string name;
  std::string arch;
  std::string source;  // "nvrtc", "disk" or "memory"
  double compile_ms = 0;
  int64_t cubin_bytes = 0;
  int parts = 1;  // NVRTC programs (CUBINs) the program was compiled as
};

class Program {
 public:
  // `register_globally`: list it in all_programs() (every shipped kernel is); `kernel_dir`
  // overrides config().kernel_dir (tests compile sources from temporary directories).
  explicit Program(std::string name, ProgramOptions options = {}, bool register_globally = true,
                   std::string kernel_dir = "");
  // A program whose source text is given rather than read from <kernel_dir>/<name>.cu (generated
  // kernels); its quoted includes still resolve against the kernel directory. Never registered.
  static std::unique_ptr<Program> from_source(std::string name, std::string source,
                                              ProgramOptions options = {});
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;

  const std::string& name() const { return name_; }
  const std::vector<std::string>& name_expressions() const { return exprs_; }
  // Compile (or fetch from cache) for an architecture such as 90 ("sm_90"); no GPU needed.
  // Returns the lowered names in the order of name_expressions().
  std::vector<std::string> compile_for_arch(int arch);
  // Loaded CUfunction for name expression `index` on `device`.
  CUfunction function(int index, int device);
  // `dtype`: the element type the expression instantiates (Kernel's "{T}"), -1 for none. The
  // expressions of each element type are compiled as their own NVRTC programs (runs of up to 20),
  // in parallel, as one cache entry: a program's compile takes about as long as its largest part.
  int add_expression(const std::string& expr, int dtype = -1);
  void forget_compiled();  // drop the memory-cache shortcut (loaded modules stay)
  // Per name expression: resolved on some device in this process, i.e. launched (a Kernel resolves
  // its handle on its first launch). What the sanitizer runs read as their kernel coverage.
  std::vector<bool> resolved_expressions();

 private:
  std::shared_ptr<detail::Compiled> compiled(int arch);

  struct Module {
    std::vector<CUmodule> parts;  // one per compiled part (see add_expression)
    std::shared_ptr<detail::Compiled> compiled;
  };
  std::string name_;
  ProgramOptions options_;
  std::string kernel_dir_;
  std::string source_;        // the source text when given (from_source), else read from the file
  bool has_source_ = false;
  std::vector<std::string> exprs_;
  std::vector<int> expr_dtype_;  // per expression: its element type, -1 for none or several
  std::vector<char> resolved_;   // per expression: its handle was resolved (see resolved_expressions)
  std::mutex mu_;
  std::map<int, std::shared_ptr<detail::Compiled>> by_arch_;
  std::map<int, Module> modules_;  // per device, loaded into its primary context
};

// Every Program declared in the process, in declaration order.
std::vector<Program*>& all_programs();
Program* find_program(const std::string& name);

// --- runtime configuration (set from Python at import) -------------------------------------------
struct Config {
  std::string kernel_dir;                 // where <name>.cu and its headers live
  std::string cache_dir;                  // disk cache directory
  bool disk_cache = true;
  std::vector<std::string> nvrtc_paths;   // candidate libnvrtc paths, tried in order
  bool dependent_launch = true;           // programmatic dependent launches where supported
};
Config& config();
// Point the disk cache at `dir` (on / off); forgets an earlier write failure, so a new directory
// is tried afresh.
void set_disk_cache(const std::string& dir, bool enabled);

// ---- messages to Python's logging.getLogger("kforge") / warnings -------------------------------------
// Levels are Python's logging levels. Messages are queued per thread and handed to the handler by
// flush_log(), which entry points call once they hold no runtime lock: the handler takes the GIL,
// and a thread waiting for the GIL must never hold a lock another (GIL-holding) thread waits on.
enum LogLevel : int { kDebug = 10, kInfo = 20, kWarning = 30 };
void set_log_handler(std::function<void(int, const std::string&)> handler);
void log(int level, const std::string& message);
inline void warn(const std::string& message) { log(kWarning, message); }
void flush_log();
// Flushes this thread's queued messages when it goes out of scope; declare it before any lock.
struct LogFlush {
  LogFlush() = default;
  LogFlush(const LogFlush&) = delete;
  LogFlush& operator=(const LogFlush&) = delete;
  ~LogFlush() { flush_log(); }
};

struct CacheStats {
  int64_t memory_hits = 0, memory_misses = 0, disk_hits = 0, disk_misses = 0, disk_corrupt = 0;
  int64_t nvrtc_compiles = 0;
  int64_t disk_write_failures = 0;  // cache files that could not be written (the first one warns)
  std::vector<CacheEntryInfo> entries;
};
CacheStats cache_stats();
void clear_memory_cache();  // forget compiled programs (loaded modules stay valid); for tests
void reset_cache_stats();   // zero the hit / miss / compile counters

// Compute capability of `device` as major*10+minor (e.g. 90).
int device_arch(int device);
std::string nvrtc_version();
std::vector<int> nvrtc_supported_archs();  // the sm_XY numbers NVRTC can compile for
std::string nvrtc_library_path();

}  // namespace kforge
