// An emulated "npu": a PrivateUse1 backend whose device memory is host memory.
//
// Enough of an accelerator for torch's own device-generic code (torch.accelerator, DataParallel,
// parallel_apply, replicate/scatter/gather, autocast) to run unchanged on a machine without one:
// N devices with a thread-local current device and current stream, an allocator, per-device random
// generators, a handful of native kernels, and torch's CPU kernels (through the boxed CPU fallback)
// for everything else. Optionally, as a device has them: a memory capacity, an asynchronous queue (a clock per
// stream that host reads wait for, and counters of the host synchronizations each thread makes) and
// nondeterministic reductions (last bits that vary from run to run unless deterministic algorithms are asked for).
//
// Beside the backend: the device functions torch_npu's own Python runtime calls in torch_npu._C (its
// torch.npu.set_device, device, current_stream and stream run over them), and torch.npu's tensor type
// classes (torch.npu.FloatTensor, ...) made as torch and torch_npu make theirs.
// (not torch/extension.h: its C++ frontend, torch/all.h, was a third of the build's CPU and none of this file's use)
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <utility>
#include <algorithm>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/utils/wrap_outputs.h>
#include <torch/csrc/utils/tensor_new.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <unordered_set>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr auto kNpu = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 16;

std::atomic<c10::DeviceIndex> g_device_count{0};
// The thread's device, -1 until one is set, as torch_npu keeps it (NPUFunctions.cpp: `local_device`); reading the
// current device of a thread that has none makes it device 0, as there.
thread_local c10::DeviceIndex t_local_device = -1;
thread_local std::array<c10::StreamId, kMaxDevices> t_current_stream{};  // 0: the default stream
std::atomic<c10::StreamId> g_next_stream_id{1};
std::vector<at::Generator> g_generators;  // one per device, created by install()

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(
      index >= 0 && index < g_device_count.load(),
      "emulated npu: invalid device index ", static_cast<int>(index), " (",
      static_cast<int>(g_device_count.load()), " devices)");
}

c10::DeviceIndex current_device() {
  if (t_local_device < 0) {
    t_local_device = 0;
  }
  return t_local_device;
}

void set_current_device(c10::DeviceIndex device) {
  check_index(device);
  t_local_device = device;
}

c10::DeviceIndex index_or_current(std::optional<c10::Device> device) {
  if (device.has_value() && device->has_index()) {
    return device->index();
  }
  return current_device();
}

// ---------------------------------------------------------------------------------- the queue

// A device runs its work asynchronously: a kernel is queued on a stream and the host goes on, until it reads what
// the device made. The emulator keeps that as a clock per stream (off while the kernel time is 0: work is done when
// the call returns): each kernel queued on a stream (an op on npu tensors, a copy onto the device) moves the
// stream's ready time to max(now, ready) + the kernel time, and what makes the host wait for the device (a copy to
// the host, a scalar read, an op whose result the host must see, a synchronize, an event's synchronize) waits until
// the ready time of what it waits for, and is counted on the calling thread (counted with the queue off too).
// Values are computed when the op is called (host memory: they are there at once); what is emulated is which host
// reads wait, and how long.
std::atomic<int64_t> g_kernel_ns{0};
std::mutex g_queue_mutex;
std::unordered_map<int64_t, int64_t> g_ready_ns;  // (device, stream) -> the steady clock's ns when its work is done

thread_local int64_t t_host_syncs = 0;   // waits for the device this thread made
thread_local int64_t t_host_copies = 0;  // device-to-host copies (and scalar reads) this thread made
thread_local int64_t t_kernels = 0;      // kernels this thread queued (with the queue off too)
thread_local int t_kernel_depth = 0;     // inside a kernel of ours: its own copies are not the caller's reads

