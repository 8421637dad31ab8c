// The native launch path of a launch plan (native.py): a run's allocations and kernel launches in
// one call from Python, and the tensor part of a call's plan signature.
//
// A `Program` is built once per plan from plain data: the allocations (shape, dtype), contiguous
// views into them, and per kernel its CUfunction, grid, block, shared memory and a parameter
// template in which the run fills tensor addresses and TMA descriptors. The parameter layout is
// that of Triton's launchers: each non-constexpr argument of the expanded signature, then the
// global and profile scratch pointers (both null: native.py declines kernels that need scratch).
//
// No CUDA header is needed to build this file: the driver entry points it calls are declared here
// and found in libcuda when the first program runs, so a CPU machine builds and tests it too.

#include <Python.h>
#include <dlfcn.h>

#include <ATen/ops/empty.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
using CUcontext = void*;
using CUdevice = int;
using LaunchKernelFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    CUstream, void**, void**);
using ErrorStringFn = CUresult (*)(CUresult, const char**);
using CtxGetCurrentFn = CUresult (*)(CUcontext*);
using DeviceGetFn = CUresult (*)(CUdevice*, int);
using PrimaryCtxRetainFn = CUresult (*)(CUcontext*, CUdevice);
using CtxSetCurrentFn = CUresult (*)(CUcontext);
using CtxGetDeviceFn = CUresult (*)(CUdevice*);
using CUgraph = void*;
using CUgraphNode = void*;
using CUgraphExec = void*;
struct KernelNodeParams {  // CUDA_KERNEL_NODE_PARAMS (v1), what the unversioned entry points take
  CUfunction func;
  unsigned grid_x, grid_y, grid_z;
  unsigned block_x, block_y, block_z;
  unsigned shared;
  void** params;
  void** extra;
};
using GraphCreateFn = CUresult (*)(CUgraph*, unsigned);
using GraphAddKernelNodeFn = CUresult (*)(CUgraphNode*, CUgraph, const CUgraphNode*, size_t, const KernelNodeParams*);
using GraphInstantiateFn = CUresult (*)(CUgraphExec*, CUgraph, unsigned long long);
using GraphExecSetParamsFn = CUresult (*)(CUgraphExec, CUgraphNode, const KernelNodeParams*);
using GraphLaunchFn = CUresult (*)(CUgraphExec, CUstream);
using GraphDestroyFn = CUresult (*)(CUgraph);
using GraphExecDestroyFn = CUresult (*)(CUgraphExec);
using StreamIsCapturingFn = CUresult (*)(CUstream, int*);
using TensorMapReplaceAddressFn = CUresult (*)(void*, void*);

LaunchKernelFn launch_kernel = nullptr;
ErrorStringFn error_string = nullptr;
CtxGetCurrentFn ctx_get_current = nullptr;
DeviceGetFn device_get = nullptr;
PrimaryCtxRetainFn primary_ctx_retain = nullptr;
CtxSetCurrentFn ctx_set_current = nullptr;
CtxGetDeviceFn ctx_get_device = nullptr;
GraphCreateFn graph_create = nullptr;
GraphAddKernelNodeFn graph_add_kernel_node = nullptr;
GraphInstantiateFn graph_instantiate = nullptr;
GraphExecSetParamsFn graph_exec_set_params = nullptr;
GraphLaunchFn graph_launch = nullptr;
GraphDestroyFn graph_destroy = nullptr;
GraphExecDestroyFn graph_exec_destroy = nullptr;
StreamIsCapturingFn stream_is_capturing = nullptr;
TensorMapReplaceAddressFn tensor_map_replace_address = nullptr;  // a map of an allocation, moved to this run's
bool graphs_enabled = false;  // a run of several kernels as one graph launch (`run_as_graph`)

constexpr size_t kDescriptorBytes = 128;      // sizeof(CUtensorMap)
constexpr size_t kMaxParamBytes = 2048;       // far above any kernel of ours (the TMA forward: ~700)
constexpr size_t kMaxParams = 128;            // the widest of ours: about 70
constexpr size_t kMaxKernels = 8;             // a run launches up to 4
constexpr size_t kMaxInputs = 16;
constexpr size_t kDescriptorCacheSize = 64;   // base addresses kept per kernel: a loop cycles through a few

bool load_driver() {
  if (launch_kernel != nullptr) return true;
  void* handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "native launch: libcuda.so.1 could not be loaded");
    return false;
  }
  error_string = reinterpret_cast<ErrorStringFn>(dlsym(handle, "cuGetErrorString"));
  ctx_get_current = reinterpret_cast<CtxGetCurrentFn>(dlsym(handle, "cuCtxGetCurrent"));
  device_get = reinterpret_cast<DeviceGetFn>(dlsym(handle, "cuDeviceGet"));
  primary_ctx_retain = reinterpret_cast<PrimaryCtxRetainFn>(dlsym(handle, "cuDevicePrimaryCtxRetain"));
  ctx_set_current = reinterpret_cast<CtxSetCurrentFn>(dlsym(handle, "cuCtxSetCurrent"));
  ctx_get_device = reinterpret_cast<CtxGetDeviceFn>(dlsym(handle, "cuCtxGetDevice"));
  auto launch = reinterpret_cast<LaunchKernelFn>(dlsym(handle, "cuLaunchKernel"));
  if (launch == nullptr || ctx_get_current == nullptr || device_get == nullptr || primary_ctx_retain == nullptr ||
      ctx_set_current == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "native launch: libcuda lacks a driver entry point this path calls");
    return false;
  }
  graph_create = reinterpret_cast<GraphCreateFn>(dlsym(handle, "cuGraphCreate"));
  graph_add_kernel_node = reinterpret_cast<GraphAddKernelNodeFn>(dlsym(handle, "cuGraphAddKernelNode"));
  graph_instantiate = reinterpret_cast<GraphInstantiateFn>(dlsym(handle, "cuGraphInstantiateWithFlags"));
  graph_exec_set_params = reinterpret_cast<GraphExecSetParamsFn>(dlsym(handle, "cuGraphExecKernelNodeSetParams"));
  graph_launch = reinterpret_cast<GraphLaunchFn>(dlsym(handle, "cuGraphLaunch"));
  graph_destroy = reinterpret_cast<GraphDestroyFn>(dlsym(handle, "cuGraphDestroy"));
  graph_exec_destroy = reinterpret_cast<GraphExecDestroyFn>(dlsym(handle, "cuGraphExecDestroy"));
  stream_is_capturing = reinterpret_cast<StreamIsCapturingFn>(dlsym(handle, "cuStreamIsCapturing"));
  tensor_map_replace_address =
      reinterpret_cast<TensorMapReplaceAddressFn>(dlsym(handle, "cuTensorMapReplaceAddress"));
  const char* graphs = std::getenv("DMATTN_BENCH_LAUNCH_GRAPHS");  // "0": each kernel launched on its own
  graphs_enabled = (graphs == nullptr || std::strcmp(graphs, "0") != 0) && graph_create && graph_add_kernel_node &&
                   graph_instantiate && graph_exec_set_params && graph_launch && graph_destroy &&
                   graph_exec_destroy && stream_is_capturing;
  launch_kernel = launch;
  return true;
}

