// streambp_bench: Google Benchmark micro-benchmarks of the pieces StreamBP composes, each one chunk's forward +
// backward exactly as a step runs it (core/streambp.cpp, streamed_head in core/streaming.cpp):
//   head_chunk/c_h        final norm + logits + SFT loss of c_h positions: the objective's in-place gradient,
//                         logits_backward by hand (lm_head gradient summed inside its GEMM), the norm by autograd
//   layer_chunk/T/c       one decoder layer on the chunk [s, T), s = T - c > 0: q, attention over the K/V prefix
//                         [0, T) (constants; dK/dV go into the layer's sums), o-proj + MLP (step 2)
//   attention_chunk/T/c   chunk_attention of a [B, n_h, c, hd] query chunk over the keys [0, T), s = T - c
//   kv_chunk/c            the K/V path of c tokens: input norm, k/v projections, k-norm, RoPE (step 3)
//   step/<method>/T       one whole SFT step (forward + backward) of every method of the catalogue at its typical
//                         setting for T (several chunks, the last one short): what the pieces above add up to
//   file_tier/<op>/MiB    the CPU's offload tier (core/offload/file_tier.cpp) on a tensor of MiB: store (a new
//                         reserved file, mapped, the copy into its pages), fetch (the copy back), and the same
//                         through the disk itself: store_synced (+ msync: the pages written to the device) and
//                         fetch_cold (the pages first dropped, MADV_PAGEOUT: read back from the device). Folder:
//                         --offload-dir (default the system's temporary folder); bytes_per_second counts the tensor.
// Our flags (--device, --preset, --dtype, --short) are taken out of argv; everything else goes to Google Benchmark
// (--benchmark_filter, --benchmark_out=FILE --benchmark_out_format=json, ...).
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <torch/csrc/autograd/autograd.h>

#include "baselines/methods.h"
#include "core/model/gemm.h"
#include "core/objectives/batch.h"
#include "core/model/chunk_attention.h"
#include "core/methods/streambp.h"
#include "core/io/dtype.h"
#include "core/methods/flop_model.h"
#include "core/model/model.h"
#include "core/offload/offload_tier.h"
#include "core/methods/phase.h"
#include "core/objectives/sft.h"
#include "core/methods/streaming.h"
#include "experiments/device.h"
#include "experiments/provenance.h"
#include "experiments/setup.h"
#include "core/io/input_error.h"

namespace {

constexpr std::int64_t kBatch = 1;  // B: the paper's long-sequence setting
constexpr int kLayer = 0;           // every decoder layer has the same shapes
constexpr std::uint64_t kSeed = 0;

struct Flags {
  std::string device = "cpu", preset = "tiny", dtype = "fp32", offload_dir;
  bool short_mode = false;  // CI: one tiny size per benchmark, 0.01 s minimum time each
};

void print_help() {
  fmt::print(
      "streambp_bench [--device cpu|cuda[:N]] [--preset NAME] [--dtype fp32|fp64|bf16] [--short] [benchmark flags]\n"
      "  --device   where the model and inputs live (default cpu)\n"
      "  --preset   model preset (default tiny; see streambp run --help)\n"
      "  --dtype    model dtype (default fp32)\n"
      "  --short    tiny sizes and --benchmark_min_time=0.01 (CI)\n"
      "  --offload-dir  the folder of the file_tier benchmarks' files (default the system's temporary folder)\n\n");
  benchmark::PrintDefaultHelp();
}

// Takes our flags ("--flag value" or "--flag=value") out of argv, keeping the program name and the rest in order.
Flags take_our_flags(int& argc, char** argv) {
  Flags flags;
  int kept = 1;
  const std::pair<std::string, std::string*> valued[] = {
      {"--device", &flags.device}, {"--preset", &flags.preset}, {"--dtype", &flags.dtype},
      {"--offload-dir", &flags.offload_dir}};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    bool ours = arg == "--short";
    if (ours) flags.short_mode = true;
    for (const auto& [flag, value] : valued) {
      if (arg == flag) {
        if (i + 1 == argc) throw sbp::InputError(flag + " needs a value");
        *value = argv[++i];
        ours = true;
      } else if (arg.rfind(flag + "=", 0) == 0) {
        *value = arg.substr(flag.size() + 1);
        ours = true;
      }
    }
    if (!ours) argv[kept++] = argv[i];
  }
  argc = kept;
  return flags;
}