struct InKernel {
  InKernel() { ++t_kernel_depth; }
  ~InKernel() { --t_kernel_depth; }
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t stream_key(c10::DeviceIndex device, c10::StreamId stream) {
  return (static_cast<int64_t>(device) << 56) ^ static_cast<int64_t>(stream);
}

// Queue one kernel on the thread's current stream of `device`.
void enqueue(c10::DeviceIndex device) {
  if (t_kernel_depth == 0 && device >= 0) {
    ++t_kernels;
  }
  const int64_t kernel = g_kernel_ns.load(std::memory_order_relaxed);
  if (kernel <= 0 || device < 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_queue_mutex);
  int64_t& ready = g_ready_ns[stream_key(device, t_current_stream.at(device))];
  ready = std::max(ready, now_ns()) + kernel;
}

int64_t stream_ready(c10::DeviceIndex device, c10::StreamId stream) {
  std::lock_guard<std::mutex> lock(g_queue_mutex);
  auto found = g_ready_ns.find(stream_key(device, stream));
  return found == g_ready_ns.end() ? 0 : found->second;
}

int64_t device_ready(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(g_queue_mutex);
  int64_t latest = 0;
  for (const auto& [key, ready] : g_ready_ns) {
    if ((key >> 56) == device) {
      latest = std::max(latest, ready);
    }
  }
  return latest;
}

// The host waits for the device until `ready` (the GIL let go meanwhile, as torch's own waits do), counted.
void host_waits(int64_t ready) {
  if (t_kernel_depth > 0) {
    return;
  }
  ++t_host_syncs;
  const int64_t wait = ready - now_ns();
  if (wait <= 0) {
    return;
  }
  if (PyGILState_Check()) {
    pybind11::gil_scoped_release no_gil;
    std::this_thread::sleep_for(std::chrono::nanoseconds(wait));
  } else {
    std::this_thread::sleep_for(std::chrono::nanoseconds(wait));
  }
}

// A read of `device`'s memory by the host: a copy or a scalar, after the thread's current stream's work.
void host_reads(c10::DeviceIndex device) {
  if (t_kernel_depth > 0) {
    return;
  }
  ++t_host_copies;
  host_waits(stream_ready(device, t_current_stream.at(device)));
}

// An event: the ready time of the stream it was recorded on (0: never recorded, complete).
struct Event {
  int64_t ready = 0;
};

// ---------------------------------------------------------------------------------- nondeterministic reductions

// On a device, reductions that accumulate with atomics or pick their algorithm at run time (convolutions under
// cudnn.benchmark, backward's reductions) are not bitwise repeatable: their last bits vary from run to run. With a
// relative size set (0: off), the emulator perturbs the floating results of such kernels by up to that much of
// each element, from a generator of its own (never the job's), unless deterministic algorithms are asked for. With a
// tail (a lognormal's sigma, 0: off), each kernel's size is that times a lognormal(0, tail) draw of its own: the
// heavy-tailed spread a device's reductions show from call to call (most calls tiny, a few far larger).
std::atomic<double> g_nondeterministic{0.0};
std::atomic<double> g_tail{0.0};

const std::unordered_set<std::string>& nondeterministic_ops() {
  // (by name, every overload: structured ops reach a backend as their out= variants, sum.IntList_out say)
  static const std::unordered_set<std::string> ops = {
      "aten::convolution", "aten::convolution_backward", "aten::sum", "aten::mean", "aten::index_add",
      "aten::index_add_", "aten::scatter_add", "aten::scatter_add_", "aten::index_put_", "aten::_index_put_impl_",
      "aten::embedding_dense_backward", "aten::_embedding_bag_backward",
  };
  return ops;
}

at::Tensor host_alias(const at::Tensor& tensor);

at::Generator& jitter_generator() {
  thread_local at::Generator generator = at::detail::createCPUGenerator(std::random_device{}());
  return generator;
}

void jitter(const at::Tensor& tensor, double relative) {
  if (!tensor.defined() || tensor.device().type() != kNpu || !tensor.is_floating_point() || tensor.numel() == 0) {
    return;
  }
  const double tail = g_tail.load(std::memory_order_relaxed);
  if (tail > 0) {
    thread_local std::mt19937_64 spread_engine{std::random_device{}()};
    relative = std::min(relative * std::lognormal_distribution<double>(0.0, tail)(spread_engine), 0.5);
  }
  auto host = host_alias(tensor);
  auto noise = at::empty(host.sizes(), host.options().dtype(at::kFloat)).uniform_(-relative, relative, jitter_generator());
  host.add_(host.mul(noise.to(host.scalar_type())));
}

// Data-dependent shapes: the host must see the values before it knows the result's size.
const std::unordered_set<std::string>& host_visible_ops() {
  static const std::unordered_set<std::string> ops = {
      "aten::nonzero", "aten::masked_select", "aten::unique_consecutive", "aten::_unique2", "aten::_unique",
      "aten::unique_dim", "aten::repeat_interleave.Tensor",
  };
  return ops;
}

// ---------------------------------------------------------------------------------- memory

// Each device's memory as a device counts it: bytes allocated, their peak, and an optional capacity past which an
// allocation raises the out-of-memory error a device raises (0: host memory, unbounded).
struct MemoryStats {
  int64_t allocated = 0;
  int64_t peak = 0;
};

struct HostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex device = current_device();
    void* data = nullptr;
    if (nbytes) {
      std::lock_guard<std::mutex> lock(mutex());
      MemoryStats& stats = memory()[device];
      const int64_t limit = capacity().load();
      TORCH_CHECK_WITH(OutOfMemoryError, limit == 0 || stats.allocated + static_cast<int64_t>(nbytes) <= limit,
                       "NPU out of memory. Tried to allocate ", nbytes, " bytes on npu:", static_cast<int>(device),
                       " (", stats.allocated, " of ", limit, " bytes allocated; the emulated npu's capacity)");
      data = c10::alloc_cpu(nbytes);
      owners()[data] = {device, static_cast<int64_t>(nbytes)};
      stats.allocated += static_cast<int64_t>(nbytes);
      stats.peak = std::max(stats.peak, stats.allocated);
    }
    return {data, data, &release, c10::Device(kNpu, device)};
  }

  static void release(void* data) {
    if (data == nullptr) {
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex());
      auto found = owners().find(data);
      if (found != owners().end()) {
        memory()[found->second.first].allocated -= found->second.second;
        owners().erase(found);
      }
    }
    c10::free_cpu(data);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static c10::DeviceIndex owner_of(void* data) {
    std::lock_guard<std::mutex> lock(mutex());
    auto found = owners().find(data);
    return found == owners().end() ? current_device() : found->second.first;
  }

  // (allocated, peak) bytes of one device.
  static std::pair<int64_t, int64_t> stats(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex());
    const MemoryStats& found = memory()[device];
    return {found.allocated, found.peak};
  }

  static void reset_peak(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(mutex());
    MemoryStats& found = memory()[device];
    found.peak = found.allocated;
  }

  static std::atomic<int64_t>& capacity() {
    static std::atomic<int64_t> bytes{0};
    return bytes;
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::unordered_map<void*, std::pair<c10::DeviceIndex, int64_t>>& owners() {
    static std::unordered_map<void*, std::pair<c10::DeviceIndex, int64_t>> map;
    return map;
  }
  static std::unordered_map<c10::DeviceIndex, MemoryStats>& memory() {
    static std::unordered_map<c10::DeviceIndex, MemoryStats> map;
    return map;
  }
};

