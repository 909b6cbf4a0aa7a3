// emudev: a minimal emulated accelerator for PrivateUse1 (renamed "emu" from Python).
//
// Host memory backs device tensors. Each stream owns one worker thread that runs the stream's
// queued jobs in order; events are timestamped when the worker reaches them, so
// torch.Event.elapsed_time measures *device* time as a real accelerator would. Aten ops run on
// the calling thread through torch's CPU fallback, after the current stream has drained (so they
// are ordered after queued work). A c10d Backend subclass forwards collectives to a Python object
// (tests/emulated_device/pg.py), which queues gloo calls on the stream.
#include <torch/extension.h>

#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <Python.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace emudev {

using Clock = std::chrono::steady_clock;
constexpr c10::DeviceType kEmu = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 8;
constexpr int64_t kPoolSize = 4;          // stream ids 1..kPoolSize: the global pool
constexpr int64_t kFirstNewStream = 64;   // getNewStream ids from here on

// ---------------------------------------------------------------- counters
enum WaitKind { kStreamSync, kEventSync, kDeviceSync, kOpWait, kNumKinds };
const char* kKindNames[kNumKinds] = {"stream_synchronize", "event_synchronize", "device_synchronize",
                                     "op_wait"};
std::atomic<int64_t> g_waits[kNumKinds];
std::atomic<bool> g_capturing{false};
std::mutex g_err_mu;
std::vector<std::string> g_errors;  // exceptions raised by Python jobs on stream workers

int device_count() {
  static int n = [] {
    const char* e = std::getenv("EMUDEV_DEVICE_COUNT");
    int v = e ? std::atoi(e) : 1;
    return std::max(1, std::min(v, kMaxDevices));
  }();
  return n;
}

// Drop the GIL (if this thread holds it) while blocking, so queued Python jobs can run.
struct ReleaseGIL {
  PyThreadState* st = nullptr;
  ReleaseGIL() {
    if (Py_IsInitialized() && PyGILState_Check()) st = PyEval_SaveThread();
  }
  ~ReleaseGIL() {
    if (st) PyEval_RestoreThread(st);
  }
};

bool py_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// ---------------------------------------------------------------- streams
struct EmuStream;
thread_local EmuStream* tl_worker_of = nullptr;  // set on a stream's worker thread
thread_local int tl_device = 0;
thread_local int64_t tl_current[kMaxDevices] = {0, 0, 0, 0, 0, 0, 0, 0};

struct EmuStream {
  int device;
  int64_t id;
  std::mutex mu;
  std::condition_variable cv_work, cv_done;
  std::deque<std::function<void()>> queue;
  uint64_t enqueued = 0, completed = 0;
  bool started = false;

  EmuStream(int d, int64_t i) : device(d), id(i) {}

  void enqueue(std::function<void()> fn) {
    std::lock_guard<std::mutex> g(mu);
    if (!started) {
      started = true;
      std::thread([this] { run(); }).detach();  // lives as long as the process (never joined)
    }
    queue.push_back(std::move(fn));
    ++enqueued;
    cv_work.notify_one();
  }

  void run() {
    tl_worker_of = this;
    tl_device = device;
    tl_current[device] = id;
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> g(mu);
        cv_work.wait(g, [this] { return !queue.empty(); });
        fn = std::move(queue.front());
        queue.pop_front();
      }
      try {
        fn();
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> g(g_err_mu);
        g_errors.push_back(e.what());
      }
      {
        std::lock_guard<std::mutex> g(mu);
        ++completed;
      }
      cv_done.notify_all();
    }
  }

  bool idle() {
    std::lock_guard<std::mutex> g(mu);
    return completed == enqueued;
  }

  void synchronize() {
    TORCH_CHECK(tl_worker_of != this, "emu: a stream cannot synchronize itself from its own worker");
    ReleaseGIL nogil;
    std::unique_lock<std::mutex> g(mu);
    uint64_t target = enqueued;
    cv_done.wait(g, [&] { return completed >= target; });
  }
};

