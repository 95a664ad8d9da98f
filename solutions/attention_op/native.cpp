// The eager path of solutions/attention_op without Python in the hot loop.
//
// An eager call of attention() used to cost two to three times SDPA's host time: the launch
// arguments were rebuilt in Python on every call, each kernel went through Triton's Python
// launcher, and the autograd node was a Python autograd.Function.  This extension keeps, per
// call key, what the Python path did the first time it ran that key, and repeats it in C++:
//
//   key      every tensor's sizes, strides, dtype, device and 16-byte alignment (what Triton
//            specializes a kernel on), the call's options, the kernel set, and whether a
//            gradient is wanted.  A call whose key is known was validated when it was recorded:
//            validation depends on nothing else.
//   plan     for the forward, and for the backward when a gradient is wanted: the buffers to
//            allocate (sizes, strides, dtype of what the Python path allocated), and each
//            kernel launch as Triton made it: the compiled function, grid, threads, shared memory,
//            global scratch, and every non-constexpr argument as a buffer index or a constant.
//            A TMA descriptor made on the host is kept as what it describes (a buffer, its shape,
//            strides and tile, as the kernel was compiled for them) and made again from the
//            buffer's address at every launch, as Triton's launcher does.
//            A forward of stage 4's wgmma kernel is a call of its host function instead
//            (stage4w_forward, which makes the kernel's tensor maps from the buffers' addresses
//            and launches it), with the same kind of arguments.
//   autograd one C++ node (torch::autograd::Function) whose backward replays the backward plan.
//            A dO (or, through a saved-tensor hook, a saved q, k, v, o or lse) whose strides,
//            dtype or alignment differ from the ones recorded is copied into the recorded layout
//            first, so the recorded kernels always meet what they were compiled for.
//
// solutions/attention_op/native.py records the plans (from the Python path's own launches), builds
// this file on first use, and says when the C++ path is not taken.  Nothing here chooses a kernel
// or a tile: a plan only repeats launches the Python path already made for the same key.

#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda.h>      // CUfunction, CUstream, CUresult; the driver's entry points come from dlsym
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using LaunchKernel = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, CUstream, void**, void**);
using ErrorString = CUresult (*)(CUresult, const char**);
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// libcuda is loaded by PyTorch already; no link-time dependency on it.
struct Driver {
    LaunchKernel launch = nullptr;
    ErrorString error_string = nullptr;
    EncodeTiled encode_tiled = nullptr;
    Driver() {
        void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        TORCH_CHECK(lib != nullptr, "attention_op native path: cannot open libcuda.so.1");
        launch = reinterpret_cast<LaunchKernel>(dlsym(lib, "cuLaunchKernel"));
        error_string = reinterpret_cast<ErrorString>(dlsym(lib, "cuGetErrorString"));
        encode_tiled = reinterpret_cast<EncodeTiled>(dlsym(lib, "cuTensorMapEncodeTiled"));
        TORCH_CHECK(launch != nullptr, "attention_op native path: libcuda.so.1 has no cuLaunchKernel");
    }
};

const Driver& driver() {
    static Driver d;
    return d;
}

// One kernel argument: a buffer (its data pointer), a constant of the kernel parameter's type, or a
// TMA descriptor (its value an index into the launch's maps).
enum Kind : int64_t { kBuffer = 0, kInt32 = 1, kInt64 = 2, kFloat32 = 3, kInt8 = 4, kNull = 5, kTensorMap = 6 };

// A TMA descriptor made on the host, as Triton's launcher makes it (fill_tma_descriptor in its
// driver): buffer, swizzle, element size, the driver's data type, out-of-bounds fill (0: zeros,
// 1: NaN), rank, then the tile's, the shape's and the strides' rank entries each, outermost
// first (the strides in elements).
struct MapSpec {
    std::vector<int64_t> v;
    int64_t buffer() const { return v[0]; }
    int64_t rank() const { return v[5]; }
    bool valid(int64_t buffers) const {
        if (v.size() < 6) return false;
        int64_t r = v[5];
        return r >= 1 && r <= 5 && static_cast<int64_t>(v.size()) == 6 + 3 * r && v[0] >= 0 && v[0] < buffers &&
               (v[4] == 0 || v[4] == 1) && v[2] > 0;
    }
};