HostAllocator g_allocator;
REGISTER_ALLOCATOR(kNpu, &g_allocator);

// A CPU tensor over the same host memory as an npu tensor (no copy, no ownership: use it at once).
at::Tensor host_alias(const at::Tensor& tensor) {
  if (tensor.device().type() != kNpu) {
    return tensor;
  }
  const auto& storage = tensor.storage();
  c10::Storage host_storage(
      c10::Storage::use_byte_size_t(), storage.nbytes(),
      c10::DataPtr(const_cast<void*>(storage.data()), c10::Device(c10::kCPU)), nullptr, false);
  return at::empty({0}, tensor.options().device(c10::kCPU))
      .set_(host_storage, tensor.storage_offset(), tensor.sizes(), tensor.strides());
}

// ---------------------------------------------------------------------------------- device guard

struct NpuGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNpu; }

  c10::Device exchangeDevice(c10::Device device) const override {
    const auto previous = getDevice();
    setDevice(device);
    return previous;
  }
  c10::Device getDevice() const override { return {kNpu, current_device()}; }
  void setDevice(c10::Device device) const override { set_current_device(device.index()); }
  void uncheckedSetDevice(c10::Device device) const noexcept override { t_local_device = device.index(); }

  c10::Stream getStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::UNSAFE, device, t_current_stream.at(device.index()));
  }
  c10::Stream getDefaultStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::UNSAFE, device, 0);
  }
  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return c10::Stream(c10::Stream::UNSAFE, device, g_next_stream_id.fetch_add(1));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*isHighPriority*/) const override {
    return getNewStream(device, 0);
  }
  c10::Stream exchangeStream(c10::Stream stream) const override {
    const auto previous = getStream(stream.device());
    t_current_stream.at(stream.device_index()) = stream.id();
    return previous;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return g_device_count.load(); }

  // Events and waits over the queue's clock (see "the queue"): an event is complete once its stream's work
  // recorded before it is; synchronizing waits for it, counted as the calling thread's host synchronization.
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex /*device*/,
              const c10::EventFlag /*flag*/) const override {
    if (*event == nullptr) {
      *event = new Event();
    }
    static_cast<Event*>(*event)->ready = stream_ready(stream.device_index(), stream.id());
  }
  void destroyEvent(void* event, const c10::DeviceIndex /*device*/) const noexcept override {
    delete static_cast<Event*>(event);
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) {
      return;
    }
    std::lock_guard<std::mutex> lock(g_queue_mutex);
    int64_t& ready = g_ready_ns[stream_key(stream.device_index(), stream.id())];
    ready = std::max(ready, static_cast<Event*>(event)->ready);
  }
  bool queryEvent(void* event) const override {
    return event == nullptr || static_cast<Event*>(event)->ready <= now_ns();
  }
  bool queryStream(const c10::Stream& stream) const override {
    return stream_ready(stream.device_index(), stream.id()) <= now_ns();
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    host_waits(stream_ready(stream.device_index(), stream.id()));
  }
  void synchronizeEvent(void* event) const override {
    host_waits(event == nullptr ? 0 : static_cast<Event*>(event)->ready);
  }
  void synchronizeDevice(const c10::DeviceIndex device) const override { host_waits(device_ready(device)); }
  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/, const c10::Stream& /*stream*/) const override {}
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device*/) const override {
    const int64_t from = start == nullptr ? 0 : static_cast<Event*>(start)->ready;
    const int64_t to = end == nullptr ? 0 : static_cast<Event*>(end)->ready;
    return static_cast<double>(to - from) / 1e6;
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NpuGuardImpl);

// ---------------------------------------------------------------------------------- hooks

