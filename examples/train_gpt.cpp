// train_gpt: trains the reference GPT on byte-level text -- by default a
// synthetic language generated here, or any text file with --data -- and
// prints one line per step; with --record FILE it writes a JSON run record
// (config, mesh, per-step losses, tokens/s, model FLOPs, MFU, memory, the
// build and runtime, exposed communication, input stalls, stragglers and loss
// parity against --baseline; fields in docs/records.md, schema in
// docs/schema/run_record.schema.json).
//
//   mpirun -n 1 train_gpt --layers 4 --d-model 128 --heads 4 --seq 64 --batch 8 --steps 300 --record run.json
//
// --batch is the global batch (sequences per optimizer step); --microbatches
// splits it for gradient accumulation, and --mesh dp=N splits it over N
// data-parallel ranks (each takes batch / dp sequences): the same command line
// on any mesh trains the same model on the same data.
//
//   mpirun -n 4 train_gpt --mesh dp=4 --dp fsdp --batch 16 --record run.json
//
// --mesh dp=A,tp=B adds tensor parallelism (each layer's matrices split over
// B ranks, --sequence-parallel for the token-sharded variant); it composes
// with every --dp mode, and the loss curve stays the one-process curve.
//
//   mpirun -n 8 train_gpt --mesh dp=2,tp=4 --dp fsdp --sequence-parallel --record run.json
//
// --mesh dp=A,pp=B adds pipeline parallelism: B stages of consecutive layers
// run --schedule gpipe|1f1b|interleaved:V|zb over --microbatches, with stage
// boundaries from --stages auto|equal|L1,L2,...
//
//   mpirun -n 4 train_gpt --mesh dp=2,pp=2 --schedule 1f1b --microbatches 4 --stages auto
//
// All three compose: --mesh dp=A,pp=B,tp=C splits each stage's layers over
// C consecutive ranks (TP innermost), and the record is the same as for dp.
//
//   mpirun -n 8 train_gpt --mesh dp=2,pp=2,tp=2 --schedule 1f1b --record run.json
//
// --mesh ...,cp=D splits every sequence over D context-parallel ranks
// (--context ring|allgather|alltoall, in the causally balanced layout); it
// composes with dp, tp and pp, and the loss curve stays the one-process curve.
//
//   mpirun -n 4 train_gpt --mesh dp=2,cp=2 --context ring --dp fsdp --seq 1024 --record run.json
#include "train_gpt_impl.hpp"