std::mutex g_streams_mu;
std::map<std::pair<int, int64_t>, EmuStream*> g_streams;  // leaked on purpose: workers outlive main
std::atomic<int64_t> g_next_new_stream{kFirstNewStream};
std::atomic<int64_t> g_pool_rr{0};

int norm_device(c10::DeviceIndex idx) {
  int d = idx < 0 ? tl_device : idx;
  TORCH_CHECK(d < device_count(), "emu: invalid device index ", int(idx));
  return d;
}

EmuStream* get_stream(int device, int64_t id) {
  std::lock_guard<std::mutex> g(g_streams_mu);
  auto& s = g_streams[{device, id}];
  if (!s) s = new EmuStream(device, id);
  return s;
}

EmuStream* get_stream(const c10::Stream& s) { return get_stream(norm_device(s.device_index()), s.id()); }
EmuStream* current_stream(int device) { return get_stream(device, tl_current[device]); }

std::vector<EmuStream*> streams_of(int device) {
  std::vector<EmuStream*> out;
  std::lock_guard<std::mutex> g(g_streams_mu);
  for (auto& kv : g_streams)
    if (device < 0 || kv.first.first == device) out.push_back(kv.second);
  return out;
}

// Before an op touches device memory from the host: drain the current stream (a host wait).
void wait_current_stream_for_host() {
  if (tl_worker_of) return;  // already on a worker: ops there run in stream order
  EmuStream* s = current_stream(tl_device);
  if (s->idle()) return;
  g_waits[kOpWait]++;
  s->synchronize();
}

// ---------------------------------------------------------------- events
struct EmuEvent {
  std::mutex mu;
  std::condition_variable cv;
  bool timing;
  uint64_t scheduled = 0, done = 0;
  Clock::time_point stamp;
  explicit EmuEvent(bool t) : timing(t) {}
};
using EventBox = std::shared_ptr<EmuEvent>;  // void* handles point to a heap EventBox

EventBox& box(void* ev) { return *static_cast<EventBox*>(ev); }