struct Bench {
  sbp::Model& model;  // a step writes its gradients
  c10::Device device;
  std::string offload_dir;  // the file tier's folder
  bool failed = false;  // a benchmark ended in an error: the exit code says so
  at::TensorOptions options() const { return at::TensorOptions().dtype(model.dtype()).device(device); }
};

at::Tensor leaf(const at::Tensor& t) { return t.detach().requires_grad_(true); }

// The gradients of `outputs` with respect to `inputs` for the given output gradients, as StreamBP takes them: no
// .grad is touched (a step sums them itself), and the graph is freed.
void backward(const std::vector<at::Tensor>& outputs, std::vector<at::Tensor> inputs,
              const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grad_outputs) {
  inputs.insert(inputs.end(), params.begin(), params.end());
  torch::autograd::grad(outputs, inputs, grad_outputs, /*retain_graph=*/false, /*create_graph=*/false,
                        /*allow_unused=*/true);
}

// Where StreamBP sums a layer's K/V gradients (fp32 for a bf16 model): [B, n_kv, T, hd] each, zeroed once; each
// iteration adds into them, as each chunk of a step does.
sbp::KVGradSums kv_sums(const at::Tensor& K) {
  const auto options = K.options().dtype(sbp::ChunkGradients::accumulation_dtype(K.scalar_type()));
  return {at::zeros(K.sizes(), options), at::zeros(K.sizes(), options)};
}

sbp::Batch on_device(sbp::Batch batch, const c10::Device& device) {
  batch.input_ids = batch.input_ids.to(device);
  batch.attention_mask = batch.attention_mask.to(device);
  for (auto& [name, tensor] : batch.fields) tensor = tensor.to(device);
  return batch;
}

// Matrix-product FLOPs per iteration (2 per multiply-add, flop_model.h's convention). A trained projection's
// backward is twice its forward (dX and dW).
double projection_flops(std::int64_t tokens, std::int64_t in, std::int64_t out) {
  return 3 * 2.0 * double(kBatch * tokens) * double(in) * double(out);
}
// QKᵀ and PV of the last c queries of T per head: the prefix's c·(T - c) pairs and the causal diagonal block's
// c(c+1)/2 (the pairs chunk_attention scores, as streambp_flops counts them), and the flash backward.
double attention_flops(const sbp::ModelConfig& m, std::int64_t c, std::int64_t T) {
  const double pairs = double(c) * double(T - c) + double(c) * double(c + 1) / 2;
  return (1 + sbp::FlopTerms::kAttentionBackward) * 4.0 * double(kBatch * m.num_attention_heads * m.head_dim) * pairs;
}