// The calling thread's context, made the device's primary one where the thread has none yet (as
// Triton's launchers do before each launch: a thread's first CUDA work may be this launch).
CUresult ensure_context(int device) {
  CUcontext context = nullptr;
  CUresult status = ctx_get_current(&context);
  if (status != 0 || context != nullptr) return status;
  CUdevice handle;
  if ((status = device_get(&handle, device)) != 0) return status;
  if ((status = primary_ctx_retain(&context, handle)) != 0) return status;
  return ctx_set_current(context);
}

// Whether the calling thread's current context is `device`'s (or none is current: the run makes
// it so). A program's kernels are loaded in its device's context and it launches on the current
// device's stream, so a call whose tensors are on another device takes the Python path, whose
// launchers switch devices or launch on the current one as they always did.
bool device_is_current(int device) {
  CUcontext context = nullptr;
  if (ctx_get_current(&context) != 0) return false;
  if (context == nullptr) return true;
  CUdevice current = -1, wanted = -1;
  return ctx_get_device != nullptr && ctx_get_device(&current) == 0 && device_get(&wanted, device) == 0 &&
         current == wanted;
}

// Where a tensor address in a kernel's parameters comes from.
enum Source : int { kInput = 0, kAllocation = 1 };

struct PointerSlot {
  size_t offset;  // in the parameter template
  int source;
  int index;      // input or allocation
  int64_t add;    // bytes past the tensor's address (a part of a workspace)
};

struct DescriptorSlot {  // a tensor map of an input or allocation
  size_t offset;
  int source;
  int index;
};

struct Kernel {
  CUfunction function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 32;
  unsigned shared = 0;
  std::vector<char> params;     // the template: scalars in place
  std::vector<size_t> offsets;  // of each parameter
  std::vector<PointerSlot> pointers;
  std::vector<DescriptorSlot> descriptors;
  PyObject* encode = nullptr;   // (inputs, allocations) -> a CUtensorMap object per descriptor slot, on a miss
  std::vector<std::pair<std::vector<uint64_t>, std::vector<char>>> encoded;  // addresses -> descriptors
};

struct Allocation {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

struct View {  // a contiguous view of an allocation
  int allocation;
  int64_t offset;  // in elements of `dtype`
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  at::ScalarType dtype;
};

struct Program {
  // a run of several kernels as one graph launch: built by the first, its nodes' parameters
  // replaced by each later one under the lock (the launches let other threads in)
  std::mutex graph_lock;
  CUgraph graph = nullptr;
  CUgraphExec graph_exec = nullptr;
  std::vector<CUgraphNode> nodes;
  std::vector<std::vector<char>> node_bytes;  // each node's parameters, as last set
  bool graph_failed = false;
  int device = 0;
  size_t num_inputs = 0;
  std::vector<Allocation> allocations;
  std::vector<View> views;
  std::vector<Kernel> kernels;
  std::vector<size_t> launched;  // the kernels a run launches: those of a non-empty grid, in order
  std::vector<int> returns;  // indices into allocations then views; -1: None
  ~Program() {
    if (graph_exec != nullptr) graph_exec_destroy(graph_exec);
    if (graph != nullptr) graph_destroy(graph);
    for (Kernel& kernel : kernels) Py_XDECREF(kernel.encode);
  }
};

constexpr const char* kCapsuleName = "dmattn_native.Program";

// -- reading Python values ---------------------------------------------------------------------

bool as_int64_list(PyObject* obj, std::vector<int64_t>& out) {
  PyObject* fast = PySequence_Fast(obj, "expected a sequence of ints");
  if (fast == nullptr) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (out[i] == -1 && PyErr_Occurred()) break;
  }
  Py_DECREF(fast);
  return !PyErr_Occurred();
}

bool as_dtype(PyObject* obj, at::ScalarType& out) {
  if (!THPDtype_Check(obj)) {
    PyErr_SetString(PyExc_TypeError, "native launch: expected a torch.dtype");
    return false;
  }
  out = reinterpret_cast<THPDtype*>(obj)->scalar_type;
  return true;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i] > 1 ? shape[i] : 1;
  }
  return strides;
}

// The 128 bytes of a tensor map: a `bytes` of that length (the CUDA backend's encoder), or a
// Triton `PyCUtensorMap`, whose PyObject head is followed by the map at a 128-byte alignment
// (driver.c's PyCUtensorMapObject), so the map is the last 128 bytes of the object.
bool descriptor_bytes(PyObject* obj, char* out) {
  if (PyBytes_CheckExact(obj) && PyBytes_GET_SIZE(obj) == static_cast<Py_ssize_t>(kDescriptorBytes)) {
    std::memcpy(out, PyBytes_AS_STRING(obj), kDescriptorBytes);
    return true;
  }
  PyTypeObject* type = Py_TYPE(obj);
  if (std::strcmp(type->tp_name, "triton.backends.nvidia.PyCUtensorMap") != 0 ||
      type->tp_basicsize != 2 * static_cast<Py_ssize_t>(kDescriptorBytes)) {
    PyErr_Format(PyExc_TypeError, "native launch: expected 128 bytes or Triton's PyCUtensorMap, got %s", type->tp_name);
    return false;
  }
  std::memcpy(out, reinterpret_cast<char*>(obj) + kDescriptorBytes, kDescriptorBytes);
  return true;
}