// ---------------------------------------------------------------- guard
struct EmuGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kEmu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old(kEmu, tl_device);
    if (d.has_index()) tl_device = norm_device(d.index());
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kEmu, tl_device); }
  void setDevice(c10::Device d) const override {
    if (d.has_index()) tl_device = norm_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index() && d.index() < device_count()) tl_device = d.index();
  }
  c10::Stream make(int dev, int64_t id) const {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kEmu, dev), id);
  }
  c10::Stream getStream(c10::Device d) const override {
    int dev = norm_device(d.has_index() ? d.index() : -1);
    return make(dev, tl_current[dev]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return make(norm_device(d.has_index() ? d.index() : -1), 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return make(norm_device(d.has_index() ? d.index() : -1), 1 + (g_pool_rr++ % kPoolSize));
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    return make(norm_device(d.has_index() ? d.index() : -1), g_next_new_stream++);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    int dev = norm_device(s.device_index());
    c10::Stream old = make(dev, tl_current[dev]);
    tl_current[dev] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }

  void destroyEvent(void* ev, const c10::DeviceIndex) const noexcept override {
    delete static_cast<EventBox*>(ev);
  }
  void record(void** ev, const c10::Stream& stream, const c10::DeviceIndex,
              const c10::EventFlag flag) const override {
    if (!*ev) *ev = new EventBox(std::make_shared<EmuEvent>(flag == c10::EventFlag::BACKEND_DEFAULT));
    EventBox e = box(*ev);
    uint64_t v;
    {
      std::lock_guard<std::mutex> g(e->mu);
      v = ++e->scheduled;
    }
    get_stream(stream)->enqueue([e, v] {
      {
        std::lock_guard<std::mutex> g(e->mu);
        if (v > e->done) {
          e->done = v;
          e->stamp = Clock::now();
        }
      }
      e->cv.notify_all();
    });
  }
  void block(void* ev, const c10::Stream& stream) const override {
    if (!ev) return;
    EventBox e = box(ev);
    uint64_t v;
    {
      std::lock_guard<std::mutex> g(e->mu);
      v = e->scheduled;
    }
    if (v == 0) return;
    get_stream(stream)->enqueue([e, v] {
      std::unique_lock<std::mutex> g(e->mu);
      e->cv.wait(g, [&] { return e->done >= v; });
    });
  }
  bool queryEvent(void* ev) const override {
    if (!ev) return true;
    EventBox e = box(ev);
    std::lock_guard<std::mutex> g(e->mu);
    return e->done >= e->scheduled;
  }
  void synchronizeEvent(void* ev) const override {
    g_waits[kEventSync]++;
    if (!ev) return;
    EventBox e = box(ev);
    ReleaseGIL nogil;
    std::unique_lock<std::mutex> g(e->mu);
    uint64_t target = e->scheduled;
    e->cv.wait(g, [&] { return e->done >= target; });
  }
  double elapsedTime(void* a, void* b, const c10::DeviceIndex) const override {
    TORCH_CHECK(a && b, "emu: both events must be recorded before elapsed_time()");
    EventBox ea = box(a), eb = box(b);
    std::lock_guard<std::mutex> ga(ea->mu);
    std::unique_lock<std::mutex> gb(eb->mu, std::defer_lock);
    if (eb != ea) gb.lock();
    TORCH_CHECK(ea->timing && eb->timing, "emu: elapsed_time() needs events created with enable_timing=True");
    TORCH_CHECK(ea->scheduled > 0 && eb->scheduled > 0, "emu: both events must be recorded before elapsed_time()");
    TORCH_CHECK(ea->done >= ea->scheduled && eb->done >= eb->scheduled,
                "emu: elapsed_time() called before both events completed (synchronize or query first)");
    return std::chrono::duration<double, std::milli>(eb->stamp - ea->stamp).count();
  }
  bool queryStream(const c10::Stream& s) const override { return get_stream(s)->idle(); }
  void synchronizeStream(const c10::Stream& s) const override {
    g_waits[kStreamSync]++;
    get_stream(s)->synchronize();
  }
  void synchronizeDevice(const c10::DeviceIndex idx) const override {
    g_waits[kDeviceSync]++;
    for (EmuStream* s : streams_of(idx < 0 ? -1 : idx)) s->synchronize();
  }
  bool isStreamCapturing(const c10::Stream&) const override { return g_capturing.load(); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, EmuGuardImpl);

// ---------------------------------------------------------------- allocator + hooks
struct EmuAllocator final : c10::Allocator {
  static void Free(void* p) { std::free(p); }
  c10::DataPtr allocate(size_t n) override {
    void* p = nullptr;
    if (n && posix_memalign(&p, 64, n) != 0) TORCH_CHECK(false, "emu: out of host memory (", n, " bytes)");
    return {p, p, &Free, c10::Device(kEmu, tl_device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &Free; }
  void copy_data(void* dst, const void* src, std::size_t n) const override { std::memcpy(dst, src, n); }
};
EmuAllocator g_alloc;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_alloc);

struct EmuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex d) const override { tl_device = norm_device(d); }
  c10::DeviceIndex getCurrentDevice() const override { return tl_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    int old = tl_device;
    tl_device = norm_device(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
  at::Device getDeviceFromPtr(void*) const override { return at::Device(kEmu, tl_device); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t n) const override {
    wait_current_stream_for_host();
    c10::DataPtr fresh = g_alloc.allocate(n);
    size_t keep = std::min(n, storage.nbytes());
    if (keep) std::memcpy(fresh.get(), storage.data(), keep);
    storage.unsafeGetStorageImpl()->set_data_ptr_noswap(std::move(fresh));
    storage.unsafeGetStorageImpl()->set_nbytes(n);
  }
};
static bool g_hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new EmuHooks());
  return true;
}();

// ---------------------------------------------------------------- aten kernels
at::Tensor cpu_view(const at::Tensor& t) {
  // A CPU tensor aliasing the device tensor's host memory (keeps the device tensor alive).
  TORCH_CHECK(t.device().type() == kEmu, "cpu_view: expected an emu tensor, got ", t.device());
  if (t.numel() == 0) return at::empty(t.sizes(), t.options().device(at::kCPU));
  at::Tensor keep = t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [keep](void*) mutable { keep.reset(); },
                       t.options().device(at::kCPU));
}