// The wgmma kernel's host function and its error text (solutions/fast_variable_block_wgmma.cu):
// q, k, v, o, lse, 12 strides, batch, heads, kv_heads, n_q, n_k, head_dim, scale, dtype, causal,
// window, sink_tokens, sinks, stream.
using HostForward = int (*)(const void*, const void*, const void*, void*, float*, const int64_t*, int, int, int, int,
                            int, int, float, int, int, int, int, const float*, void*);
using HostError = const char* (*)(int);
constexpr size_t kHostArgs = 5 + 12 + 6 + 1 + 4 + 1;

struct Arg {
    int64_t kind;
    int64_t value;   // buffer index, integer, or a float32's bits
};

struct Launch {
    CUfunction function;     // or, with host_error, the host function (HostForward) to call
    HostError host_error = nullptr;
    unsigned grid[3];
    unsigned threads;
    unsigned shared;
    int64_t scratch;   // bytes of global scratch for the whole grid; 0: none
    std::vector<Arg> args;
    std::vector<MapSpec> maps;   // the host-made TMA descriptors its kTensorMap arguments name
};

struct Alloc {
    std::vector<int64_t> sizes, strides;
    c10::ScalarType dtype;
};

// Buffers 0 .. inputs - 1 are the call's tensors, then one per Alloc, in order.
struct Part {
    int64_t inputs = 0;
    std::vector<Alloc> allocs;
    std::vector<Launch> launches;
    std::vector<int64_t> outputs;
    int64_t scratch = 0;         // bytes of scratch for all launches, each rounded up to 256
};

struct Layout {
    std::vector<int64_t> sizes, strides;
    c10::ScalarType dtype;
    bool aligned;   // a start on 16 bytes, which Triton specialized the kernels for

    explicit Layout(const at::Tensor& t)
        : sizes(t.sizes().vec()), strides(t.strides().vec()), dtype(t.scalar_type()),
          aligned(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0) {}

    // t itself when it has this layout, else a copy in this layout.
    at::Tensor fit(const at::Tensor& t, std::atomic<int64_t>& copies) const {
        bool t_aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
        if (t.sizes() == c10::IntArrayRef(sizes) && t.strides() == c10::IntArrayRef(strides) &&
            t.scalar_type() == dtype && (t_aligned || !aligned)) {
            return t;
        }
        ++copies;
        at::Tensor fixed = at::empty_strided(sizes, strides, t.options().dtype(dtype));
        fixed.copy_(t);
        return fixed;
    }
};

struct Plan {
    bool native = false;   // false: this key stays on the Python path
    bool has_sinks = false;
    at::Tensor no_sinks;   // stands in for absent sinks: autograd's inputs must be defined tensors
    Part forward;
    Part backward;
    int64_t dsinks_part = -1;   // the backward buffer whose sum over (0, 2) is dsinks
    // The backward's inputs (q, k, v, o, lse, dO; not sinks) as recorded: the launches' strides are
    // constants, so a tensor that comes back otherwise (dO of another layout; q, k, v, o or lse
    // through a saved-tensor hook) is copied into this layout first.
    std::vector<Layout> saved;
};

struct KeyHash {
    size_t operator()(const std::vector<int64_t>& key) const noexcept {
        uint64_t h = 1469598103934665603ull;
        for (int64_t x : key) {
            h ^= static_cast<uint64_t>(x) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
        }
        return static_cast<size_t>(h);
    }
};

std::mutex table_lock;
std::unordered_map<std::vector<int64_t>, int64_t, KeyHash> table;   // key -> index into plans
std::vector<std::shared_ptr<Plan>> plans;    // never shrinks: a node may outlive clear()
std::atomic<int64_t> forward_runs{0}, backward_runs{0}, do_copies{0}, saved_copies{0};