// -- building a program --------------------------------------------------------------------------

// kernel: (function, (gx, gy, gz), block, shared, params bytes, offsets, pointer slots
//          [(offset, source, index, add)], descriptor slots [(offset, source, index)], encode or None)
bool read_kernel(PyObject* spec, Kernel& kernel) {
  unsigned long long function;
  unsigned gx, gy, gz, block, shared;
  PyObject *params, *offsets, *pointers, *descriptors, *encode;
  if (!PyArg_ParseTuple(spec, "K(III)IIOOOOO", &function, &gx, &gy, &gz, &block, &shared, &params, &offsets,
                        &pointers, &descriptors, &encode)) {
    return false;
  }
  kernel.function = reinterpret_cast<CUfunction>(function);
  kernel.grid[0] = gx, kernel.grid[1] = gy, kernel.grid[2] = gz;
  kernel.block = block, kernel.shared = shared;
  char* data;
  Py_ssize_t size;
  if (PyBytes_AsStringAndSize(params, &data, &size) != 0) return false;
  if (static_cast<size_t>(size) > kMaxParamBytes) {
    PyErr_SetString(PyExc_ValueError, "native launch: parameters over kMaxParamBytes");
    return false;
  }
  kernel.params.assign(data, data + size);
  std::vector<int64_t> values;
  if (!as_int64_list(offsets, values)) return false;
  if (values.size() > kMaxParams) {
    PyErr_SetString(PyExc_ValueError, "native launch: more parameters than kMaxParams");
    return false;
  }
  for (int64_t offset : values) {
    if (offset < 0 || static_cast<Py_ssize_t>(offset) >= size) {
      PyErr_SetString(PyExc_ValueError, "native launch: a parameter offset outside the template");
      return false;
    }
    kernel.offsets.push_back(static_cast<size_t>(offset));
  }
  PyObject* fast = PySequence_Fast(pointers, "pointer slots");
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    PointerSlot slot;
    long long offset, add;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "LiiL", &offset, &slot.source, &slot.index, &add)) {
      Py_DECREF(fast);
      return false;
    }
    if (offset < 0 || offset + 8 > size) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_ValueError, "native launch: a pointer slot outside the template");
      return false;
    }
    slot.offset = static_cast<size_t>(offset), slot.add = add;
    kernel.pointers.push_back(slot);
  }
  Py_DECREF(fast);
  fast = PySequence_Fast(descriptors, "descriptor slots");
  if (fast == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    DescriptorSlot slot;
    long long offset;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "Lii", &offset, &slot.source, &slot.index)) {
      Py_DECREF(fast);
      return false;
    }
    if (offset < 0 || offset + static_cast<long long>(kDescriptorBytes) > size) {
      Py_DECREF(fast);
      PyErr_SetString(PyExc_ValueError, "native launch: a descriptor slot outside the template");
      return false;
    }
    slot.offset = static_cast<size_t>(offset);
    kernel.descriptors.push_back(slot);
  }
  Py_DECREF(fast);
  if (!kernel.descriptors.empty()) {
    if (!PyCallable_Check(encode)) {
      PyErr_SetString(PyExc_TypeError, "native launch: descriptor slots need an encode callable");
      return false;
    }
    Py_INCREF(encode);
    kernel.encode = encode;
  }
  return true;
}

void free_program(PyObject* capsule) {
  delete static_cast<Program*>(PyCapsule_GetPointer(capsule, kCapsuleName));
}

// program(device, num_inputs, allocations [(shape, dtype)], views [(allocation, offset, shape,
//         dtype)], kernels [...], returns [index]) -> capsule
PyObject* program(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  int device;
  Py_ssize_t num_inputs;
  PyObject *allocations, *views, *kernels, *returns;
  if (!PyArg_ParseTuple(args, "inOOOO", &device, &num_inputs, &allocations, &views, &kernels, &returns)) {
    return nullptr;
  }
  auto built = std::make_unique<Program>();
  built->device = device;
  built->num_inputs = static_cast<size_t>(num_inputs);
  bool ok = built->num_inputs <= kMaxInputs;
  if (!ok) PyErr_SetString(PyExc_ValueError, "native launch: more inputs than kMaxInputs");
  PyObject* fast = ok ? PySequence_Fast(allocations, "allocations") : nullptr;
  ok = fast != nullptr;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fast); ++i) {
    PyObject *shape, *dtype;
    Allocation allocation;
    ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "OO", &shape, &dtype) &&
         as_int64_list(shape, allocation.shape) && as_dtype(dtype, allocation.dtype);
    if (ok) built->allocations.push_back(std::move(allocation));
  }
  Py_XDECREF(fast);
  fast = ok ? PySequence_Fast(views, "views") : nullptr;
  ok = ok && fast != nullptr;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fast); ++i) {
    PyObject *shape, *dtype;
    View view;
    long long offset;
    ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "iLOO", &view.allocation, &offset, &shape, &dtype) &&
         as_int64_list(shape, view.shape) && as_dtype(dtype, view.dtype);
    if (ok && (view.allocation < 0 || static_cast<size_t>(view.allocation) >= built->allocations.size())) {
      PyErr_SetString(PyExc_ValueError, "native launch: a view of no allocation");
      ok = false;
    }
    if (ok) {
      view.offset = offset;
      view.strides = contiguous_strides(view.shape);
      built->views.push_back(std::move(view));
    }
  }
  Py_XDECREF(fast);
  fast = ok ? PySequence_Fast(kernels, "kernels") : nullptr;
  ok = ok && fast != nullptr;
  if (ok && static_cast<size_t>(PySequence_Fast_GET_SIZE(fast)) > kMaxKernels) {
    PyErr_SetString(PyExc_ValueError, "native launch: more kernels than kMaxKernels");
    ok = false;
  }
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fast); ++i) {
    built->kernels.emplace_back();
    ok = read_kernel(PySequence_Fast_GET_ITEM(fast, i), built->kernels.back());
    auto sourced = [&](int source, int index) {
      size_t limit = source == kInput ? built->num_inputs : built->allocations.size();
      return (source == kInput || source == kAllocation) && index >= 0 && static_cast<size_t>(index) < limit;
    };
    for (const PointerSlot& slot : ok ? built->kernels.back().pointers : std::vector<PointerSlot>{}) {
      if (!sourced(slot.source, slot.index)) {
        PyErr_SetString(PyExc_ValueError, "native launch: a pointer slot reads no input or allocation");
        ok = false;
      }
    }
    for (const DescriptorSlot& slot : ok ? built->kernels.back().descriptors : std::vector<DescriptorSlot>{}) {
      if (!sourced(slot.source, slot.index)) {
        PyErr_SetString(PyExc_ValueError, "native launch: a descriptor slot reads no input or allocation");
        ok = false;
      }
    }
  }
  Py_XDECREF(fast);
  for (size_t i = 0; ok && i < built->kernels.size(); ++i) {
    const unsigned* grid = built->kernels[i].grid;
    if (grid[0] * grid[1] * grid[2] != 0) built->launched.push_back(i);
  }
  std::vector<int64_t> indices;
  ok = ok && as_int64_list(returns, indices);
  for (int64_t index : ok ? indices : std::vector<int64_t>{}) {
    if (index < -1 || index >= static_cast<int64_t>(built->allocations.size() + built->views.size())) {
      PyErr_SetString(PyExc_ValueError, "native launch: a return of no allocation or view");
      ok = false;
    }
    built->returns.push_back(static_cast<int>(index));
  }
  if (!ok) return nullptr;
  PyObject* capsule = PyCapsule_New(built.get(), kCapsuleName, free_program);
  if (capsule != nullptr) built.release();  // the capsule owns it now
  return capsule;
  END_HANDLE_TH_ERRORS
}

