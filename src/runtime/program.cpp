// program.cpp: compile with NVRTC, cache in memory and on disk, load per device.
//
// Cache key = program name + FNV-1a hash of the source and of every header it includes (read by us
// and handed to NVRTC, so what is hashed is what is compiled) + options + name expressions + arch +
// NVRTC version. Disk entries are written to a unique temp file and renamed into place, so racing
// processes never expose a torn file; each carries its full key and a checksum, so a truncated,
// corrupted or colliding file is detected, reported once and recompiled. A cache directory that
// cannot be written (read-only, not creatable, full) is reported once; kforge then runs without
// writing cache files until the cache is pointed elsewhere (set_disk_cache).
#include "program.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <algorithm>
#include <condition_variable>
#include <thread>

#include "cuda_api.h"

namespace kforge {

// ---- small helpers ------------------------------------------------------------------------------
namespace {

uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}
uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
  return fnv1a(s.data(), s.size(), h);
}
std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// No iostreams in the runtime (tests/test_runtime.py keeps it so): libstdc++'s stream and locale
// machinery has crashed inside LibTorch processes (std::regex, and numbers written through a string
// stream), so files are read with stdio and text is split by hand.
bool read_file(const std::string& path, std::string& out) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  out.clear();
  char buf[1 << 14];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  const bool ok = !std::ferror(f);
  std::fclose(f);
  return ok;
}

// `text` cut at each `sep` (a trailing one ends the last part).
std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(sep, start);
    if (end == std::string::npos) end = text.size();
    parts.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return parts;
}

// `#include "name"` on this line -> name, else "". Hand-parsed: std::regex has crashed inside
// LibTorch processes (libstdc++ locale / ABI mismatch), and the grammar here is tiny.
std::string quoted_include(const std::string& line) {
  size_t i = line.find_first_not_of(" \t");
  if (i == std::string::npos || line[i] != '#') return "";
  i = line.find_first_not_of(" \t", i + 1);
  if (i == std::string::npos || line.compare(i, 7, "include") != 0) return "";
  i = line.find_first_not_of(" \t", i + 7);
  if (i == std::string::npos || line[i] != '"') return "";
  size_t end = line.find('"', i + 1);
  return end == std::string::npos ? "" : line.substr(i + 1, end - i - 1);
}

// Headers included with quotes, recursively, relative to the kernel directory.
void collect_headers(const std::string& dir, const std::string& text,
                     std::vector<std::pair<std::string, std::string>>& headers,
                     std::set<std::string>& seen) {
  for (const std::string& line : split(text, '\n')) {
    std::string name = quoted_include(line);
    if (name.empty() || !seen.insert(name).second) continue;
    std::string body;
    if (!read_file(dir + "/" + name, body))
      throw Error("kforge: header \"" + name + "\" not found in " + dir);
    headers.emplace_back(name, body);
    collect_headers(dir, body, headers, seen);
  }
}

std::mutex g_log_mu;
std::function<void(int, const std::string&)> g_log_handler;
thread_local std::vector<std::pair<int, std::string>> t_pending;  // queued by log(), see flush_log()

// Name expressions per NVRTC program when a program is compiled in parts (see detail::Compiled):
// small enough that the largest kernel sources split across cores, large enough that parsing the
// source and headers once per part stays a small share of the work.
constexpr size_t kPartExprs = 20;

// At most one NVRTC compile per hardware thread at once, process-wide: programs compile on several
// threads (kforge.jit's background compile) and each in several parts.
class NvrtcSlot {
 public:
  NvrtcSlot() {
    std::unique_lock<std::mutex> lock(mu());
    cv().wait(lock, [] { return busy() < limit(); });
    ++busy();
  }
  ~NvrtcSlot() {
    {
      std::lock_guard<std::mutex> lock(mu());
      --busy();
    }
    cv().notify_one();
  }
  NvrtcSlot(const NvrtcSlot&) = delete;
  NvrtcSlot& operator=(const NvrtcSlot&) = delete;

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::condition_variable& cv() {
    static std::condition_variable c;
    return c;
  }
  static unsigned& busy() {
    static unsigned n = 0;
    return n;
  }
  static unsigned limit() {
    static const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    return n;
  }
};