// A backward runs on autograd's threads while a Python thread may record: read under the lock.
std::shared_ptr<const Plan> plan_at(int64_t index) {
    std::lock_guard<std::mutex> hold(table_lock);
    return plans[index];
}

void push_tensor(std::vector<int64_t>& key, const at::Tensor& t) {
    key.push_back(t.dim());
    for (int64_t s : t.sizes()) key.push_back(s);
    for (int64_t s : t.strides()) key.push_back(s);
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(static_cast<int64_t>(t.device().type()));
    key.push_back(t.device().index());
    key.push_back(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0);
}

void push_text(std::vector<int64_t>& key, const std::string& text) {
    key.push_back(static_cast<int64_t>(text.size()));
    for (unsigned char c : text) key.push_back(c);
}

std::vector<int64_t> make_key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& sinks, bool causal, std::optional<double> scale,
                              bool gqa, std::optional<int64_t> window, int64_t sink_tokens,
                              const std::string& layout, const std::string& kernels, bool grad) {
    std::vector<int64_t> key;
    key.reserve(64);
    push_tensor(key, q);
    push_tensor(key, k);
    push_tensor(key, v);
    key.push_back(sinks.has_value());
    if (sinks.has_value()) push_tensor(key, *sinks);
    key.push_back(causal);
    key.push_back(scale.has_value());
    if (scale.has_value()) {
        int64_t bits;
        double s = *scale;
        std::memcpy(&bits, &s, sizeof bits);
        key.push_back(bits);
    }
    key.push_back(gqa);
    key.push_back(window.has_value());
    key.push_back(window.value_or(0));
    key.push_back(sink_tokens);
    push_text(key, layout);
    push_text(key, kernels);
    key.push_back(grad);
    return key;
}

bool wants_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& sinks) {
    return at::GradMode::is_enabled() &&
           (q.requires_grad() || k.requires_grad() || v.requires_grad() || (sinks.has_value() && sinks->requires_grad()));
}

// A recorded call of the wgmma kernel's host function, the buffers' addresses in the recorded ones' places.
void run_host(const Launch& l, const std::vector<at::Tensor>& buffers, CUstream stream) {
    auto pointer = [&](const Arg& a) -> void* {
        return a.kind == kNull ? nullptr : buffers[a.value].data_ptr();
    };
    const std::vector<Arg>& a = l.args;
    int64_t strides[12];
    for (int i = 0; i < 12; ++i) strides[i] = a[5 + i].value;
    int ints[6];
    for (int i = 0; i < 6; ++i) ints[i] = static_cast<int>(a[17 + i].value);
    float scale;
    uint32_t bits = static_cast<uint32_t>(a[23].value);
    std::memcpy(&scale, &bits, 4);
    auto forward = reinterpret_cast<HostForward>(l.function);
    int err = forward(pointer(a[0]), pointer(a[1]), pointer(a[2]), pointer(a[3]), static_cast<float*>(pointer(a[4])),
                      strides, ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], scale,
                      static_cast<int>(a[24].value), static_cast<int>(a[25].value), static_cast<int>(a[26].value),
                      static_cast<int>(a[27].value), static_cast<const float*>(pointer(a[28])), stream);
    TORCH_CHECK(err == 0, "attention_op native path: the wgmma forward failed: ", l.host_error(err));
}