// -- running a program ---------------------------------------------------------------------------

// Whether the maps of allocations are moved to each run's allocation by the driver, not encoded
// anew: `pack` (no driver) and a driver without the entry point encode them per address.
bool moves_allocation_maps(bool launch) { return launch && tensor_map_replace_address != nullptr; }

// This run's address of input or allocation `index` (a pointer or descriptor slot's source).
uint64_t source_address(int source, int index, const std::array<uint64_t, kMaxInputs>& addresses,
                        const std::vector<at::Tensor>& allocated) {
  return source == kInput ? addresses[index] : reinterpret_cast<uint64_t>(allocated[index].data_ptr());
}

// The kernel's descriptors for this run's addresses: cached, else encoded by Python. A run's
// allocations are new, so where their maps are moved (`moves_allocation_maps`) the key holds the
// inputs' addresses only and the caller moves those maps.
const char* descriptors_for(Kernel& kernel, PyObject* const* inputs, size_t num_inputs,
                            const std::array<uint64_t, kMaxInputs>& addresses,
                            const std::vector<at::Tensor>& allocated, bool launch) {
  std::vector<uint64_t> key;
  key.reserve(kernel.descriptors.size());
  for (const DescriptorSlot& slot : kernel.descriptors) {
    bool moved = slot.source == kAllocation && moves_allocation_maps(launch);
    key.push_back(moved ? 0 : source_address(slot.source, slot.index, addresses, allocated));
  }
  for (const auto& entry : kernel.encoded) {
    if (entry.first == key) return entry.second.data();
  }
  PyObject* given = PyTuple_New(static_cast<Py_ssize_t>(num_inputs));
  PyObject* made = PyTuple_New(static_cast<Py_ssize_t>(allocated.size()));
  if (given == nullptr || made == nullptr) {
    Py_XDECREF(given);
    Py_XDECREF(made);
    return nullptr;
  }
  for (size_t i = 0; i < num_inputs; ++i) {
    Py_INCREF(inputs[i]);
    PyTuple_SET_ITEM(given, i, inputs[i]);
  }
  for (size_t i = 0; i < allocated.size(); ++i) {
    PyObject* tensor = THPVariable_Wrap(allocated[i]);
    if (tensor == nullptr) {
      Py_DECREF(given);
      Py_DECREF(made);
      return nullptr;
    }
    PyTuple_SET_ITEM(made, i, tensor);
  }
  PyObject* maps = PyObject_CallFunctionObjArgs(kernel.encode, given, made, nullptr);
  Py_DECREF(given);
  Py_DECREF(made);
  if (maps == nullptr) return nullptr;
  PyObject* fast = PySequence_Fast(maps, "encode must return a sequence");
  Py_DECREF(maps);
  if (fast == nullptr) return nullptr;
  if (PySequence_Fast_GET_SIZE(fast) != static_cast<Py_ssize_t>(kernel.descriptors.size())) {
    Py_DECREF(fast);
    PyErr_SetString(PyExc_ValueError, "native launch: encode returned the wrong number of descriptors");
    return nullptr;
  }
  std::vector<char> bytes(kernel.descriptors.size() * kDescriptorBytes);
  for (size_t i = 0; i < kernel.descriptors.size(); ++i) {
    if (!descriptor_bytes(PySequence_Fast_GET_ITEM(fast, i), bytes.data() + i * kDescriptorBytes)) {
      Py_DECREF(fast);
      return nullptr;
    }
  }
  Py_DECREF(fast);
  if (kernel.encoded.size() >= kDescriptorCacheSize) kernel.encoded.clear();
  kernel.encoded.emplace_back(std::move(key), std::move(bytes));
  return kernel.encoded.back().second.data();
}