// Set once a cache file could not be written to config().cache_dir; cleared by set_disk_cache.
std::atomic<bool> g_disk_write_failed{false};

}  // namespace

namespace detail {
// A program's name expressions are compiled in parts, NVRTC programs of one element type's (or of no
// element type's) expressions, at most kPartExprs each: NVRTC's time grows with the instantiations
// it is asked for, and the parts compile on their own threads. rmsnorm (154 expressions) took 36 s
// as one NVRTC program on a development CPU core, longer than tracing a model takes. `lowered` is in name-expression order; `part[i]` says which
// CUBIN holds expression i.
struct Compiled {
  std::string key, name, arch_name, source;
  std::vector<std::string> cubins;
  std::vector<std::string> lowered;
  std::vector<int> part;
  double compile_ms = 0;
  size_t cubin_bytes() const {
    size_t n = 0;
    for (const auto& c : cubins) n += c.size();
    return n;
  }
};
}  // namespace detail
using detail::Compiled;

namespace {

// Process-wide memory cache: key -> compiled program, plus counters for cache_info().
struct MemoryCache {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<Compiled>> entries;
  CacheStats stats;
};
MemoryCache& mem() {
  static MemoryCache m;
  return m;
}

// ---- disk format: magic, u64 payload size, u64 checksum, payload ---------------------------------
// payload = key, n, n * (lowered name, part), parts, parts * cubin; each as u64 length + bytes
// (numbers as decimal strings).
constexpr char kMagic[8] = {'K', 'F', 'C', 'U', 'B', 'I', 'N', '1'};

void put_str(std::string& out, const std::string& s) {
  uint64_t n = s.size();
  out.append(reinterpret_cast<const char*>(&n), 8);
  out += s;
}
bool get_str(const std::string& in, size_t& pos, std::string& s) {
  if (pos + 8 > in.size()) return false;
  uint64_t n;
  std::memcpy(&n, in.data() + pos, 8);
  pos += 8;
  if (n > in.size() - pos) return false;
  s.assign(in.data() + pos, n);
  pos += n;
  return true;
}

std::string serialize(const Compiled& c) {
  std::string payload;
  put_str(payload, c.key);
  put_str(payload, std::to_string(c.lowered.size()));
  for (size_t i = 0; i < c.lowered.size(); ++i) {
    put_str(payload, c.lowered[i]);
    put_str(payload, std::to_string(c.part[i]));
  }
  put_str(payload, std::to_string(c.cubins.size()));
  for (const auto& cubin : c.cubins) put_str(payload, cubin);
  std::string out(kMagic, 8);
  uint64_t n = payload.size(), sum = fnv1a(payload);
  out.append(reinterpret_cast<const char*>(&n), 8);
  out.append(reinterpret_cast<const char*>(&sum), 8);
  return out + payload;
}

// Returns "" on success, else why the file is unusable.
std::string deserialize(const std::string& file, const std::string& key, Compiled& c) {
  if (file.size() < 24 || std::memcmp(file.data(), kMagic, 8) != 0) return "bad header";
  uint64_t n, sum;
  std::memcpy(&n, file.data() + 8, 8);
  std::memcpy(&sum, file.data() + 16, 8);
  if (n != file.size() - 24) return "truncated (size mismatch)";
  std::string payload = file.substr(24);
  if (fnv1a(payload) != sum) return "checksum mismatch";
  size_t pos = 0;
  std::string k, count;
  if (!get_str(payload, pos, k) || !get_str(payload, pos, count)) return "malformed";
  if (k != key) return "key mismatch";
  auto number = [](const std::string& text, size_t& out) {
    if (text.empty() || text.size() > 9 || text.find_first_not_of("0123456789") != std::string::npos)
      return false;
    out = std::stoull(text);
    return true;
  };
  size_t cnt = 0, parts = 0;
  if (!number(count, cnt)) return "malformed";
  c.lowered.assign(cnt, "");
  c.part.assign(cnt, 0);
  std::string text;
  for (size_t i = 0; i < cnt; ++i) {
    size_t part = 0;
    if (!get_str(payload, pos, c.lowered[i]) || !get_str(payload, pos, text) || !number(text, part))
      return "malformed";
    c.part[i] = static_cast<int>(part);
  }
  if (!get_str(payload, pos, text) || !number(text, parts)) return "malformed";
  c.cubins.assign(parts, "");
  for (auto& cubin : c.cubins)
    if (!get_str(payload, pos, cubin)) return "malformed";
  if (pos != payload.size()) return "malformed";
  for (int p : c.part)
    if (p < 0 || static_cast<size_t>(p) >= parts) return "malformed";
  return "";
}

std::string errno_text(const std::string& what, int err) { return what + ": " + std::strerror(err); }

// mkdir -p; returns "" when `path` is a directory afterwards, else why not.
std::string mkdirs(const std::string& path) {
  std::string cur;
  if (!path.empty() && path[0] == '/') cur = "/";
  for (const std::string& part : split(path, '/')) {
    if (part.empty()) continue;
    cur += part + "/";
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) return errno_text("mkdir " + cur, errno);
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return errno_text("stat " + path, errno);
  if (!S_ISDIR(st.st_mode)) return path + " is not a directory";
  return "";
}

// Write atomically: unique temp file in the same directory, fsync, rename over the target. Returns
// "" on success, else the failing call and errno's text; the temp file never outlives a failure.
std::string write_atomic(const std::string& path, const std::string& data) {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  std::string tmp = path + ".tmp." + std::to_string(::getpid()) + "." +
                    std::to_string(counter++) + "." + std::to_string(rd());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  if (fd < 0) return errno_text("open " + tmp, errno);
  std::string err;
  size_t off = 0;
  while (off < data.size()) {
    ssize_t w = ::write(fd, data.data() + off, data.size() - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      err = errno_text("write " + tmp, w < 0 ? errno : ENOSPC);  // 0 bytes written: no room
      break;
    }
    off += static_cast<size_t>(w);
  }
  if (err.empty() && ::fsync(fd) != 0) err = errno_text("fsync " + tmp, errno);
  if (::close(fd) != 0 && err.empty()) err = errno_text("close " + tmp, errno);
  if (err.empty() && ::rename(tmp.c_str(), path.c_str()) != 0)
    err = errno_text("rename " + tmp + " -> " + path, errno);
  if (!err.empty()) ::unlink(tmp.c_str());
  return err;
}

int nvrtc_version_int() {
  int major = 0, minor = 0;
  nvrtc().Version(&major, &minor);
  return major * 10 + minor;
}

void check_nvrtc(nvrtcResult r, const std::string& what) {
  if (r != NVRTC_SUCCESS) throw Error("kforge: " + what + ": " + nvrtc().GetErrorString(r));
}

std::vector<int> supported_archs() {
  int n = 0;
  check_nvrtc(nvrtc().GetNumSupportedArchs(&n), "nvrtcGetNumSupportedArchs");
  std::vector<int> archs(n);
  check_nvrtc(nvrtc().GetSupportedArchs(archs.data()), "nvrtcGetSupportedArchs");
  return archs;
}

}  // namespace