// The descriptor a MapSpec describes, over the buffer's current address.
void encode(const MapSpec& m, const std::vector<at::Tensor>& buffers, CUtensorMap* out) {
    const Driver& cu = driver();
    TORCH_CHECK(cu.encode_tiled != nullptr, "attention_op native path: libcuda.so.1 has no cuTensorMapEncodeTiled");
    const int64_t rank = m.rank(), elem = m.v[2];
    const int64_t* tile = m.v.data() + 6;
    const int64_t* shape = tile + rank;
    const int64_t* strides = shape + rank;
    // The driver counts dimensions innermost first, and takes the strides of all but the innermost in bytes.
    cuuint32_t box[5], element_strides[5] = {1, 1, 1, 1, 1};
    cuuint64_t dims[5], byte_strides[5] = {0, 0, 0, 0, 0};
    for (int64_t i = 0; i < rank; ++i) {
        box[rank - 1 - i] = static_cast<cuuint32_t>(tile[i]);
        dims[rank - 1 - i] = static_cast<cuuint64_t>(shape[i]);
    }
    for (int64_t i = 0; i + 1 < rank; ++i) byte_strides[rank - 2 - i] = static_cast<cuuint64_t>(strides[i] * elem);
    CUresult r = cu.encode_tiled(out, static_cast<CUtensorMapDataType>(m.v[3]), static_cast<cuuint32_t>(rank),
                                 buffers[m.buffer()].data_ptr(), dims, byte_strides, box, element_strides,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, static_cast<CUtensorMapSwizzle>(m.v[1]),
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                 m.v[4] == 1 ? CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA
                                             : CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        const char* text = "unknown error";
        if (cu.error_string) cu.error_string(r, &text);
        TORCH_CHECK(false, "attention_op native path: making a TMA descriptor failed: ", text);
    }
}

// Allocate the part's buffers after the inputs, and launch its kernels on the current stream.
void run_part(const Part& part, std::vector<at::Tensor>& buffers, const c10::Device& device) {
    TORCH_CHECK(static_cast<int64_t>(buffers.size()) == part.inputs, "attention_op native path: wrong input count");
    auto options = at::TensorOptions().device(device);
    for (const Alloc& a : part.allocs) {
        buffers.push_back(at::empty_strided(a.sizes, a.strides, options.dtype(a.dtype)));
    }
    CUstream stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
    const Driver& cu = driver();
    // One scratch allocation for the part's launches, each at a 256-byte boundary; freed on return,
    // the caching allocator reuses it only in stream order, after these kernels.
    at::Tensor scratch;
    if (part.scratch > 0) scratch = at::empty({part.scratch}, options.dtype(at::kByte));
    uintptr_t scratch_at = scratch.defined() ? reinterpret_cast<uintptr_t>(scratch.data_ptr()) : 0;
    std::vector<uint64_t> slots;
    std::vector<void*> params;
    std::vector<CUtensorMap> maps;   // CUtensorMap is 64-byte aligned: so are a vector's elements
    for (const Launch& l : part.launches) {
        if (static_cast<uint64_t>(l.grid[0]) * l.grid[1] * l.grid[2] == 0) continue;   // as Triton's launcher
        if (l.host_error != nullptr) {
            run_host(l, buffers, stream);
            continue;
        }
        size_t n = l.args.size();
        slots.assign(n + 2, 0);   // + Triton's global and profile scratch pointers
        params.resize(n + 2);
        maps.resize(l.maps.size());
        for (size_t i = 0; i < l.maps.size(); ++i) encode(l.maps[i], buffers, &maps[i]);
        for (size_t i = 0; i < n; ++i) {
            const Arg& a = l.args[i];
            void* slot = &slots[i];
            switch (a.kind) {
                case kBuffer: slots[i] = reinterpret_cast<uintptr_t>(buffers[a.value].data_ptr()); break;
                case kInt32: { int32_t x = static_cast<int32_t>(a.value); std::memcpy(slot, &x, 4); break; }
                case kInt64: slots[i] = static_cast<uint64_t>(a.value); break;
                case kFloat32: { uint32_t x = static_cast<uint32_t>(a.value); std::memcpy(slot, &x, 4); break; }
                case kInt8: { int8_t x = static_cast<int8_t>(a.value); std::memcpy(slot, &x, 1); break; }
                case kTensorMap: slot = &maps[a.value]; break;   // passed by value: the launch copies it
                default: TORCH_CHECK(false, "attention_op native path: unknown argument kind ", a.kind);
            }
            params[i] = slot;
        }
        if (l.scratch > 0) {
            slots[n] = scratch_at;
            scratch_at += (l.scratch + 255) / 256 * 256;
        }
        params[n] = &slots[n];
        params[n + 1] = &slots[n + 1];
        CUresult r = cu.launch(l.function, l.grid[0], l.grid[1], l.grid[2], l.threads, 1, 1, l.shared, stream,
                               params.data(), nullptr);
        if (r != CUDA_SUCCESS) {
            const char* text = "unknown error";
            if (cu.error_string) cu.error_string(r, &text);
            TORCH_CHECK(false, "attention_op native path: kernel launch failed: ", text);
        }
    }
}