at::Tensor emu_empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                     std::optional<at::Device> device, std::optional<bool>,
                     std::optional<at::MemoryFormat> fmt) {
  int saved = tl_device;
  if (device && device->has_index()) tl_device = norm_device(device->index());
  auto out = at::detail::empty_generic(size, &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                       c10::dtype_or_default(dtype), fmt);
  tl_device = saved;
  return out;
}

at::Tensor emu_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                             std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  int saved = tl_device;
  if (device && device->has_index()) tl_device = norm_device(device->index());
  auto out = at::detail::empty_strided_generic(size, stride, &g_alloc,
                                               c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                               c10::dtype_or_default(dtype));
  tl_device = saved;
  return out;
}

at::Tensor emu_copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  TORCH_CHECK(self.sizes() == dst.sizes() || self.numel() == dst.numel(), "emu copy: size mismatch");
  wait_current_stream_for_host();
  if (dst.numel() == 0) return dst;
  at::Tensor s = self.device().type() == kEmu ? cpu_view(self) : self;
  at::Tensor d = dst.device().type() == kEmu ? cpu_view(dst) : dst;
  d.copy_(s);
  return dst;
}

at::Tensor emu_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return emu_copy_from(self, dst, false);
}

const at::Tensor& emu_resize_(const at::Tensor& self, c10::IntArrayRef size,
                              std::optional<at::MemoryFormat> fmt) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  size_t need = at::detail::computeStorageNbytesContiguous(size, self.dtype().itemsize(), impl->storage_offset());
  const c10::Storage& st = impl->unsafe_storage();
  if (need > st.nbytes()) at::detail::getPrivateUse1Hooks().resizePrivateUse1Bytes(st, need);
  if (fmt) impl->empty_tensor_restride(*fmt);
  return self;
}

void emu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  wait_current_stream_for_host();  // ordered after the work already queued on the current stream
  at::native::cpu_fallback(op, stack);
}

void emu_sleep(const at::Tensor& t, int64_t ms) {
  TORCH_CHECK(t.device().type() == kEmu, "emudev.sleep: expected an emu tensor");
  int dev = t.device().index() < 0 ? tl_device : t.device().index();
  current_stream(dev)->enqueue([ms] { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); });
}

TORCH_LIBRARY(emudev, m) { m.def("sleep(Tensor self, int ms) -> ()"); }
TORCH_LIBRARY_IMPL(emudev, PrivateUse1, m) { m.impl("sleep", &emu_sleep); }

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &emu_empty);
  m.impl("empty_strided", &emu_empty_strided);
  m.impl("_copy_from", &emu_copy_from);
  m.impl("_copy_from_and_resize", &emu_copy_from_and_resize);
  m.impl("resize_", &emu_resize_);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("unfold", at::native::unfold);
}
TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&emu_fallback>()); }

// ---------------------------------------------------------------- Python jobs
void enqueue_python(py::object fn, int device, int64_t stream_id) {
  PyObject* f = fn.release().ptr();  // owned by the job
  get_stream(norm_device(device), stream_id)->enqueue([f] {
    if (!Py_IsInitialized() || py_finalizing()) return;  // never touch a dying interpreter (leak f)
    PyGILState_STATE st = PyGILState_Ensure();
    PyObject* r = PyObject_CallNoArgs(f);
    if (!r) {
      PyObject *type, *value, *tb;
      PyErr_Fetch(&type, &value, &tb);
      PyObject* s = value ? PyObject_Str(value) : nullptr;
      std::string msg = s && PyUnicode_Check(s) ? PyUnicode_AsUTF8(s) : "unknown error";
      Py_XDECREF(s);
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(tb);
      std::lock_guard<std::mutex> g(g_err_mu);
      g_errors.push_back(msg);
    }
    Py_XDECREF(r);
    Py_DECREF(f);
    PyGILState_Release(st);
  });
}