// ---- configuration and warnings -----------------------------------------------------------------
Config& config() {
  static Config c;
  return c;
}

void set_disk_cache(const std::string& dir, bool enabled) {
  config().cache_dir = dir;
  config().disk_cache = enabled;
  g_disk_write_failed.store(false);
}

void set_log_handler(std::function<void(int, const std::string&)> handler) {
  std::lock_guard<std::mutex> lock(g_log_mu);
  g_log_handler = std::move(handler);
}

void log(int level, const std::string& message) { t_pending.emplace_back(level, message); }

void flush_log() {
  if (t_pending.empty()) return;
  std::vector<std::pair<int, std::string>> pending;
  pending.swap(t_pending);  // a handler that logs again queues afresh
  std::function<void(int, const std::string&)> h;
  {
    std::lock_guard<std::mutex> lock(g_log_mu);
    h = g_log_handler;
  }
  for (const auto& [level, message] : pending) {
    if (h) {
      try {
        h(level, message);
      } catch (...) {  // a failing handler must not turn a compile into an error
      }
    } else if (level >= kWarning) {
      std::fprintf(stderr, "kforge warning: %s\n", message.c_str());
    }
  }
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float";
    case DType::bf16: return "bf16";
    case DType::f16: return "half";
  }
  return "?";
}