struct NpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_device_count.load() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex /*device*/) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return g_device_count.load(); }
  void setCurrentDevice(c10::DeviceIndex device) const override { set_current_device(device); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const auto previous = current_device();
    set_current_device(device);
    return previous;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override { return exchangeDevice(device); }

  const at::Generator& getDefaultGenerator(c10::DeviceIndex device) const override {
    const auto index = device < 0 ? current_device() : device;
    check_index(index);
    return g_generators.at(index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex /*device*/) const override {
    return at::detail::createCPUGenerator();
  }
  c10::Device getDeviceFromPtr(void* data) const override { return {kNpu, HostAllocator::owner_of(data)}; }
  bool isPinnedPtr(const void* /*data*/) const override { return false; }
  c10::Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    c10::DeviceGuard guard(storage.device());
    auto data = g_allocator.allocate(nbytes);
    const auto kept = std::min(nbytes, impl->nbytes());
    if (kept > 0) {
      std::memcpy(data.get(), impl->data(), kept);
    }
    impl->set_data_ptr_noswap(std::move(data));
    impl->set_nbytes(nbytes);
  }
};

NpuHooks g_hooks;

// ---------------------------------------------------------------------------------- kernels

constexpr c10::DispatchKeySet kNpuKeys(c10::DispatchKey::PrivateUse1);

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> /*layout*/, std::optional<at::Device> device,
                               std::optional<bool> /*pin_memory*/, std::optional<at::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(c10::Device(kNpu, index_or_current(device)));
  return at::detail::empty_generic(size, &g_allocator, kNpuKeys, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> /*layout*/, std::optional<at::Device> device,
                         std::optional<bool> /*pin_memory*/) {
  c10::DeviceGuard guard(c10::Device(kNpu, index_or_current(device)));
  return at::detail::empty_strided_generic(size, stride, &g_allocator, kNpuKeys, c10::dtype_or_default(dtype));
}

// A copy onto a device is queued on its stream; a copy to the host reads the device (a non-blocking one counted,
// waiting for nothing: the host is not told when it lands), and a blocking one waits for the queue, as torch's
// copies do on a device.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const bool from_device = self.device().type() == kNpu;
  if (dst.device().type() == kNpu) {
    enqueue(dst.device().index());
    if (!from_device && !non_blocking && t_kernel_depth == 0) {
      host_waits(stream_ready(dst.device().index(), t_current_stream.at(dst.device().index())));
    }
  } else if (from_device) {
    if (non_blocking) {
      t_host_copies += t_kernel_depth == 0 ? 1 : 0;
    } else {
      host_reads(self.device().index());
    }
  }
  InKernel in_kernel;
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  const auto nbytes = at::detail::computeStorageNbytesContiguous(size, self.dtype().itemsize(), self.storage_offset());
  if (nbytes > self.storage().nbytes()) {
    at::native::resize_bytes_nocuda(self.storage(), static_cast<int64_t>(nbytes));
  }
  if (memory_format.has_value() && *memory_format != at::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  return self;
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  host_reads(self.device().index());
  return at::_local_scalar_dense(host_alias(self));
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_storage_offset(offset);
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
  } else {
    impl->set_sizes_and_strides(size, stride);
  }
  return self;
}

at::Tensor& set_storage_whole(at::Tensor& self, c10::Storage source) {
  const int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  c10::Storage empty(c10::Storage::use_byte_size_t(), 0, g_allocator.allocate(0), &g_allocator, true);
  return set_storage(self, std::move(empty), 0, {0}, {});
}

void record_stream(at::Tensor& /*self*/, c10::Stream /*stream*/) {}

// The device an op runs on: its first npu tensor argument's (the current device where it has none).
c10::DeviceIndex op_device(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto count = op.schema().arguments().size();
  for (size_t i = stack.size() - count; i < stack.size(); ++i) {
    const auto& value = stack[i];
    if (value.isTensor() && value.toTensor().defined() && value.toTensor().device().type() == kNpu) {
      return value.toTensor().device().index();
    }
    if (value.isTensorList()) {
      for (const auto& tensor : value.toTensorList()) {
        const at::Tensor& t = tensor;
        if (t.defined() && t.device().type() == kNpu) {
          return t.device().index();
        }
      }
    }
  }
  return current_device();
}

// torch's CPU kernel for an op on npu tensors, as a kernel of the device's: queued on its stream, jittered where it
// is a nondeterministic reduction, and a host read where its result is one the host must see (a plain value, or a
// shape that depends on the values).
void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::DeviceIndex device = op_device(op, *stack);
  {
    InKernel in_kernel;
    at::native::cpu_fallback(op, stack);
  }
  enqueue(device);
  const std::string name = op.schema().name() + (op.schema().overload_name().empty() ? "" : "." + op.schema().overload_name());
  const auto returns = op.schema().returns().size();
  bool plain = false;
  for (size_t i = stack->size() - returns; i < stack->size(); ++i) {
    plain |= !(*stack)[i].isTensor() && !(*stack)[i].isTensorList() && !(*stack)[i].isNone();
  }
  if (plain || host_visible_ops().count(name)) {
    host_reads(device);
  }
  const double relative = g_nondeterministic.load(std::memory_order_relaxed);
  if (relative > 0 && !at::globalContext().deterministicAlgorithms() &&
      nondeterministic_ops().count(op.schema().name())) {
    InKernel in_kernel;
    for (size_t i = stack->size() - returns; i < stack->size(); ++i) {
      if ((*stack)[i].isTensor()) {
        jitter((*stack)[i].toTensor(), relative);
      }
    }
  }
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) { run_on_host(op, stack); }