void drain_all() {
  for (EmuStream* s : streams_of(-1))
    if (tl_worker_of != s) s->synchronize();
}

// ---------------------------------------------------------------- c10d backend
// Forwards collectives to a Python object; each method returns a torch.distributed Work.
class PyForwardBackend : public c10d::Backend {
 public:
  PyForwardBackend(int rank, int size, py::object impl) : Backend(rank, size), impl_(std::move(impl)) {}
  ~PyForwardBackend() override {
    if (Py_IsInitialized() && !py_finalizing()) {
      py::gil_scoped_acquire g;
      impl_ = py::object();
    } else {
      impl_.release();
    }
  }
  const std::string getBackendName() const override { return "emu_stream"; }

  class Holder : public c10d::Work {  // keeps the Python Work object alive
   public:
    explicit Holder(py::object o) : work_(o.cast<c10::intrusive_ptr<c10d::Work>>()), py_(std::move(o)) {}
    ~Holder() override {
      if (Py_IsInitialized() && !py_finalizing()) {
        py::gil_scoped_acquire g;
        py_ = py::object();
      } else {
        py_.release();
      }
    }
    bool wait(std::chrono::milliseconds t) override { return work_->wait(t); }
    bool isCompleted() override { return work_->isCompleted(); }
    bool isSuccess() const override { return work_->isSuccess(); }
    c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }

   private:
    c10::intrusive_ptr<c10d::Work> work_;
    py::object py_;
  };

  template <typename... A>
  c10::intrusive_ptr<c10d::Work> call(const char* name, A&&... args) {
    py::gil_scoped_acquire g;
    py::object w = impl_.attr(name)(std::forward<A>(args)...);
    return c10::make_intrusive<Holder>(std::move(w));
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return call("allreduce", t, o.reduceOp);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& t,
                                                     const c10d::AllreduceCoalescedOptions& o) override {
    return call("allreduce", t, o.reduceOp);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    return call("broadcast", t, o.rootRank);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions&) override {
    return call("allgather", out, in);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions&) override {
    return call("allgather_into_tensor", out, in);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& out,
                                                std::vector<std::vector<at::Tensor>>& in,
                                                const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter", out, in, o.reduceOp);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter_tensor", out, in, o.reduceOp);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override { return call("barrier"); }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    return call("send", t, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    return call("recv", t, src, tag);
  }

 private:
  py::object impl_;
};

}  // namespace emudev

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace emudev;
  py::module_::import("torch._C._distributed_c10d");  // the Backend base class must be registered first
  m.def("cpu_view", &cpu_view, "CPU tensor aliasing an emu tensor's memory");
  m.def("enqueue_python", &enqueue_python, py::arg("fn"), py::arg("device"), py::arg("stream_id"));
  m.def("drain_all", &drain_all, py::call_guard<py::gil_scoped_release>());
  m.def("set_capturing", [](bool v) { g_capturing = v; });
  m.def("is_capturing", [] { return g_capturing.load(); });
  m.def("host_waits", [] {
    py::dict d;
    for (int k = 0; k < kNumKinds; ++k) d[kKindNames[k]] = g_waits[k].load();
    return d;
  });
  m.def("reset_host_waits", [] {
    for (auto& w : g_waits) w = 0;
  });
  m.def("take_errors", [] {
    std::lock_guard<std::mutex> g(g_err_mu);
    auto out = g_errors;
    g_errors.clear();
    return out;
  });
  m.def("device_count", &device_count);
  m.def("current_device", [] { return tl_device; });
  m.def("set_device", [](int d) { tl_device = norm_device(d); });
  py::class_<PyForwardBackend, c10d::Backend, c10::intrusive_ptr<PyForwardBackend>>(m, "PyForwardBackend")
      .def(py::init<int, int, py::object>(), py::arg("rank"), py::arg("size"), py::arg("impl"));
}