std::vector<Program*>& all_programs() {
  static std::vector<Program*> programs;
  return programs;
}

Program* find_program(const std::string& name) {
  for (Program* p : all_programs())
    if (p->name() == name) return p;
  return nullptr;
}

std::vector<int> nvrtc_supported_archs() {
  LogFlush flush;
  return supported_archs();
}

std::string nvrtc_version() {
  LogFlush flush;
  int major = 0, minor = 0;
  nvrtc().Version(&major, &minor);
  return std::to_string(major) + "." + std::to_string(minor);
}
std::string nvrtc_library_path() {
  LogFlush flush;
  return nvrtc_path();
}

int device_arch(int device) {
  const DriverApi& cu = driver();
  CUdevice dev;
  check_cu(cu.DeviceGet(&dev, device), "kforge: cuDeviceGet(" + std::to_string(device) + ")");
  int major = 0, minor = 0;
  check_cu(cu.DeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
           "kforge: cuDeviceGetAttribute");
  check_cu(cu.DeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
           "kforge: cuDeviceGetAttribute");
  return major * 10 + minor;
}

CacheStats cache_stats() {
  MemoryCache& m = mem();
  std::lock_guard<std::mutex> lock(m.mu);
  CacheStats s = m.stats;
  for (const auto& kv : m.entries) {
    const Compiled& c = *kv.second;
    s.entries.push_back({c.name, c.arch_name, c.source, c.compile_ms,
                         static_cast<int64_t>(c.cubin_bytes()), static_cast<int>(c.cubins.size())});
  }
  return s;
}

void clear_memory_cache() {
  {
    MemoryCache& m = mem();
    std::lock_guard<std::mutex> lock(m.mu);
    m.entries.clear();
  }
  for (Program* p : all_programs()) p->forget_compiled();
}

void reset_cache_stats() {
  MemoryCache& m = mem();
  std::lock_guard<std::mutex> lock(m.mu);
  m.stats = CacheStats{};
}

// ---- Program ------------------------------------------------------------------------------------
Program::Program(std::string name, ProgramOptions options, bool register_globally,
                 std::string kernel_dir)
    : name_(std::move(name)), options_(std::move(options)), kernel_dir_(std::move(kernel_dir)) {
  if (register_globally) all_programs().push_back(this);
}

std::unique_ptr<Program> Program::from_source(std::string name, std::string source,
                                              ProgramOptions options) {
  auto p = std::make_unique<Program>(std::move(name), std::move(options), false);
  p->source_ = std::move(source);
  p->has_source_ = true;
  return p;
}

int Program::add_expression(const std::string& expr, int dtype) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!by_arch_.empty())
    throw Error("kforge: kernel " + expr + " declared after program " + name_ + " was compiled");
  for (size_t i = 0; i < exprs_.size(); ++i)
    if (exprs_[i] == expr) {
      if (expr_dtype_[i] != dtype) expr_dtype_[i] = -1;  // shared by several: the common part
      return static_cast<int>(i);
    }
  exprs_.push_back(expr);
  expr_dtype_.push_back(dtype);
  resolved_.push_back(0);
  return static_cast<int>(exprs_.size()) - 1;
}

std::vector<bool> Program::resolved_expressions() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::vector<bool>(resolved_.begin(), resolved_.end());
}

void Program::forget_compiled() {
  std::lock_guard<std::mutex> lock(mu_);
  by_arch_.clear();
}

std::vector<std::string> Program::compile_for_arch(int arch) {
  LogFlush flush;  // after the lock is released (destroyed in reverse order)
  std::lock_guard<std::mutex> lock(mu_);
  return compiled(arch)->lowered;
}