// Fills `storage` with `kernel`'s parameters for this run; `params` points at each.
bool fill_params(Kernel& kernel, PyObject* const* inputs, size_t num_inputs,
                 const std::array<uint64_t, kMaxInputs>& addresses, const std::vector<at::Tensor>& allocated,
                 bool launch, char* storage, void** params) {
  std::memcpy(storage, kernel.params.data(), kernel.params.size());
  for (const PointerSlot& slot : kernel.pointers) {
    uint64_t address = source_address(slot.source, slot.index, addresses, allocated);
    if (slot.source == kInput && address == 0 && inputs[slot.index] == Py_None) {
      PyErr_Format(PyExc_TypeError, "native launch: input %d is None where the kernel reads a tensor", slot.index);
      return false;
    }
    address += static_cast<uint64_t>(slot.add);
    std::memcpy(storage + slot.offset, &address, sizeof(address));
  }
  if (!kernel.descriptors.empty()) {
    const char* maps = descriptors_for(kernel, inputs, num_inputs, addresses, allocated, launch);
    if (maps == nullptr) return false;
    for (size_t i = 0; i < kernel.descriptors.size(); ++i) {
      const DescriptorSlot& slot = kernel.descriptors[i];
      std::memcpy(storage + slot.offset, maps + i * kDescriptorBytes, kDescriptorBytes);
      if (slot.source != kAllocation || !moves_allocation_maps(launch)) continue;
      // the storage is 128-byte aligned and so is a map's offset in it, as the driver needs
      void* moved = reinterpret_cast<void*>(source_address(slot.source, slot.index, addresses, allocated));
      CUresult status = tensor_map_replace_address(storage + slot.offset, moved);
      if (status != 0) {
        PyErr_Format(PyExc_RuntimeError, "native launch: moving a tensor map to its allocation failed (CUDA error %d)",
                     status);
        return false;
      }
    }
  }
  for (size_t i = 0; i < kernel.offsets.size(); ++i) params[i] = storage + kernel.offsets[i];
  return true;
}

bool read_inputs(PyObject* const* inputs, size_t num_inputs, std::array<uint64_t, kMaxInputs>& addresses) {
  for (size_t i = 0; i < num_inputs; ++i) {
    if (inputs[i] == Py_None) {
      addresses[i] = 0;
    } else if (THPVariable_Check(inputs[i])) {
      addresses[i] = reinterpret_cast<uint64_t>(THPVariable_Unpack(inputs[i]).data_ptr());
    } else {
      PyErr_Format(PyExc_TypeError, "native launch: input %zu is a %s, expected a tensor or None", i,
                   Py_TYPE(inputs[i])->tp_name);
      return false;
    }
  }
  return true;
}

// The program's first `wanted` returns (at most all of them) as a tuple.
PyObject* returned(const Program& built, const std::vector<at::Tensor>& allocated, size_t wanted) {
  std::vector<at::Tensor> results;  // built first: a throwing view leaves nothing half-made
  size_t count = std::min(wanted, built.returns.size());
  results.reserve(count);
  for (size_t r = 0; r < count; ++r) {
    int index = built.returns[r];
    if (index < 0) {
      results.emplace_back();
    } else if (static_cast<size_t>(index) < allocated.size()) {
      results.push_back(allocated[index]);
    } else {
      const View& view = built.views[index - allocated.size()];
      results.push_back(allocated[view.allocation].view(view.dtype).as_strided(view.shape, view.strides,
                                                                                 view.offset));
    }
  }
  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(results.size()));
  if (result == nullptr) return nullptr;
  for (size_t i = 0; i < results.size(); ++i) {
    PyObject* item;
    if (results[i].defined()) {
      item = THPVariable_Wrap(std::move(results[i]));
    } else {
      Py_INCREF(Py_None);
      item = Py_None;
    }
    if (item == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyTuple_SET_ITEM(result, i, item);
  }
  return result;
}

KernelNodeParams node_params(const Kernel& kernel, void** params) {
  return KernelNodeParams{kernel.function, kernel.grid[0], kernel.grid[1], kernel.grid[2], kernel.block, 1, 1,
                          kernel.shared, params, nullptr};
}

// The run's kernels as one graph launch; -1 where this program does not take that way (one
// kernel, a capturing stream, a graph that failed to build): the caller launches them one by one.
// A launch costs the host about as much as a graph launch, and replacing a node's parameters much
// less: a masked forward (three kernels) took 13 against 28 us of warm host time (H100 host,
// benchmarks/host_probe.py). Launches of one graph are ordered among themselves, so one program's
// runs on two streams no longer overlap.
CUresult run_as_graph(Program& built, CUstream stream, char (*storage)[kMaxParamBytes],
                      void* (*params)[kMaxParams]) {
  if (!graphs_enabled || built.launched.size() < 2 || built.graph_failed) return -1;
  int capturing = 0;
  if (stream_is_capturing(stream, &capturing) != 0 || capturing != 0) return -1;
  std::lock_guard<std::mutex> hold(built.graph_lock);
  CUresult status = 0;
  if (built.graph_exec == nullptr) {
    status = graph_create(&built.graph, 0);
    CUgraphNode previous = nullptr;
    for (size_t j = 0; status == 0 && j < built.launched.size(); ++j) {
      size_t i = built.launched[j];
      KernelNodeParams node = node_params(built.kernels[i], params[i]);
      CUgraphNode added = nullptr;
      status = graph_add_kernel_node(&added, built.graph, previous ? &previous : nullptr, previous ? 1 : 0, &node);
      built.nodes.push_back(added);
      built.node_bytes.emplace_back(storage[i], storage[i] + built.kernels[i].params.size());
      previous = added;
    }
    if (status == 0) status = graph_instantiate(&built.graph_exec, built.graph, 0);
    if (status != 0) {
      built.graph_failed = true;
      built.nodes.clear();
      built.node_bytes.clear();
      return -1;
    }
  } else {
    // a loop that reuses its buffers (the caching allocator hands a freed block back) repeats
    // the last run's parameters: that node keeps them
    for (size_t j = 0; status == 0 && j < built.launched.size(); ++j) {
      size_t i = built.launched[j];
      std::vector<char>& last = built.node_bytes[j];
      if (std::memcmp(last.data(), storage[i], last.size()) == 0) continue;
      KernelNodeParams update = node_params(built.kernels[i], params[i]);
      status = graph_exec_set_params(built.graph_exec, built.nodes[j], &update);
      if (status == 0) std::memcpy(last.data(), storage[i], last.size());
    }
  }
  return status == 0 ? graph_launch(built.graph_exec, stream) : status;
}