// Random ops draw from the generator of their tensor's own device, as on a real accelerator: the
// CPU kernel runs with that device's generator passed explicitly where the call passed none.
void random_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const auto first = stack->size() - arguments.size();
  c10::DeviceIndex device = -1;
  for (size_t i = 0; i < arguments.size() && device < 0; ++i) {
    const auto& value = (*stack)[first + i];
    if (value.isTensor() && value.toTensor().defined() && value.toTensor().device().type() == kNpu) {
      device = value.toTensor().device().index();
    }
  }
  if (device >= 0) {
    for (size_t i = 0; i < arguments.size(); ++i) {
      auto& value = (*stack)[first + i];
      if (value.isNone() && arguments[i].type()->kind() == c10::TypeKind::OptionalType &&
          arguments[i].type()->castRaw<c10::OptionalType>()->getElementType()->kind() ==
              c10::TypeKind::GeneratorType) {
        value = c10::IValue(g_generators.at(device));
      }
    }
  }
  run_on_host(op, stack);
}

// torch's CPU native_dropout, written over npu tensors so that its bernoulli_ draws from the device.
std::tuple<at::Tensor, at::Tensor> native_dropout(const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0) {
    return {input, at::empty_like(input)};
  }
  if (train.has_value() && !*train) {
    return {input.clone(), at::ones_like(input, input.options().dtype(at::kBool))};
  }
  const double keep = 1. - p;
  const double scale = keep == 0 ? 0. : 1. / keep;
  auto mask = at::empty_like(input, at::MemoryFormat::Contiguous);
  mask.bernoulli_(keep);
  auto output = input.mul(mask).mul_(scale);
  return {output, mask};
}

std::unique_ptr<torch::Library> g_random_library;

// Every aten op with a CPU kernel and a `Generator?` argument gets random_fallback on npu.
void register_random_kernels() {
  g_random_library = std::make_unique<torch::Library>(
      torch::Library::IMPL, "aten", std::make_optional(c10::DispatchKey::PrivateUse1), __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) {
      continue;
    }
    auto handle = dispatcher.findOp(name);
    if (!handle.has_value() || !handle->hasSchema() || handle->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) {
      continue;
    }
    bool has_generator = false;
    for (const auto& argument : handle->schema().arguments()) {
      const auto& type = argument.type();
      has_generator |= type->kind() == c10::TypeKind::OptionalType &&
                       type->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::GeneratorType;
    }
    if (has_generator) {
      const auto op_name = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
      g_random_library->impl(op_name.c_str(), torch::CppFunction::makeFromBoxedFunction<&random_fallback>());
    }
  }
}

// ---------------------------------------------------------------------------------- npu-shadow's comparator kernel

// What a device kernel of npu-shadow's comparator computes for one pair of flat tensors, in one pass over both (the
// statistics of shadow/core/judging/compare.py, which documents them): int64[8] on the tensors' device, queued as
// one kernel. Elements are converted to `C` (float or double) chunk by chunk where their dtype is another.
template <typename C>
struct LeafStatistics {
  int64_t bitdiff = 0, bad = 0, nonfinite = 0, first = -1;
  C max_abs = 0, max_rel = 0, at_legacy = 0, at_upstream = 0;

  void add(const C* x, const C* y, int64_t count, int64_t offset, C rtol, C atol, bool equal_nan) {
    constexpr C inf = std::numeric_limits<C>::infinity();
    for (int64_t i = 0; i < count; ++i) {
      const C a = x[i], b = y[i];
      const C diff = std::abs(a - b);  // NaN where either is NaN or both are the same infinity
      const C size = std::abs(a);
      const bool close = diff - size * rtol <= atol || a == b || (equal_nan && std::isnan(a) && std::isnan(b));
      const bool finite = diff < inf;
      if (!close) {
        ++bad;
        nonfinite += !finite;
        if (first < 0) {
          first = offset + i;
          at_legacy = a;
          at_upstream = b;
        }
      }
      if (finite) {  // (errors are taken over finite differences only; 0/0 is no error, x/0 is inf)
        max_abs = std::max(max_abs, diff);
        const C rel = diff / size;
        max_rel = std::isnan(rel) ? max_rel : std::max(max_rel, rel);
      }
    }
  }
};

template <typename Bits>
int64_t count_differing(const void* x, const void* y, int64_t count) {
  const auto* a = static_cast<const Bits*>(x);
  const auto* b = static_cast<const Bits*>(y);
  int64_t differing = 0;
  for (int64_t i = 0; i < count; ++i) {
    differing += a[i] != b[i];
  }
  return differing;
}