// Caller holds mu_.
std::shared_ptr<Compiled> Program::compiled(int arch) {
  MemoryCache& m = mem();
  auto it = by_arch_.find(arch);
  if (it != by_arch_.end()) {
    std::lock_guard<std::mutex> lock(m.mu);
    m.stats.memory_hits++;
    return it->second;  // not logged: this is the per-device load path of every kernel
  }

  const std::string dir = kernel_dir_.empty() ? config().kernel_dir : kernel_dir_;
  const std::string file = name_ + ".cu";
  std::string source;
  if (has_source_)
    source = source_;
  else if (!read_file(dir + "/" + file, source))
    throw Error("kforge: unknown kernel \"" + name_ + "\": " + dir + "/" + file + " not found");
  std::vector<std::pair<std::string, std::string>> headers;
  std::set<std::string> seen;
  collect_headers(dir, source, headers, seen);

  const std::string arch_name = "sm_" + std::to_string(arch);
  std::vector<std::string> opts = {"--std=c++17", "-default-device", "--gpu-architecture=" + arch_name,
                                   "-lineinfo", "-I" + dir};
  if (options_.fast_math) opts.push_back("--use_fast_math");
  for (const auto& o : options_.extra) opts.push_back(o);

  // The key spells out everything that changes the CUBIN.
  uint64_t h = fnv1a(source);
  for (const auto& hd : headers) h = fnv1a(hd.second, fnv1a(hd.first, h));
  std::string key = name_ + "|src=" + hex64(h) + "|arch=" + arch_name +
                    "|nvrtc=" + std::to_string(nvrtc_version_int()) + "|opts=";
  for (const auto& o : opts)
    if (o.rfind("-I", 0) != 0) key += o + " ";  // the include path does not change the output
  key += "|exprs=";
  for (size_t i = 0; i < exprs_.size(); ++i) key += exprs_[i] + "@" + std::to_string(expr_dtype_[i]) + ";";

  {
    std::lock_guard<std::mutex> lock(m.mu);
    auto hit = m.entries.find(key);
    if (hit != m.entries.end()) {
      m.stats.memory_hits++;
      by_arch_[arch] = hit->second;
      kforge::log(kDebug, "kforge: " + name_ + " " + arch_name + ": memory cache hit");
      return hit->second;
    }
    m.stats.memory_misses++;
  }

  auto c = std::make_shared<Compiled>();
  c->key = key;
  c->name = name_;
  c->arch_name = arch_name;
  const std::string path =
      config().cache_dir + "/" + name_ + "-" + arch_name + "-" + hex64(fnv1a(key)) + ".cubin";
  const bool use_disk = config().disk_cache && !config().cache_dir.empty();

  bool have = false;
  if (use_disk) {
    std::string data;
    if (read_file(path, data)) {
      std::string why = deserialize(data, key, *c);
      if (why.empty()) {
        have = true;
        c->source = "disk";
        kforge::log(kDebug, "kforge: " + name_ + " " + arch_name + ": disk cache hit (" + path + ")");
        std::lock_guard<std::mutex> lock(m.mu);
        m.stats.disk_hits++;
      } else {
        {
          std::lock_guard<std::mutex> lock(m.mu);
          m.stats.disk_corrupt++;
        }
        static std::set<std::string> warned;
        static std::mutex warned_mu;
        bool first;
        {
          std::lock_guard<std::mutex> lock(warned_mu);
          first = warned.insert(path).second;
        }
        if (first)
          warn("kforge: cache file " + path + " is unusable (" + why + "); recompiling " + name_);
        c->lowered.clear();
        c->cubins.clear();
        c->part.clear();
      }
    }
    if (!have) {
      std::lock_guard<std::mutex> lock(m.mu);
      m.stats.disk_misses++;
    }
  }

  if (!have) {
    auto archs = supported_archs();
    bool ok_arch = false;
    for (int a : archs) ok_arch |= (a == arch);
    if (!ok_arch)
      throw Error("kforge: NVRTC " + nvrtc_version() + " cannot compile for " + arch_name +
                  " (kernel " + name_ + ")");
    auto t0 = std::chrono::steady_clock::now();
    // Parts: per element type (expressions without one first), split into runs of at most
    // kPartExprs expressions, each its own NVRTC program on its own thread.
    std::vector<std::vector<int>> parts;
    std::map<int, size_t> open_part;  // element type -> its part still being filled
    c->part.assign(exprs_.size(), 0);
    for (size_t i = 0; i < exprs_.size(); ++i) {
      auto it = open_part.find(expr_dtype_[i]);
      if (it == open_part.end() || parts[it->second].size() >= kPartExprs) {
        open_part[expr_dtype_[i]] = parts.size();
        parts.emplace_back();
        it = open_part.find(expr_dtype_[i]);
      }
      parts[it->second].push_back(static_cast<int>(i));
      c->part[i] = static_cast<int>(it->second);
    }
    if (parts.empty()) parts.emplace_back();  // no expressions: still one (empty) module
    c->cubins.assign(parts.size(), "");
    c->lowered.assign(exprs_.size(), "");
    std::vector<std::string> errors(parts.size());
    // char, not bool: the parts' threads write their own element (vector<bool> packs them in words).
    std::vector<char> compile_failed(parts.size(), 0);
    auto compile_part = [&](size_t p) {
      NvrtcSlot slot;
      try {
        const NvrtcApi& api = nvrtc();
        std::vector<const char*> hdr_src, hdr_names;
        for (const auto& hd : headers) {
          hdr_names.push_back(hd.first.c_str());
          hdr_src.push_back(hd.second.c_str());
        }
        nvrtcProgram prog;
        check_nvrtc(api.CreateProgram(&prog, source.c_str(), file.c_str(),
                                      static_cast<int>(headers.size()), hdr_src.data(),
                                      hdr_names.data()),
                    "nvrtcCreateProgram(" + name_ + ")");
        struct Guard {
          nvrtcProgram* p;
          ~Guard() { nvrtc().DestroyProgram(p); }
        } guard{&prog};
        for (int i : parts[p])
          check_nvrtc(api.AddNameExpression(prog, exprs_[i].c_str()),
                      "nvrtcAddNameExpression(" + exprs_[i] + ")");
        std::vector<const char*> copts;
        for (const auto& o : opts) copts.push_back(o.c_str());
        nvrtcResult r = api.CompileProgram(prog, static_cast<int>(copts.size()), copts.data());
        size_t log_size = 0;
        api.GetProgramLogSize(prog, &log_size);
        std::string log(log_size, '\0');
        if (log_size) api.GetProgramLog(prog, &log[0]);
        while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
        if (r != NVRTC_SUCCESS) {
          compile_failed[p] = 1;
          errors[p] = "kforge: NVRTC failed to compile kernel \"" + name_ + "\" (" + dir + "/" + file +
                      ") for " + arch_name + ": " + api.GetErrorString(r) + "\nNVRTC log:\n" + log;
          return;
        }
        size_t n = 0;
        check_nvrtc(api.GetCUBINSize(prog, &n), "nvrtcGetCUBINSize");
        c->cubins[p].resize(n);
        check_nvrtc(api.GetCUBIN(prog, &c->cubins[p][0]), "nvrtcGetCUBIN");
        for (int i : parts[p]) {
          const char* lowered = nullptr;
          check_nvrtc(api.GetLoweredName(prog, exprs_[i].c_str(), &lowered),
                      "nvrtcGetLoweredName(" + exprs_[i] + ")");
          c->lowered[i] = lowered;
        }
      } catch (const std::exception& e) {
        errors[p] = e.what();
      }
    };
    // Part 0 on this thread, the others on their own (NVRTC compiles separate programs concurrently).
    std::vector<std::thread> workers;
    for (size_t p = 1; p < parts.size(); ++p) workers.emplace_back(compile_part, p);
    compile_part(0);
    for (auto& w : workers) w.join();
    for (size_t p = 0; p < parts.size(); ++p) {
      if (errors[p].empty()) continue;
      if (compile_failed[p]) throw CompileError(errors[p]);
      throw Error(errors[p]);
    }
    c->compile_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    c->source = "nvrtc";
    {
      std::lock_guard<std::mutex> lock(m.mu);
      m.stats.nvrtc_compiles++;
    }
    kforge::log(kInfo, "kforge: compiled " + name_ + " for " + arch_name + " with NVRTC in " +
                   std::to_string(static_cast<int64_t>(c->compile_ms + 0.5)) + " ms (" +
                   std::to_string(c->cubin_bytes()) + " bytes of CUBIN" +
                   (c->cubins.size() == 1 ? std::string(")")
                                          : " in " + std::to_string(c->cubins.size()) + " parts)"));
    if (use_disk && !g_disk_write_failed.load()) {
      std::string err = mkdirs(config().cache_dir);
      if (err.empty()) err = write_atomic(path, serialize(*c));
      if (err.empty()) {
        kforge::log(kDebug, "kforge: " + name_ + " " + arch_name + ": written to the disk cache (" + path + ")");
      } else {
        {
          std::lock_guard<std::mutex> lock(m.mu);
          m.stats.disk_write_failures++;
        }
        // One warning per cache directory: later compiles skip the write (and its system calls).
        if (!g_disk_write_failed.exchange(true))
          warn("kforge: cannot write the kernel cache in " + config().cache_dir + " (" + err +
               "); running without the disk cache: kernels are compiled again in each process. "
               "Set KFORGE_CACHE_DIR to a writable directory, or KFORGE_DISK_CACHE=0.");
      }
    }
  }

  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.entries[key] = c;
  }
  by_arch_[arch] = c;
  return c;
}