namespace {

using namespace train_gpt;

int run(int argc, char** argv, weft::Environment& env) {
  if (weft::FlagParser::help_requested(argc, argv)) {  // wherever it stands, before any flag is checked
    if (env.world().rank() == 0) {  // once, not once per rank
      std::fputs(kUsage, stdout);
      std::fputs(train_gpt_checkpoint::Flags::usage, stdout);
      std::fflush(stdout);
    }
    return 0;
  }
  const int world = env.world().size();
  // Ranks sharing this node: the memory limit's share and the BLAS threads.
  const int ranks_per_node = weft::ranks_on_node(MPI_COMM_WORLD);
  // Every rank checks what it can; the ranks then agree, and an error is
  // printed once (by the lowest rank that found one) before anything is allocated.
  Checked checked;
  std::string error;
  try {
    checked = check_before_step_zero(argc, argv, world, env.world().rank(), ranks_per_node);
  } catch (const weft::Error& e) {
    error = e.what();
  }
  if (train_gpt_checks::report_once(env.world(), error, "train_gpt")) return 2;
  const Options& opts = checked.options;
  const Options& o = opts;
  const int ndp = checked.ndp, ntp = o.tp;
  const std::string memory_line = "estimated peak memory per rank " + train_gpt_checks::human_bytes(checked.estimate) +
                                  (checked.limit > 0 ? " (limit " + train_gpt_checks::human_bytes(checked.limit) + ": " +
                                                           checked.limit_source + ")"
                                                     : std::string(" (limit unknown: no MemAvailable, no --memory-limit)"));
  if (o.check_only) {
    if (env.world().rank() == 0)
      std::printf("train_gpt: flags accepted: mesh dp=%d,tp=%d,pp=%d,cp=%d,ep=%d (%s), %zu sequences per rank per microbatch; needs %d ranks; %s; deadline %g s (WEFT_DEADLINE)\n",
                  ndp, ntp, o.pp, o.cp, o.ep, weft::parallel::to_string(o.dp_mode), o.model.batch, ndp * ntp * o.pp * o.cp * o.ep,
                  memory_line.c_str(), weft::detail::checked_defaults().deadline_s);
    return 0;
  }
  if (env.world().rank() == 0) std::printf("train_gpt: %s\n", memory_line.c_str());
  if (!checked.resume_note.empty()) std::printf("train_gpt: note: %s\n", checked.resume_note.c_str());
  // Coefficients outside their usual range: said once, before step 0 (the divergence guard watches the run).
  if (env.world().rank() == 0) {
    const std::map<std::string, double> coefficient = {{"--weight-decay", o.weight_decay}, {"--aux-loss", o.model.aux_loss},
                                                       {"--z-loss", o.model.z_loss}, {"--bias-balance", o.model.bias_balance}};
    for (const auto& r : kCoefficients)
      if (coefficient.at(r.flag) > r.warn)
        std::printf("train_gpt: warning: %s %g is outside the usual range %s; the run may diverge\n", r.flag,
                    coefficient.at(r.flag), r.usual);
  }
  const auto bt = weft::ops::set_blas_threads(int(o.threads), ranks_per_node);
  // How the threads sit on the cores: rank 0 says it, and a rank whose binding starves its threads warns.
  weft::ops::print_host_threads("train_gpt", env.world().rank(), weft::ops::host_binding(bt.threads, ranks_per_node));

  std::vector<std::uint8_t> bytes = o.data.empty() ? weft::data::synthetic_corpus(o.corpus_bytes, 0) : weft::data::read_corpus(o.data);
  const std::string data_name = o.data.empty() ? "synthetic" : o.data;
  WEFT_REQUIRE(bytes.size() >= o.model.seq + 1, ConfigError, "--data ", data_name, " has ", bytes.size(),
               " bytes, fewer than --seq + 1 = ", o.model.seq + 1, "; use a longer file or a shorter --seq");
  const double unigram = weft::data::unigram_entropy(bytes);
  weft::data::TokenStream stream(bytes, opts.model.seq, opts.model.seed);
  const RunArgs args{opts, env, ndp, stream, bt, ranks_per_node, unigram, data_name};
  switch (part_of(opts)) {
    case Part::data_tensor: return run_part<Part::data_tensor>(args);
    case Part::data_tensor_bf16: return run_part<Part::data_tensor_bf16>(args);
    case Part::data_tensor_fp16: return run_part<Part::data_tensor_fp16>(args);
    case Part::expert: return run_part<Part::expert>(args);
#ifndef WEFT_TRAIN_GPT_NO_PIPELINES
    case Part::pipeline_replicated: return run_part<Part::pipeline_replicated>(args);
    case Part::pipeline_zero1: return run_part<Part::pipeline_zero1>(args);
    case Part::pipeline_zero2: return run_part<Part::pipeline_zero2>(args);
    case Part::pipeline_fully_shard: return run_part<Part::pipeline_fully_shard>(args);
#else
    default: break;  // pp > 1 was refused before step 0 (check_before_step_zero)
#endif
  }
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  weft::Environment env(argc, argv);
  // An allocation that failed: the other ranks may be waiting for this one,
  // so the job ends here, with the tensor named.
  auto out_of_memory = [&](const weft::AllocationError& a) {
    std::fprintf(stderr, "train_gpt: error: rank %d: %s\n", env.world().rank(), a.what());
    std::fflush(stderr);
    if (env.world().size() > 1) MPI_Abort(MPI_COMM_WORLD, 5);
    return 5;
  };
  try {
    return run(argc, argv, env);
  } catch (const weft::AllocationError& a) {
    return out_of_memory(a);
  } catch (const weft::Error& e) {
    // Printed once in the job: by rank 0 when every rank failed alike, else
    // by the rank that failed (or the one elected for a deadline), which ends the job.
    return weft::report_error_once(env, e, "train_gpt", 2);
  } catch (const std::exception& e) {  // Kokkos' own report of a failed allocation anywhere
    const auto a = weft::as_allocation_error(e);
    if (!a) throw;
    return out_of_memory(*a);
  }
}