// run(program, stream, *inputs) -> the program's returns; `pack` (a test's) instead returns
// (the returns, each kernel's filled parameter bytes), on the CPU, launching nothing. Only the
// first `wanted` returns are built (the entry's call without lse skips the lse view).
PyObject* execute(PyObject* const* args, Py_ssize_t nargs, bool launch, size_t wanted = SIZE_MAX) {
  HANDLE_TH_ERRORS
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError, "native launch: run(program, stream, *inputs)");
    return nullptr;
  }
  auto* built = static_cast<Program*>(PyCapsule_GetPointer(args[0], kCapsuleName));
  if (built == nullptr) return nullptr;
  unsigned long long stream = PyLong_AsUnsignedLongLong(args[1]);
  if (PyErr_Occurred()) return nullptr;
  PyObject* const* inputs = args + 2;
  size_t num_inputs = static_cast<size_t>(nargs - 2);
  if (num_inputs != built->num_inputs) {
    PyErr_Format(PyExc_TypeError, "native launch: got %zu inputs, the program takes %zu", num_inputs,
                 built->num_inputs);
    return nullptr;
  }
  if (launch && !load_driver()) return nullptr;
  std::array<uint64_t, kMaxInputs> addresses{};
  if (!read_inputs(inputs, num_inputs, addresses)) return nullptr;
  std::vector<at::Tensor> allocated;
  allocated.reserve(built->allocations.size());
  auto options = at::TensorOptions().device(launch ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(built->device))
                                                   : at::Device(at::kCPU));
  for (const Allocation& allocation : built->allocations) {
    allocated.push_back(at::empty(allocation.shape, options.dtype(allocation.dtype)));
  }
  alignas(kDescriptorBytes) char storage[kMaxKernels][kMaxParamBytes];
  void* params[kMaxKernels][kMaxParams];
  size_t count = built->kernels.size();
  for (size_t i = 0; i < count; ++i) {
    if (!fill_params(built->kernels[i], inputs, num_inputs, addresses, allocated, launch, storage[i], params[i])) {
      return nullptr;
    }
  }
  if (!launch) {
    PyObject* packed = PyList_New(static_cast<Py_ssize_t>(count));
    if (packed == nullptr) return nullptr;
    for (size_t i = 0; i < count; ++i) {
      PyObject* bytes = PyBytes_FromStringAndSize(storage[i], static_cast<Py_ssize_t>(built->kernels[i].params.size()));
      if (bytes == nullptr) {
        Py_DECREF(packed);
        return nullptr;
      }
      PyList_SET_ITEM(packed, i, bytes);
    }
    return Py_BuildValue("(NN)", returned(*built, allocated, wanted), packed);
  }
  // the launches need no Python: other threads run meanwhile (a full launch queue blocks here)
  CUresult status = 0;
  Py_BEGIN_ALLOW_THREADS
  status = ensure_context(built->device);
  CUresult graphed = status == 0 ? run_as_graph(*built, reinterpret_cast<CUstream>(stream), storage, params) : -1;
  if (graphed != -1) status = graphed;
  for (size_t j = 0; graphed == -1 && status == 0 && j < built->launched.size(); ++j) {
    size_t i = built->launched[j];
    const Kernel& kernel = built->kernels[i];
    status = launch_kernel(kernel.function, kernel.grid[0], kernel.grid[1], kernel.grid[2], kernel.block, 1, 1,
                           kernel.shared, reinterpret_cast<CUstream>(stream), params[i], nullptr);
  }
  Py_END_ALLOW_THREADS
  if (status != 0) {
    const char* text = nullptr;
    if (error_string != nullptr) error_string(status, &text);
    PyErr_Format(PyExc_RuntimeError, "native launch: %s (CUDA error %d)", text ? text : "?", status);
    return nullptr;
  }
  return returned(*built, allocated, wanted);
  END_HANDLE_TH_ERRORS
}

PyObject* run(PyObject*, PyObject* const* args, Py_ssize_t nargs) { return execute(args, nargs, true); }

PyObject* pack(PyObject*, PyObject* const* args, Py_ssize_t nargs) { return execute(args, nargs, false); }

// -- the plan signature ----------------------------------------------------------------------------

using LayoutWords = std::array<int64_t, 256>;

// Appends a tensor's layout (dims, sizes, strides, dtype, device, address modulo 16) or None's
// marker to `words`; false where they would not fit.
bool append_layout(const at::Tensor* tensor, LayoutWords& words, size_t& used) {
  size_t dims = tensor == nullptr ? 0 : static_cast<size_t>(tensor->dim());
  if (used + (tensor == nullptr ? 1 : 2 * dims + 5) > words.size()) return false;
  if (tensor == nullptr) {
    words[used++] = -1;
    return true;
  }
  words[used++] = static_cast<int64_t>(dims);
  for (int64_t size : tensor->sizes()) words[used++] = size;
  for (int64_t stride : tensor->strides()) words[used++] = stride;
  words[used++] = static_cast<int64_t>(tensor->scalar_type());
  words[used++] = static_cast<int64_t>(tensor->device().type()) * 65536 + tensor->device().index();
  words[used++] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(tensor->data_ptr()) & 15);
  return true;
}

// signature(*tensors) -> bytes: per tensor its dims, sizes, strides, dtype, device and address
// modulo 16 (what Triton specializes on); per None one marker. A non-tensor raises TypeError.
PyObject* signature(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  LayoutWords words;
  size_t used = 0;
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    bool none = args[i] == Py_None;
    if (!none && !THPVariable_Check(args[i])) {
      PyErr_Format(PyExc_TypeError, "signature: argument %zd is a %s, expected a tensor or None", i,
                   Py_TYPE(args[i])->tp_name);
      return nullptr;
    }
    try {
      if (!append_layout(none ? nullptr : &THPVariable_Unpack(args[i]), words, used)) {
        PyErr_SetString(PyExc_ValueError, "signature: too many tensors or dims");
        return nullptr;
      }
    } catch (const std::exception& error) {
      PyErr_SetString(PyExc_TypeError, error.what());
      return nullptr;
    }
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words.data()),
                                   static_cast<Py_ssize_t>(used * sizeof(int64_t)));
}