CUfunction Program::function(int index, int device) {
  LogFlush flush;  // after the lock is released (destroyed in reverse order)
  std::lock_guard<std::mutex> lock(mu_);
  const DriverApi& cu = driver();
  auto mod = modules_.find(device);
  if (mod == modules_.end()) {
    std::shared_ptr<Compiled> c = compiled(device_arch(device));
    CUdevice dev;
    CUcontext ctx;
    check_cu(cu.DeviceGet(&dev, device), "kforge: cuDeviceGet");
    // Load into the device's primary context: the one PyTorch uses for that device.
    check_cu(cu.DevicePrimaryCtxRetain(&ctx, dev), "kforge: cuDevicePrimaryCtxRetain");
    check_cu(cu.CtxPushCurrent(ctx), "kforge: cuCtxPushCurrent");
    Module loaded{{}, c};
    CUresult r = CUDA_SUCCESS;
    for (const auto& cubin : c->cubins) {
      CUmodule module;
      r = cu.ModuleLoadData(&module, cubin.data());
      if (r != CUDA_SUCCESS) break;
      loaded.parts.push_back(module);
    }
    CUcontext popped;
    cu.CtxPopCurrent(&popped);
    check_cu(r, "kforge: loading module " + name_ + " on cuda:" + std::to_string(device));
    mod = modules_.emplace(device, std::move(loaded)).first;
  }
  const Compiled& c = *mod->second.compiled;
  CUfunction fn;
  check_cu(cu.ModuleGetFunction(&fn, mod->second.parts.at(c.part.at(index)), c.lowered.at(index).c_str()),
           "kforge: kernel " + exprs_.at(index) + " not found in module " + name_);
  resolved_.at(index) = 1;
  return fn;
}