std::vector<at::Tensor> run_forward(const Plan& plan, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& sinks) {
    c10::cuda::CUDAGuard guard(q.device());
    std::vector<at::Tensor> buffers{q, k, v, sinks};
    buffers.reserve(4 + plan.forward.allocs.size());
    run_part(plan.forward, buffers, q.device());
    ++forward_runs;
    return {buffers[plan.forward.outputs[0]], buffers[plan.forward.outputs[1]]};
}

struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
    static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& sinks, int64_t plan_index) {
        auto out = run_forward(*plan_at(plan_index), q, k, v, sinks);
        ctx->save_for_backward({q, k, v, out[0], out[1], sinks});
        ctx->saved_data["plan"] = plan_index;
        return out[0];
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
        auto held = plan_at(ctx->saved_data["plan"].toInt());
        const Plan& plan = *held;
        auto saved = ctx->get_saved_variables();
        c10::cuda::CUDAGuard guard(saved[0].device());
        std::vector<at::Tensor> buffers{plan.saved[0].fit(saved[0], saved_copies),
                                        plan.saved[1].fit(saved[1], saved_copies),
                                        plan.saved[2].fit(saved[2], saved_copies),
                                        plan.saved[3].fit(saved[3], saved_copies),
                                        plan.saved[4].fit(saved[4], saved_copies),
                                        plan.saved[5].fit(grads[0], do_copies), saved[5]};
        buffers.reserve(7 + plan.backward.allocs.size());
        run_part(plan.backward, buffers, buffers[0].device());
        ++backward_runs;
        at::Tensor dsinks;
        if (plan.has_sinks && ctx->needs_input_grad(3)) {
            const int64_t dims[] = {0, 2};   // (B, Hq, query blocks) -> (Hq,)
            dsinks = buffers[plan.dsinks_part].sum(at::IntArrayRef(dims));
        }
        const auto& out = plan.backward.outputs;
        return {buffers[out[0]], buffers[out[1]], buffers[out[2]], dsinks, at::Tensor()};
    }
};

// (function, grid, threads, shared, scratch, [(kind, value), ...], host_error, maps): host_error 0
// for a kernel launch, else the address of the host function's error text, and function the host
// function; maps the MapSpecs of its kTensorMap arguments.
using LaunchDesc = std::tuple<int64_t, std::vector<int64_t>, int64_t, int64_t, int64_t,
                              std::vector<std::pair<int64_t, int64_t>>, int64_t, std::vector<std::vector<int64_t>>>;
// (inputs, example allocations, launches, outputs)
using PartDesc = std::tuple<int64_t, std::vector<at::Tensor>, std::vector<LaunchDesc>, std::vector<int64_t>>;