int64_t float_bits(float value) {
  int32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

int64_t float_bits(double value) {
  int64_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

template <typename C>
std::array<int64_t, 8> leaf_statistics_of(const at::Tensor& legacy, const at::Tensor& upstream, double rtol,
                                          double atol, bool equal_nan, bool bitwise) {
  constexpr int64_t kChunk = 1 << 14;
  const auto compute = c10::CppTypeToScalarType<C>::value;
  const int64_t n = legacy.numel();
  LeafStatistics<C> found;
  const bool native = legacy.scalar_type() == compute && upstream.scalar_type() == compute;
  at::Tensor staged[2];
  if (!native) {
    for (auto& buffer : staged) {
      buffer = at::empty({std::min(n, kChunk)}, legacy.options().dtype(compute));
    }
  }
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t count = std::min(kChunk, n - start);
    const C *x, *y;
    if (native) {
      x = legacy.const_data_ptr<C>() + start;
      y = upstream.const_data_ptr<C>() + start;
    } else {
      x = staged[0].narrow(0, 0, count).copy_(legacy.narrow(0, start, count)).const_data_ptr<C>();
      y = staged[1].narrow(0, 0, count).copy_(upstream.narrow(0, start, count)).const_data_ptr<C>();
    }
    found.add(x, y, count, start, static_cast<C>(rtol), static_cast<C>(atol), equal_nan);
  }
  int64_t bitdiff = found.bad;  // (bits of different dtypes cannot be equal: what differs then is the values)
  if (bitwise) {
    const void* a = legacy.const_data_ptr();
    const void* b = upstream.const_data_ptr();
    switch (legacy.element_size()) {
      case 1: bitdiff = count_differing<uint8_t>(a, b, n); break;
      case 2: bitdiff = count_differing<uint16_t>(a, b, n); break;
      case 4: bitdiff = count_differing<uint32_t>(a, b, n); break;
      default: bitdiff = count_differing<uint64_t>(a, b, n); break;
    }
  }
  return {bitdiff, found.bad, found.nonfinite, found.first, float_bits(found.max_abs), float_bits(found.max_rel),
          float_bits(found.at_legacy), float_bits(found.at_upstream)};
}

// The comparator's statistics of flat npu tensors `legacy` and `upstream` (same device, same numel), computed in
// `double` where `wide` else in float; `bitwise`: they have the same dtype, and their bits are compared too.
at::Tensor leaf_statistics(const at::Tensor& legacy, const at::Tensor& upstream, double rtol, double atol,
                           bool equal_nan, bool bitwise, bool wide) {
  TORCH_CHECK(legacy.device().type() == kNpu && upstream.device() == legacy.device(),
              "leaf_statistics: both tensors on one npu device");
  TORCH_CHECK(legacy.dim() == 1 && upstream.numel() == legacy.numel(), "leaf_statistics: two flat tensors alike");
  TORCH_CHECK(!bitwise || legacy.element_size() == upstream.element_size(), "leaf_statistics: bits of one width");
  const c10::DeviceIndex device = legacy.device().index();
  c10::DeviceGuard guard(legacy.device());
  at::Tensor out = at::empty({8}, legacy.options().dtype(at::kLong));
  {
    InKernel in_kernel;
    const auto a = host_alias(legacy).contiguous();
    const auto b = host_alias(upstream).contiguous();
    const auto found = wide ? leaf_statistics_of<double>(a, b, rtol, atol, equal_nan, bitwise)
                            : leaf_statistics_of<float>(a, b, rtol, atol, equal_nan, bitwise);
    std::memcpy(host_alias(out).data_ptr<int64_t>(), found.data(), sizeof found);
  }
  enqueue(device);
  return out;
}

// ---------------------------------------------------------------------------------- Python API

void install(int64_t devices, uint64_t seed) {
  TORCH_CHECK(devices >= 1 && devices <= kMaxDevices, "emulated npu: devices must be 1..", kMaxDevices);
  static std::once_flag once;
  const auto existing = g_device_count.load();
  TORCH_CHECK(existing == 0 || existing == devices, "emulated npu: already installed with ", static_cast<int>(existing),
              " devices, asked for ", devices, " (one count per process)");
  std::call_once(once, [&] {
    for (int64_t i = 0; i < devices; ++i) {
      g_generators.push_back(at::detail::createCPUGenerator(seed));
    }
    g_device_count.store(static_cast<c10::DeviceIndex>(devices));
    at::RegisterPrivateUse1HooksInterface(&g_hooks);
    register_random_kernels();
  });
}

at::Generator& generator(int64_t device) {
  check_index(static_cast<c10::DeviceIndex>(device));
  return g_generators.at(device);
}

at::Tensor get_rng_state(int64_t device) {
  auto& gen = generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const at::Tensor& state, int64_t device) {
  auto& gen = generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

void manual_seed(uint64_t seed, int64_t device) {
  auto& gen = generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

uint64_t initial_seed(int64_t device) { return generator(device).current_seed(); }

// ---------------------------------------------------------------------------------- torch_npu._C's device functions

// torch_npu's _npu_getDeviceWithoutSet and _npu_getLocalDevice: the thread's device, -1 when it has none.
int64_t local_device() { return t_local_device; }

// torch_npu's _npu_maybeExchangeDevice: make `device` current, return the device the thread had (-1: none).
int64_t maybe_exchange_device(int64_t device) {
  const int64_t previous = t_local_device;
  if (device != previous) {
    set_current_device(static_cast<c10::DeviceIndex>(device));
  }
  return previous;
}

// ---------------------------------------------------------------------------------- tensor type classes

// torch.npu.FloatTensor and its kin, made as torch makes torch.FloatTensor: each class is an instance of a
// metaclass (named torch.tensortype, as torch's) whose isinstance asks a tensor's backend and dtype, whose call
// builds a tensor on the current npu, and whose dtype, layout, is_npu and is_sparse describe it; the class
// carries torch.Tensor's methods. They are static types: made once, never freed.
struct TensorTypeClass {
  PyTypeObject type;
  at::ScalarType scalar_type;
  char name[64];
};

PyObject* tensor_type_instancecheck(PyObject* self, PyObject* arg) {
  HANDLE_TH_ERRORS
  const auto* cls = reinterpret_cast<TensorTypeClass*>(self);
  if (THPVariable_Check(arg)) {
    const auto& tensor = THPVariable_Unpack(arg);
    if (c10::legacyExtractDispatchKey(tensor.key_set()) == c10::DispatchKey::PrivateUse1 &&
        tensor.scalar_type() == cls->scalar_type) {
      Py_RETURN_TRUE;
    }
  }
  Py_RETURN_FALSE;
  END_HANDLE_TH_ERRORS
}

PyObject* tensor_type_dtype(PyObject* self, void* /*unused*/) {
  return torch::autograd::utils::wrap(torch::getTHPDtype(reinterpret_cast<TensorTypeClass*>(self)->scalar_type));
}
PyObject* tensor_type_layout(PyObject* /*self*/, void* /*unused*/) {
  return torch::autograd::utils::wrap(torch::getTHPLayout(at::Layout::Strided));
}
PyObject* tensor_type_true(PyObject* /*self*/, void* /*unused*/) { Py_RETURN_TRUE; }
PyObject* tensor_type_false(PyObject* /*self*/, void* /*unused*/) { Py_RETURN_FALSE; }

PyMethodDef tensor_type_methods[] = {
    {"__instancecheck__", tensor_type_instancecheck, METH_O, nullptr},
    {nullptr, nullptr, 0, nullptr}};
PyGetSetDef tensor_type_properties[] = {
    {"dtype", tensor_type_dtype, nullptr, nullptr, nullptr},
    {"layout", tensor_type_layout, nullptr, nullptr, nullptr},
    {"is_npu", tensor_type_true, nullptr, nullptr, nullptr},
    {"is_sparse", tensor_type_false, nullptr, nullptr, nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject g_tensor_type_metaclass = {PyVarObject_HEAD_INIT(nullptr, 0) "torch.tensortype", sizeof(PyTypeObject)};

PyObject* tensor_type_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(g_device_count.load() > 0, "type ", type->tp_name, " not available: no emulated npu devices");
  const auto scalar_type = reinterpret_cast<TensorTypeClass*>(type)->scalar_type;
  return THPVariable_Wrap(torch::utils::legacy_tensor_ctor(c10::DispatchKey::PrivateUse1, scalar_type, args, kwargs));
  END_HANDLE_TH_ERRORS
}

// {"FloatTensor": torch.npu.FloatTensor, ...} for the (name, dtype) pairs given, the classes living in `module`
// ("torch.npu"); made on the first call, the same classes on every later one.
py::dict tensor_type_classes(const std::string& module, const std::vector<std::pair<std::string, py::object>>& types) {
  static std::mutex mutex;
  static std::vector<TensorTypeClass*> made;  // (never freed: Python may hold the classes to its very end)
  std::lock_guard<std::mutex> lock(mutex);
  if (made.empty()) {
    g_tensor_type_metaclass.tp_flags = Py_TPFLAGS_DEFAULT;
    g_tensor_type_metaclass.tp_methods = tensor_type_methods;
    g_tensor_type_metaclass.tp_getset = tensor_type_properties;
    g_tensor_type_metaclass.tp_base = &PyType_Type;
    if (PyType_Ready(&g_tensor_type_metaclass) < 0) {
      throw py::error_already_set();
    }
    auto* tensor = reinterpret_cast<PyTypeObject*>(py::module_::import("torch").attr("Tensor").ptr());
    py::dict methods;  // torch.Tensor's and its C base's, as torch's own tensor type classes carry
    if (PyDict_Merge(methods.ptr(), tensor->tp_base->tp_dict, 1) < 0 || PyDict_Merge(methods.ptr(), tensor->tp_dict, 1) < 0) {
      throw py::error_already_set();
    }
    for (const auto& [name, dtype] : types) {
      TORCH_CHECK_TYPE(THPDtype_Check(dtype.ptr()), "tensor_type_classes: ", name, " needs a torch.dtype");
      auto* cls = new TensorTypeClass();  // (zeroed)
      Py_SET_TYPE(&cls->type, &g_tensor_type_metaclass);
      Py_SET_REFCNT(&cls->type, 1);
      std::snprintf(cls->name, sizeof(cls->name), "%s.%s", module.c_str(), name.c_str());
      cls->scalar_type = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
      cls->type.tp_name = cls->name;  // what torch's Tensor.type(cls) reads
      cls->type.tp_basicsize = sizeof(PyObject);
      cls->type.tp_flags = Py_TPFLAGS_DEFAULT;  // not subclassable, as torch's own
      cls->type.tp_new = tensor_type_new;
      if (PyType_Ready(&cls->type) < 0 || PyDict_Merge(cls->type.tp_dict, methods.ptr(), 0) < 0) {
        throw py::error_already_set();
      }
      Py_INCREF(&g_tensor_type_metaclass);
      made.push_back(cls);
    }
  }
  py::dict classes;
  for (const auto* cls : made) {
    const std::string full(cls->name);
    classes[py::str(full.substr(full.rfind('.') + 1))] =
        py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(const_cast<PyTypeObject*>(&cls->type)));
  }
  return classes;
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("resize_", resize_);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_storage_whole);
  m.impl("set_.source_Tensor", set_tensor);
  m.impl("set_", set_empty);
  m.impl("record_stream", record_stream);
  m.impl("native_dropout", native_dropout);
  // Composite on other backends, they end in convolution_overrideable here: run the CPU kernels instead.
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
  m.impl("convolution_backward", torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>()); }

// The autograd engine runs one thread per device of every accelerator, npu's included. Left alone, they are
// woken only by the engine's static destructor, after the interpreter is gone; one that then touches Python is
// force-unwound through a noexcept frame and the process aborts ("terminate called without an active
// exception"). Stopped at exit while the interpreter is alive (the GIL released, so they can finish), they end
// cleanly. A later backward in the same process would start them again.
void stop_autograd_threads() {
  pybind11::gil_scoped_release no_gil;
  torch::autograd::Engine::get_default_engine().stop();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stop_autograd_threads", &stop_autograd_threads, "Stop the autograd engine's device threads (at exit).");
  m.def("install", &install, "Register the emulated devices (once per process).");
  m.def("device_count", [] { return static_cast<int64_t>(g_device_count.load()); });
  m.def("get_rng_state", &get_rng_state);
  m.def("tensor_type_classes", &tensor_type_classes, "torch.npu's tensor type classes (made on the first call).");
  m.def("local_device", &local_device, "The thread's npu device, -1 when it has none.");
  m.def("current_device", [] { return static_cast<int64_t>(current_device()); }, "The thread's device (0 if none).");
  m.def("set_device", [](int64_t device) { set_current_device(static_cast<c10::DeviceIndex>(device)); });
  m.def("maybe_exchange_device", &maybe_exchange_device, "Make a device current; return the thread's previous.");
  m.def("set_rng_state", &set_rng_state);
  m.def("set_memory_capacity", [](int64_t bytes) { HostAllocator::capacity().store(bytes); },
        "Each device's capacity in bytes (0: host memory, unbounded).");
  m.def("memory_capacity", [] { return HostAllocator::capacity().load(); });
  m.def("memory_stats", [](int64_t device) { return HostAllocator::stats(static_cast<c10::DeviceIndex>(device)); },
        "(allocated, peak) bytes of one device.");
  m.def("reset_peak_memory_stats",
        [](int64_t device) { HostAllocator::reset_peak(static_cast<c10::DeviceIndex>(device)); });
  m.def("set_kernel_time", [](double seconds) { g_kernel_ns.store(static_cast<int64_t>(seconds * 1e9)); },
        "The device time each queued kernel takes (0: work is done when the call returns).");
  m.def("kernel_time", [] { return static_cast<double>(g_kernel_ns.load()) / 1e9; });
  m.def("host_syncs", [] { return std::make_pair(t_host_syncs, t_host_copies); },
        "(host synchronizations, device-to-host copies) this thread made.");
  m.def("kernels", [] { return t_kernels; }, "The kernels this thread queued on the devices.");
  m.def("set_nondeterministic", [](double relative) { g_nondeterministic.store(relative); },
        "The relative size of nondeterministic reductions' variation (0: off).");
  m.def("nondeterministic", [] { return g_nondeterministic.load(); });
  m.def("set_tail", [](double sigma) { g_tail.store(sigma); },
        "The sigma of the lognormal spread of each nondeterministic kernel's size (0: off).");
  m.def("manual_seed", &manual_seed);
  m.def("initial_seed", &initial_seed);
  m.def("leaf_statistics", &leaf_statistics,
        "npu-shadow's comparator statistics of two flat npu tensors, int64[8] on their device (one queued kernel).");
}