// ---- Kernel -------------------------------------------------------------------------------------
Kernel::Kernel(Program& program, std::string pattern, std::vector<DType> dtypes)
    : program_(program), pattern_(std::move(pattern)) {
  index_.fill(-1);
  for (auto& per_dtype : fn_)
    for (auto& f : per_dtype) f.store(nullptr, std::memory_order_relaxed);
  // 0: the first launch asking for any dynamic shared memory sets the function's limit. The
  // default limit (48 KiB) counts static plus dynamic shared memory, so a kernel with static
  // scratch would fail a 48 KiB dynamic request without it.
  for (auto& per_dtype : smem_limit_)
    for (auto& s : per_dtype) s.store(0, std::memory_order_relaxed);
  const std::string tag = "{T}";
  size_t at = pattern_.find(tag);
  for (DType t : dtypes) {
    std::string expr = pattern_;
    if (at != std::string::npos) expr.replace(at, tag.size(), dtype_name(t));
    index_[static_cast<int>(t)] = program_.add_expression(expr, at == std::string::npos ? -1 : static_cast<int>(t));
  }
}

CUfunction Kernel::function(DType dtype, int device) {
  const int t = static_cast<int>(dtype);
  if (device < 0 || device >= kMaxDevices)
    throw Error("kforge: device index " + std::to_string(device) + " out of range");
  CUfunction f = fn_[t][device].load(std::memory_order_acquire);
  if (f) return f;
  if (index_[t] < 0)
    throw Error(std::string("kforge: kernel ") + pattern_ + " has no " + dtype_name(dtype) +
                " instantiation");
  f = program_.function(index_[t], device);
  fn_[t][device].store(f, std::memory_order_release);
  return f;
}