// -- the eager entry -------------------------------------------------------------------------------
//
// A call without gradient whose arguments `flash_dmattn_func` has already run once, validated and
// planned goes from the public function straight to its program: `entry(*arguments)` keys the
// call as below and runs the program `learn` stored under that key, or answers None, and the
// Python path runs (and learns) it. A key holds the tensors' layouts and every option by value,
// so it is only ever met by a call that would build the same plan. What Python state decides a
// plan besides (the dispatch generation, the backend overrides, the table the environment names)
// is recorded with each program and compared on every call.

// flash_dmattn_func's parameters, in order
enum Argument : int {
  kQuery, kKey, kValue, kMask, kBias, kIsCausal, kScale, kSoftcap, kReturnLse, kBackend, kCacheSeqlens,
  kBlockTable, kTable, kFwdConfig, kBwdConfig, kNumArguments
};
constexpr int kTensorArguments[] = {kQuery, kKey, kValue, kMask, kBias, kCacheSeqlens, kBlockTable};  // program order
constexpr size_t kMaxEntries = 1024;  // a loop repeats a few signatures; past this all are dropped

struct Entry {
  PyObject* program = nullptr;  // the native.Program, kept alive with its kernels
  PyObject* handle = nullptr;   // its capsule, which `execute` takes
  size_t num_inputs = 0;
  bool return_lse = false;
  long generation = 0;
  long overrides = 0;
  bool env_set = false;
  std::string env;
};

struct EntryContext {  // `configure`'s Python objects
  PyObject* dispatcher = nullptr;    // dispatch.DISPATCHER: its `generation`
  PyObject* registry = nullptr;      // the registry module: its `overrides`
  PyObject* launch_module = nullptr; // its `LAUNCH_OBSERVERS`: a call they watch takes the Python path
  PyObject* launch_stream = nullptr; // launch_context.launch_stream(): None where launches must take the JIT
  std::string env_name;
};

EntryContext context;
std::unordered_map<std::string, Entry> entries;

void drop_entries() {
  for (auto& item : entries) Py_DECREF(item.second.program);
  entries.clear();
}

// Tensors the entry serves: plain CUDA tensors, strided, not wrapped by a tracing or transform
// layer (fake, functional, functorch); anything else goes the Python way.
bool plain_cuda(PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) return false;
  const at::Tensor& tensor = THPVariable_Unpack(obj);
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                            c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper});
  return tensor.defined() && tensor.is_cuda() && tensor.layout() == at::kStrided &&
         !tensor.key_set().has_any(wrapped);
}

void append_bytes(std::string& key, const void* data, size_t size) {
  key.append(static_cast<const char*>(data), size);
}

bool append_string(std::string& key, PyObject* obj) {
  Py_ssize_t size = 0;
  const char* text = PyUnicode_AsUTF8AndSize(obj, &size);
  if (text == nullptr) {
    PyErr_Clear();
    return false;
  }
  append_bytes(key, &size, sizeof(size));
  key.append(text, static_cast<size_t>(size));
  return true;
}

// The call's key, or false where the entry does not serve it: a gradient is needed, an option is
// not of the plain type the Python path keys it by, explicit configs (a tuning-time call), an
// integer mask (its values are checked on every call).
bool entry_key(PyObject* const* args, std::string& key) {
  for (int index : kTensorArguments) {
    if (args[index] != Py_None && !plain_cuda(args[index])) return false;
    if (index <= kValue && args[index] == Py_None) return false;
  }
  if (args[kFwdConfig] != Py_None || args[kBwdConfig] != Py_None) return false;
  if (!PyBool_Check(args[kIsCausal]) || !PyBool_Check(args[kReturnLse])) return false;
  if (args[kScale] != Py_None && !PyFloat_CheckExact(args[kScale])) return false;
  if (!PyFloat_CheckExact(args[kSoftcap]) || !PyUnicode_CheckExact(args[kBackend])) return false;
  if (args[kTable] != Py_None && !PyUnicode_CheckExact(args[kTable])) return false;
  if (args[kMask] != Py_None && THPVariable_Unpack(args[kMask]).scalar_type() != at::kBool) return false;
  if (c10::GradMode::is_enabled()) {
    for (int index : {kQuery, kKey, kValue, kBias}) {
      if (args[index] != Py_None && THPVariable_Unpack(args[index]).requires_grad()) return false;
    }
  }
  LayoutWords words;
  size_t used = 0;
  for (int index : kTensorArguments) {
    if (!append_layout(args[index] == Py_None ? nullptr : &THPVariable_Unpack(args[index]), words, used)) return false;
  }
  key.reserve(used * sizeof(int64_t) + 64);
  append_bytes(key, words.data(), used * sizeof(int64_t));
  double scale = args[kScale] == Py_None ? -1.0 : PyFloat_AS_DOUBLE(args[kScale]);  // a scale is > 0
  double softcap = PyFloat_AS_DOUBLE(args[kSoftcap]);
  append_bytes(key, &scale, sizeof(scale));
  append_bytes(key, &softcap, sizeof(softcap));
  key.push_back(args[kIsCausal] == Py_True ? 'c' : 'n');
  key.push_back(args[kReturnLse] == Py_True ? 'l' : 'o');
  if (!append_string(key, args[kBackend])) return false;
  if (args[kTable] == Py_None) {
    key.push_back('-');
  } else if (!append_string(key, args[kTable])) {
    return false;
  }
  return true;
}