Part make_part(const PartDesc& desc) {
    Part part;
    part.inputs = std::get<0>(desc);
    for (const at::Tensor& t : std::get<1>(desc)) {
        part.allocs.push_back({t.sizes().vec(), t.strides().vec(), t.scalar_type()});
    }
    int64_t buffers = part.inputs + static_cast<int64_t>(part.allocs.size());
    for (const LaunchDesc& l : std::get<2>(desc)) {
        Launch launch;
        launch.function = reinterpret_cast<CUfunction>(static_cast<uintptr_t>(std::get<0>(l)));
        const auto& grid = std::get<1>(l);
        TORCH_CHECK(grid.size() == 3, "record: a grid has 3 dimensions");
        for (int i = 0; i < 3; ++i) launch.grid[i] = static_cast<unsigned>(grid[i]);
        launch.threads = static_cast<unsigned>(std::get<2>(l));
        launch.shared = static_cast<unsigned>(std::get<3>(l));
        launch.scratch = std::get<4>(l);
        for (const auto& spec : std::get<7>(l)) {
            launch.maps.push_back({spec});
            TORCH_CHECK(launch.maps.back().valid(buffers), "record: a malformed TMA descriptor");
        }
        const int64_t maps = static_cast<int64_t>(launch.maps.size());
        for (const auto& [kind, value] : std::get<5>(l)) {
            TORCH_CHECK(kind >= kBuffer && kind <= kTensorMap, "record: unknown argument kind ", kind);
            TORCH_CHECK(kind != kBuffer || (value >= 0 && value < buffers), "record: buffer ", value, " out of range");
            TORCH_CHECK(kind != kTensorMap || (value >= 0 && value < maps), "record: descriptor ", value,
                        " out of range");
            launch.args.push_back({kind, value});
        }
        launch.host_error = reinterpret_cast<HostError>(static_cast<uintptr_t>(std::get<6>(l)));
        if (launch.host_error != nullptr) {
            const auto& a = launch.args;
            bool ok = a.size() == kHostArgs;
            for (size_t i = 0; ok && i < a.size(); ++i) {
                int64_t want = i < 5 ? kBuffer : i < 17 ? kInt64 : i == 23 ? kFloat32 : i < 28 ? kInt32 : -1;
                ok = want == -1 ? (a[i].kind == kBuffer || a[i].kind == kNull) : a[i].kind == want;
            }
            TORCH_CHECK(ok && maps == 0,
                        "record: a host call takes q, k, v, o, lse, 12 strides, 6 ints, a scale, 4 ints, sinks");
        } else {
            for (const Arg& a : launch.args) TORCH_CHECK(a.kind != kNull, "record: a kernel argument cannot be null");
        }
        part.scratch += (launch.scratch + 255) / 256 * 256;
        part.launches.push_back(std::move(launch));
    }
    for (int64_t o : std::get<3>(desc)) {
        TORCH_CHECK(o >= 0 && o < buffers, "record: output ", o, " out of range");
        part.outputs.push_back(o);
    }
    return part;
}

}  // namespace

// The call: its output; None when this key has no plan yet (the caller takes the Python path and
// records it), False when its plan is the Python path (the caller takes it, and records nothing).
py::object attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& sinks, bool causal, std::optional<double> scale, bool gqa,
                     std::optional<int64_t> window, int64_t sink_tokens, const std::string& layout,
                     const std::string& kernels) {
    // Only CUDA tensors with storage have plans (a functorch wrapper has none to point a kernel at).
    auto usable = [](const at::Tensor& t) { return t.is_cuda() && t.has_storage(); };
    if (!usable(q) || !usable(k) || !usable(v) || (sinks.has_value() && !usable(*sinks))) return py::none();
    bool grad = wants_grad(q, k, v, sinks);
    auto key = make_key(q, k, v, sinks, causal, scale, gqa, window, sink_tokens, layout, kernels, grad);
    int64_t index;
    std::shared_ptr<const Plan> plan;
    {
        std::lock_guard<std::mutex> hold(table_lock);
        auto found = table.find(key);
        if (found == table.end()) return py::none();
        index = found->second;
        plan = plans[index];
    }
    if (!plan->native) return py::bool_(false);   // recorded as the Python path's: not to be recorded again
    const at::Tensor& s = sinks.has_value() ? *sinks : plan->no_sinks;
    if (grad) return py::cast(AttentionFunction::apply(q, k, v, s, index));
    return py::cast(run_forward(*plan, q, k, v, s)[0]);
}