namespace {
// Whether dependent launches are used on `device`: compute capability >= 9.0, cuLaunchKernelEx
// present, and not switched off (config().dependent_launch: KFORGE_DEPENDENT_LAUNCH, parsed with
// kforge's other environment knobs in python/kforge/_env.py; for A/B timing). Cached per device.
bool dependent_launch_ok(int device) {
  static std::array<std::atomic<int>, 64> state{};  // 0 unknown, 1 yes, 2 no
  if (device < 0 || device >= 64) return false;
  int s = state[device].load(std::memory_order_relaxed);
  if (s == 0) {
    s = (config().dependent_launch && driver().LaunchKernelEx && device_arch(device) >= 90) ? 1 : 2;
    state[device].store(s, std::memory_order_relaxed);
  }
  return s == 1;
}
}  // namespace

namespace {
// Makes `device`'s primary context (the one PyTorch and kforge's modules use) current on this
// thread. A thread that has not called the CUDA runtime yet has none: PyTorch's autograd device
// threads start without one, so a backward whose first kernel is kforge's would fail to launch.
void bind_primary_context(int device) {
  const DriverApi& cu = driver();
  CUdevice dev;
  CUcontext ctx;
  check_cu(cu.DeviceGet(&dev, device), "kforge: cuDeviceGet");
  check_cu(cu.DevicePrimaryCtxRetain(&ctx, dev), "kforge: cuDevicePrimaryCtxRetain");
  check_cu(cu.CtxPushCurrent(ctx), "kforge: cuCtxPushCurrent");
}
}  // namespace

void Kernel::launch_raw(DType dtype, int device, CUstream stream, Dim3 grid, Dim3 block,
                        size_t smem, void** params) {
  CUresult r = try_launch(dtype, device, stream, grid, block, smem, params);
  if (r == CUDA_ERROR_INVALID_CONTEXT) {  // no context on this thread yet: bind it once, retry
    bind_primary_context(device);
    r = try_launch(dtype, device, stream, grid, block, smem, params);
  }
  if (r != CUDA_SUCCESS)
    check_cu(r, "kforge: launch of " + pattern_ + " [" + dtype_name(dtype) + "] on cuda:" +
                    std::to_string(device) + " (grid " + std::to_string(grid.x) + "x" +
                    std::to_string(grid.y) + "x" + std::to_string(grid.z) + ", block " +
                    std::to_string(block.x) + "x" + std::to_string(block.y) + ", smem " +
                    std::to_string(smem) + (dependent_launch_ok(device) ? ", dependent launch" : "") +
                    ")");
}

CUresult Kernel::try_launch(DType dtype, int device, CUstream stream, Dim3 grid, Dim3 block,
                            size_t smem, void** params) {
  CUfunction f = function(dtype, device);
  const DriverApi& cu = driver();
  const int t = static_cast<int>(dtype);
  if (static_cast<int>(smem) > smem_limit_[t][device].load(std::memory_order_relaxed)) {
    CUresult a = cu.FuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     static_cast<int>(smem));
    if (a == CUDA_ERROR_INVALID_CONTEXT) return a;
    check_cu(a, "kforge: " + pattern_ + ": requesting " + std::to_string(smem) +
                    " bytes of dynamic shared memory");
    smem_limit_[t][device].store(static_cast<int>(smem), std::memory_order_relaxed);
  }
  CUresult r;
  const bool dependent = dependent_launch_ok(device);
  if (dependent) {
    CUlaunchAttribute attr[1] = {};
    attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr[0].value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig lc = {};
    lc.gridDimX = grid.x, lc.gridDimY = grid.y, lc.gridDimZ = grid.z;
    lc.blockDimX = block.x, lc.blockDimY = block.y, lc.blockDimZ = block.z;
    lc.sharedMemBytes = static_cast<unsigned>(smem);
    lc.hStream = stream;
    lc.attrs = attr;
    lc.numAttrs = 1;
    r = cu.LaunchKernelEx(&lc, f, params, nullptr);
  } else {
    r = cu.LaunchKernel(f, grid.x, grid.y, grid.z, block.x, block.y, block.z,
                        static_cast<unsigned>(smem), stream, params, nullptr);
  }
  return r;
}

}  // namespace kforge