void set_rates(benchmark::State& state, std::int64_t tokens, double flops) {
  state.counters["tokens_per_second"] =
      benchmark::Counter(double(kBatch * tokens), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["flop_per_second"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

// Times `iteration`. One untimed call first creates what a step's later chunks reuse (the head's lm_head sum and
// logits block). On CUDA each iteration waits for its kernels (sbp::synchronize, as a step does), or the loop
// would time kernel launches only; on the CPU ATen ops are synchronous.
template <typename F>
void time_iterations(benchmark::State& state, const Bench& bench, F&& iteration) {
  iteration();
  for (auto _ : state) {
    iteration();
    sbp::synchronize(bench.device);
  }
}

void head_chunk(benchmark::State& state, Bench& bench) {
  const auto& model = bench.model;
  const auto& m = model.config();
  const auto c_h = state.range(0);
  // One head chunk of c_h tokens at start 0, every position but the last scored (labels = input_ids).
  const auto batch = on_device(sbp::random_sft_batch(m, {kBatch, c_h, 0.0, 0.0, kSeed}), bench.device);
  const sbp::SftObjective sft;
  const auto objective = sft.prepare(batch, m);
  const auto h_last = at::randn({kBatch, c_h, m.hidden_size}, bench.options());  // [B, c_h, d]
  const std::vector<at::Tensor> norm = {model.final_norm_weight()};
  at::Tensor lm_sum;         // [V, d]: the lm_head gradient sum, live across chunks
  sbp::Model::HeadBuffers buffers;  // [B, c_h, V]: the blocks every chunk reuses
  time_iterations(state, bench, [&] {
    const auto h = leaf(h_last);
    const auto hn = model.final_norm(h);  // [B, c_h, d], with a graph
    at::Tensor logits;                    // [B, c_h, V]; becomes dLoss/dlogits
    {
      at::NoGradGuard no_grad;
      logits = model.logits(hn, &buffers);
    }
    benchmark::DoNotOptimize(objective.chunk_loss_and_grad(logits, 0));
    const auto grad_hn = model.logits_backward(logits, hn, lm_sum, &buffers);  // [B, c_h, d]
    logits.reset();
    backward({hn}, {h}, norm, {grad_hn});
  });
  set_rates(state, c_h, projection_flops(c_h, m.hidden_size, m.vocab_size));
}

void layer_chunk(benchmark::State& state, Bench& bench) {
  const auto& model = bench.model;
  const auto& m = model.config();
  const auto T = state.range(0), c = state.range(1), s = T - c;
  const auto h_in = at::randn({kBatch, T, m.hidden_size}, bench.options());  // [B, T, d]: the layer's input
  // [B, n_kv, T, hd]: the prefix's and the chunk's keys and values, no graph (step 1)
  const auto kv = sbp::kv_chunked(model, kLayer, h_in, c);
  const auto K = kv[0], V = kv[1];
  const auto sums = kv_sums(K);
  const auto grad_out = at::randn({kBatch, c, m.hidden_size}, bench.options());  // dLoss/dH_out of the chunk
  const auto params = model.layer_trainable(kLayer);
  // StreamBP's own chunk body (the last chunk of step 2: the most keys), not a copy of it.
  const sbp::StreamBP streambp({c, c});
  time_iterations(state, bench, [&] { streambp.layer_chunk_backward(model, kLayer, h_in, s, T, s, K, V, sums, grad_out, params); });
  const auto d = m.hidden_size;
  set_rates(state, c,
            projection_flops(c, d, m.q_width()) + projection_flops(c, m.q_width(), d) +
                3 * projection_flops(c, d, m.intermediate_size) + attention_flops(m, c, T));
}

void attention_chunk(benchmark::State& state, Bench& bench) {
  const auto& m = bench.model.config();
  const auto T = state.range(0), c = state.range(1), s = T - c;
  const auto n_h = m.num_attention_heads, n_kv = m.num_key_value_heads, hd = m.head_dim;
  const auto q_in = at::randn({kBatch, n_h, c, hd}, bench.options());  // [B, n_h, c, hd]
  const auto k = at::randn({kBatch, n_kv, T, hd}, bench.options());    // [B, n_kv, T, hd]
  const auto v = at::randn({kBatch, n_kv, T, hd}, bench.options());
  const auto sums = kv_sums(k);
  const auto grad_o = at::randn({kBatch, n_h, c, hd}, bench.options());
  const double scale = 1.0 / std::sqrt(double(hd));
  time_iterations(state, bench, [&] {
    const auto q = leaf(q_in);
    backward({sbp::chunk_attention(q, k, v, s, scale, &sums)}, {q}, {}, {grad_o});
  });
  set_rates(state, c, attention_flops(m, c, T));
}

void kv_chunk(benchmark::State& state, Bench& bench) {
  const auto& model = bench.model;
  const auto& m = model.config();
  const auto c = state.range(0), s = c;  // the second chunk: the start only moves RoPE
  const auto h_in = at::randn({kBatch, 2 * c, m.hidden_size}, bench.options());                 // [B, 2c, d]
  const auto dK = at::randn({kBatch, m.num_key_value_heads, 2 * c, m.head_dim}, bench.options());  // [B, n_kv, 2c, hd]
  const auto dV = at::randn({kBatch, m.num_key_value_heads, 2 * c, m.head_dim}, bench.options());
  const auto params = model.layer_trainable(kLayer);
  // StreamBP's own step-3 chunk body, on the second chunk's rows.
  const sbp::StreamBP streambp({c, c});
  time_iterations(state, bench, [&] { streambp.kv_chunk_backward(model, kLayer, h_in, s, 2 * c, s, dK, dV, params); });
  set_rates(state, c, 2 * projection_flops(c, m.hidden_size, m.kv_width()));
}

// One step of `spec_at(T)` on a random SFT batch of T tokens, its gradients freed by the next step as a training
// loop's would be; the FLOPs are the method's own model of them (core/methods/flop_model.h).
void method_step(benchmark::State& state, Bench& bench, const std::function<std::string(std::int64_t)>& spec_at) {
  const auto T = state.range(0);
  auto method = sbp::make_method(spec_at(T));
  sbp::SftObjective objective;
  const auto batch = on_device(sbp::random_sft_batch(bench.model.config(), {kBatch, T, 0.0, 0.0, kSeed}), bench.device);
  time_iterations(state, bench, [&] { method->step(bench.model, objective, batch); });
  const auto prepared = objective.prepare(batch, bench.model.config());
  const sbp::Workload workload{bench.model.config(), bench.model.dtype(), kBatch, T, prepared.buffer_bytes_per_token(),
                               prepared.needs_statistics()};
  set_rates(state, T, method->flops(workload));
  bench.model.zero_grad();
}

// The file tier (core/offload/file_tier.cpp) on a CPU tensor of range(0) MiB: what a checkpoint's store and fetch
// cost, and the same with the disk in the path (op: store, fetch, store_synced, fetch_cold). The tier's files are
// the page cache's until the kernel writes them: store and fetch time memory, store_synced adds msync (the pages
// written to the device), fetch_cold drops the stored pages first (MADV_PAGEOUT, outside the timing) so that the
// fetch reads them from it. A page the kernel cannot drop (MADV_PAGEOUT unsupported) is an error row.
enum class TierOp { store, fetch, store_synced, fetch_cold };
void file_tier_op(benchmark::State& state, Bench& bench, TierOp op) {
  const auto bytes = state.range(0) << 20;
  const auto tier = sbp::make_file_tier(bench.offload_dir);
  const auto source = at::rand({bytes / 4}, at::kFloat);  // touched: no first-fault in the timed copy's source
  const auto sync = [](const at::Tensor& t, int flags) {
    if (::msync(t.data_ptr(), std::size_t(t.nbytes()), flags) != 0)
      throw std::runtime_error(std::string("msync: ") + std::strerror(errno));
  };
  at::Tensor stored;
  if (op == TierOp::fetch || op == TierOp::fetch_cold) {
    stored = tier->store(source);
    sync(stored, MS_SYNC);
  }
  for (auto _ : state) {
    if (op == TierOp::fetch_cold) {
      state.PauseTiming();
      if (::madvise(stored.data_ptr(), std::size_t(stored.nbytes()), MADV_PAGEOUT) != 0)
        throw std::runtime_error(std::string("madvise(MADV_PAGEOUT): ") + std::strerror(errno));
      state.ResumeTiming();
    }
    if (op == TierOp::store || op == TierOp::store_synced) {
      auto host = tier->store(source);
      if (op == TierOp::store_synced) sync(host, MS_SYNC);
      benchmark::DoNotOptimize(host.data_ptr());
    } else {
      auto back = tier->fetch(stored, bench.device);
      benchmark::DoNotOptimize(back.data_ptr());
    }
  }
  state.SetBytesProcessed(std::int64_t(state.iterations()) * bytes);
  state.counters["tensor_bytes"] = double(bytes);
}

// Registers `body` under `name`. An exception (out of memory, a size the preset cannot take) becomes that
// benchmark's error row and a non-zero exit, not a terminated process.
benchmark::internal::Benchmark* add(const std::string& name, std::function<void(benchmark::State&, Bench&)> body,
                                    Bench& bench) {
  auto* b = benchmark::RegisterBenchmark(name.c_str(), [body, &bench](benchmark::State& state) {
    std::string error;
    try {
      body(state, bench);
      return;
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = e.what();
    }
    bench.failed = true;
    state.SkipWithError(error.c_str());
  });
  // Wall-clock time: intra-op threads do work the main thread's CPU time misses, and on CUDA that time is only the
  // launches. The counters' rates follow it.
  return b->UseRealTime()->Unit(benchmark::kMillisecond);
}

void register_benchmarks(Bench& bench, bool short_mode) {
  using Sizes = std::vector<std::vector<std::int64_t>>;
  // {T, c}: the chunk [T - c, T) over the prefix [0, T).
  const Sizes chunks = short_mode ? Sizes{{64, 16}} : Sizes{{1024, 256}, {4096, 256}, {4096, 1024}};
  const Sizes tokens = short_mode ? Sizes{{16}} : Sizes{{256}, {1024}};
  auto with_sizes = [](benchmark::internal::Benchmark* b, const Sizes& sizes) {
    for (const auto& size : sizes) b->Args(size);
  };
  with_sizes(add("head_chunk", head_chunk, bench)->ArgNames({"c_h"}), tokens);
  with_sizes(add("layer_chunk", layer_chunk, bench)->ArgNames({"T", "c"}), chunks);
  with_sizes(add("attention_chunk", attention_chunk, bench)->ArgNames({"T", "c"}), chunks);
  with_sizes(add("kv_chunk", kv_chunk, bench)->ArgNames({"c"}), tokens);
  if (bench.device.is_cpu()) {
    const Sizes mebibytes = short_mode ? Sizes{{1}} : Sizes{{64}, {256}};
    for (const auto& [name, op] : {std::pair{"store", TierOp::store}, {"fetch", TierOp::fetch},
                                   {"store_synced", TierOp::store_synced}, {"fetch_cold", TierOp::fetch_cold}}) {
      const auto body = [op](benchmark::State& state, Bench& b) { file_tier_op(state, b, op); };
      with_sizes(add(std::string("file_tier/") + name, body, bench)->ArgNames({"MiB"}), mebibytes);
    }
  }
  const Sizes lengths = short_mode ? Sizes{{64}} : Sizes{{1024}, {4096}};
  for (const auto& entry : sbp::builtin_method_entries()) {
    auto typical = entry.tests.typical;
    const auto body = [typical](benchmark::State& state, Bench& b) { method_step(state, b, typical); };
    with_sizes(add("step/" + entry.name, body, bench)->ArgNames({"T"}), lengths);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (const auto note = sbp::coherent_cpu_configuration(); !note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  const auto command = sbp::shell_quote_argv(argc, argv);
  try {
    const auto flags = take_our_flags(argc, argv);
    std::vector<char*> args(argv, argv + argc);
    std::string min_time = "--benchmark_min_time=0.01";  // 1.7.1 reads a double in seconds (1.8 wants "0.01s")
    if (flags.short_mode) args.insert(args.begin() + 1, min_time.data());  // before the user's, which win
    int benchmark_argc = int(args.size());
    args.push_back(nullptr);
    benchmark::Initialize(&benchmark_argc, args.data(), print_help);
    if (benchmark::ReportUnrecognizedArguments(benchmark_argc, args.data())) return 2;

    const auto device = sbp::parse_device(flags.device);
    sbp::ModelSource source;
    source.preset = flags.preset;
    const auto model = sbp::build_model(source, sbp::parse_dtype(flags.dtype), kSeed);
    model->to(device);

    Bench bench{*model, device,
                flags.offload_dir.empty() ? std::filesystem::temp_directory_path().string() : flags.offload_dir};
    register_benchmarks(bench, flags.short_mode);
    const auto provenance = sbp::collect_provenance(command, sbp::describe_device(device));
    benchmark::AddCustomContext("device", sbp::describe_device(device));
    benchmark::AddCustomContext("preset", flags.preset);
    benchmark::AddCustomContext("dtype", sbp::dtype_name(model->dtype()));
    benchmark::AddCustomContext("batch_size", std::to_string(kBatch));
    benchmark::AddCustomContext("threads", std::to_string(provenance.threads));
    // Spinning OpenMP workers change CPU timings by up to 80x on a busy machine (Makefile, bench).
    const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
    benchmark::AddCustomContext("omp_wait_policy", wait_policy ? wait_policy : "unset");
    benchmark::AddCustomContext("torch_version", provenance.torch_version);
    benchmark::AddCustomContext("commit", provenance.commit);
    benchmark::AddCustomContext("machine", provenance.machine);
    benchmark::AddCustomContext("date_utc", provenance.date_utc);
    benchmark::AddCustomContext("offload_dir", bench.offload_dir);
    benchmark::AddCustomContext("command", provenance.command);
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    return bench.failed ? 1 : 0;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "streambp_bench: error: {}\n", e.what_without_backtrace());
  } catch (const std::exception& e) {
    fmt::print(stderr, "streambp_bench: error: {}\n", e.what());
  }
  return 2;
}