// Keep a key's plan: the forward part, and the backward part with the dO it was recorded with
// when the key wants a gradient.  No forward part: the key stays on the Python path.
void record(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& sinks,
            bool causal, std::optional<double> scale, bool gqa, std::optional<int64_t> window, int64_t sink_tokens,
            const std::string& layout, const std::string& kernels, bool grad, const std::optional<PartDesc>& forward,
            const std::optional<PartDesc>& backward, const std::vector<at::Tensor>& saved,
            const std::optional<at::Tensor>& d_o, int64_t dsinks_part) {
    auto plan = std::make_shared<Plan>();
    plan->has_sinks = sinks.has_value();
    if (!plan->has_sinks) plan->no_sinks = at::empty({0}, q.options().dtype(at::kFloat));
    if (forward.has_value()) {
        plan->forward = make_part(*forward);
        TORCH_CHECK(plan->forward.inputs == 4 && plan->forward.outputs.size() == 2,
                    "record: the forward takes q, k, v, sinks and gives o, lse");
        if (grad) {
            TORCH_CHECK(backward.has_value() && d_o.has_value(), "record: a key with a gradient needs its backward");
            plan->backward = make_part(*backward);
            TORCH_CHECK(plan->backward.inputs == 7 && plan->backward.outputs.size() == 3,
                        "record: the backward takes q, k, v, o, lse, dO, sinks and gives dq, dk, dv");
            int64_t buffers = 7 + static_cast<int64_t>(plan->backward.allocs.size());
            TORCH_CHECK(dsinks_part >= 0 && dsinks_part < buffers, "record: dsinks_part out of range");
            TORCH_CHECK(saved.size() == 5, "record: the backward needs q, k, v, o and lse as saved");
            plan->dsinks_part = dsinks_part;
            for (const at::Tensor& t : saved) plan->saved.emplace_back(t);
            plan->saved.emplace_back(*d_o);
        }
        plan->native = true;
    }
    auto key = make_key(q, k, v, sinks, causal, scale, gqa, window, sink_tokens, layout, kernels, grad);
    std::lock_guard<std::mutex> hold(table_lock);
    // A key recorded twice (two of its calls were on their way before the first was recorded)
    // keeps its first plan: nodes made since hold its index.
    if (table.count(key)) return;
    plans.push_back(plan);
    table[key] = static_cast<int64_t>(plans.size()) - 1;
}

void clear() {
    std::lock_guard<std::mutex> hold(table_lock);
    table.clear();
}

py::dict counts() {
    std::lock_guard<std::mutex> hold(table_lock);
    int64_t native = 0;
    for (const auto& [key, index] : table) native += plans[index]->native;
    py::dict d;
    d["keys"] = static_cast<int64_t>(table.size());
    d["native_keys"] = native;
    d["forward_runs"] = forward_runs.load();
    d["backward_runs"] = backward_runs.load();
    d["do_copies"] = do_copies.load();
    d["saved_copies"] = saved_copies.load();
    d["plans"] = static_cast<int64_t>(plans.size());
    return d;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "solutions/attention_op's eager calls, repeated in C++ from recorded plans";
    m.def("attention", &attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("sinks"),
          py::arg("causal").noconvert(), py::arg("scale"), py::arg("gqa").noconvert(), py::arg("window"),
          py::arg("sink_tokens"), py::arg("layout"), py::arg("kernels"));
    m.def("record", &record);
    m.def("clear", &clear);
    m.def("counts", &counts);
    m.attr("BUFFER") = static_cast<int64_t>(kBuffer);
    m.attr("INT32") = static_cast<int64_t>(kInt32);
    m.attr("INT64") = static_cast<int64_t>(kInt64);
    m.attr("FLOAT32") = static_cast<int64_t>(kFloat32);
    m.attr("INT8") = static_cast<int64_t>(kInt8);
    m.attr("NULL") = static_cast<int64_t>(kNull);
    m.attr("TENSOR_MAP") = static_cast<int64_t>(kTensorMap);
}