// The integer attribute `name` of `owner`; false (no error set) where it is missing or not an int.
bool read_long(PyObject* owner, const char* name, long& value) {
  PyObject* attribute = PyObject_GetAttrString(owner, name);
  if (attribute == nullptr) {
    PyErr_Clear();
    return false;
  }
  value = PyLong_AsLong(attribute);
  Py_DECREF(attribute);
  if (value == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// The Python state a stored program was planned under, read now.
bool current_state(Entry& state) {
  if (context.dispatcher == nullptr) return false;
  if (!read_long(context.dispatcher, "generation", state.generation)) return false;
  if (!read_long(context.registry, "overrides", state.overrides)) return false;
  const char* env = std::getenv(context.env_name.c_str());
  state.env_set = env != nullptr;
  state.env = env != nullptr ? env : "";
  return true;
}

// configure(dispatcher, registry, launch_module, launch_stream, env_name)
PyObject* configure(PyObject*, PyObject* args) {
  PyObject *dispatcher, *registry, *launch_module, *launch_stream;
  const char* env_name;
  if (!PyArg_ParseTuple(args, "OOOOs", &dispatcher, &registry, &launch_module, &launch_stream, &env_name)) {
    return nullptr;
  }
  drop_entries();
  for (PyObject* held : {context.dispatcher, context.registry, context.launch_module, context.launch_stream}) {
    Py_XDECREF(held);
  }
  for (PyObject* kept : {dispatcher, registry, launch_module, launch_stream}) Py_INCREF(kept);
  context = EntryContext{dispatcher, registry, launch_module, launch_stream, env_name};
  Py_RETURN_NONE;
}

// learn(program, *arguments) -> whether the entry will serve calls keyed as these arguments.
PyObject* learn(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != kNumArguments + 1) {
    PyErr_SetString(PyExc_TypeError, "learn(program, *flash_dmattn_func's arguments)");
    return nullptr;
  }
  std::string key;
  Entry stored;
  if (!entry_key(args + 1, key) || !current_state(stored)) Py_RETURN_FALSE;
  PyObject* handle = PyObject_GetAttrString(args[0], "handle");
  if (handle == nullptr) return nullptr;
  auto* built = static_cast<Program*>(PyCapsule_GetPointer(handle, kCapsuleName));
  Py_DECREF(handle);  // the program holds it
  if (built == nullptr) return nullptr;
  // the program's inputs: the call's tensors in `kTensorArguments` order, the first five (a
  // prefill forward) or all of them (the short-query forward)
  if (built->num_inputs != 5 && built->num_inputs != std::size(kTensorArguments)) Py_RETURN_FALSE;
  if (entries.size() >= kMaxEntries) drop_entries();
  stored.program = args[0];
  stored.handle = handle;
  stored.num_inputs = built->num_inputs;
  stored.return_lse = args[1 + kReturnLse] == Py_True;
  Py_INCREF(stored.program);
  auto found = entries.find(key);
  if (found != entries.end()) {
    Py_DECREF(found->second.program);
    found->second = std::move(stored);
  } else {
    entries.emplace(std::move(key), std::move(stored));
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyObject* forget(PyObject*, PyObject*) {
  drop_entries();
  Py_RETURN_NONE;
}

// entry(*flash_dmattn_func's arguments) -> its result, or None: not a call the entry has learned.
PyObject* entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != kNumArguments) {
    PyErr_SetString(PyExc_TypeError, "entry(*flash_dmattn_func's arguments)");
    return nullptr;
  }
  std::string key;
  if (entries.empty() || !entry_key(args, key)) Py_RETURN_NONE;
  auto found = entries.find(key);
  if (found == entries.end()) Py_RETURN_NONE;
  const Entry& stored = found->second;
  Entry now;
  if (!current_state(now) || now.generation != stored.generation || now.overrides != stored.overrides ||
      now.env_set != stored.env_set || now.env != stored.env) {
    Py_RETURN_NONE;
  }
  auto* built = static_cast<Program*>(PyCapsule_GetPointer(stored.handle, kCapsuleName));
  if (built == nullptr) return nullptr;
  if (!load_driver()) return nullptr;
  if (!device_is_current(built->device)) Py_RETURN_NONE;
  PyObject* observers = PyObject_GetAttrString(context.launch_module, "LAUNCH_OBSERVERS");
  if (observers == nullptr) return nullptr;
  int watched = PyObject_IsTrue(observers);
  Py_DECREF(observers);
  if (watched != 0) {
    if (watched < 0) return nullptr;
    Py_RETURN_NONE;
  }
  PyObject* stream = PyObject_CallNoArgs(context.launch_stream);
  if (stream == nullptr) return nullptr;
  if (stream == Py_None) return stream;
  // the run lets other threads in while it launches: they may `learn` or `forget` meanwhile, so
  // the run holds its own reference to the program and copies of what it reads of the entry
  PyObject* program = stored.program;
  Py_INCREF(program);
  bool return_lse = stored.return_lse;
  size_t num_inputs = stored.num_inputs;
  std::array<PyObject*, 2 + std::size(kTensorArguments)> run_args;
  run_args[0] = stored.handle;
  run_args[1] = stream;
  for (size_t i = 0; i < num_inputs; ++i) run_args[2 + i] = args[kTensorArguments[i]];
  PyObject* outputs = execute(run_args.data(), static_cast<Py_ssize_t>(2 + num_inputs), true, return_lse ? 2 : 1);
  Py_DECREF(stream);
  Py_DECREF(program);
  if (outputs == nullptr) return nullptr;
  PyObject* result;
  if (return_lse) {
    result = PyTuple_Pack(2, PyTuple_GET_ITEM(outputs, 0), PyTuple_GET_ITEM(outputs, 1));
  } else {
    result = PyTuple_GET_ITEM(outputs, 0);
    Py_INCREF(result);
  }
  Py_DECREF(outputs);
  return result;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"program", program, METH_VARARGS, "A launch program from plain data (native.py)."},
    {"run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(run)), METH_FASTCALL,
     "run(program, stream, *inputs): allocate and launch; the program's returns."},
    {"pack", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(pack)), METH_FASTCALL,
     "pack(program, stream, *inputs): (returns, each kernel's parameter bytes), on the CPU, nothing launched."},
    {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(signature)), METH_FASTCALL,
     "signature(*tensors): the tensors' layouts as bytes (a plan key)."},
    {"configure", configure, METH_VARARGS,
     "configure(dispatcher, registry, launch_module, launch_stream, env_name): the entry's Python state."},
    {"learn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(learn)), METH_FASTCALL,
     "learn(program, *arguments): the entry runs `program` for calls keyed as these arguments."},
    {"forget", forget, METH_NOARGS, "forget(): the entry serves no call until it learns again."},
    {"entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(entry)), METH_FASTCALL,
     "entry(*arguments): a learned call's result, else None."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "dmattn_native", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_dmattn_native() { return PyModule_Create(&module_def); }
