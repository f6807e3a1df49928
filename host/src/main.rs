//! The `stapo` command line. Each subcommand lives in `commands/`; this file is
//! the table of contents.

mod commands;

use std::process::ExitCode;

use clap::Parser;
use commands::{Cli, Command};

fn main() -> ExitCode {
    // candle's element-wise CPU kernels spin-wait on a thread pool that fights
    // rayon (matmuls and the fused ops) for the same cores; one thread there
    // measured ~25% less CPU per backward. An explicit setting wins.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    keep_freed_memory();
    let cli = Cli::parse();
    // Tests of preemption raise a signal at a chosen point of a step (see guard::signal).
    if let Some(spec) = std::env::var_os("STAPO_TEST_SIGNAL") {
        match stapo::guard::signal::TestSignal::parse(&spec.to_string_lossy()) {
            Ok(t) => stapo::guard::signal::arm_test_signal(t),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    stapo::guard::set_allow_unused_tensors(cli.allow_unused);
    // STAPO_NO_FUSED and STAPO_RECOMPUTE are read here, once; the library
    // takes them as options.
    match commands::model_options_from_env() {
        Ok(o) => o.set_process_default(),
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::FAILURE;
        }
    }
    // Under an MPI launcher every rank runs this same command; only `run`, `update`
    // (each rank its share of the rollouts, rank 0 writes), `bench shard` and `bench async
    // --rollout-ranks` are
    // data-parallel, so the others would repeat each other's work and files.
    let world = match stapo::dist::init() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let parallel = match &cli.command {
        Command::Run(_) | Command::Update(_) => true,
        Command::Bench(a) => {
            a.what == commands::bench::What::Shard
                || (a.what == commands::bench::What::Async && a.rollout_ranks > 0)
        }
        _ => false,
    };
    if world.size() > 1 && !parallel {
        eprintln!(
            "error: only `stapo run`, `stapo update`, `stapo bench shard` and `stapo bench async \
             --rollout-ranks` run on several MPI ranks; \
             start other commands without mpirun"
        );
        stapo::dist::finalize();
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Run(a) => commands::run::run(a),
        Command::Repl(a) => commands::repl::run(a),
        Command::Init(a) => commands::model::init(a),
        Command::Generate(a) => commands::model::generate(a),
        Command::Score(a) => commands::model::score(a),
        Command::Eval(a) => commands::eval::run(a),
        Command::Update(a) => commands::update::run(a),
        Command::Verify(a) => commands::verify::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::Parity(a) => commands::parity::run(a),
        Command::Merge(a) => commands::lora::merge(a),
    };
    match result {
        Ok(()) => {
            stapo::dist::finalize();
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            // The other ranks may be waiting in a collective: end them too.
            stapo::dist::abort(1);
            stapo::dist::finalize();
            ExitCode::FAILURE
        }
    }
}

/// glibc's malloc hands blocks of more than 128 KiB (up to 32 MiB as it adapts) to `mmap`
/// and back to the kernel on free, and trims the heap's free top: every update step then
/// faults in and zeroes its activations' pages again (~15% of the process's CPU time in
/// the kernel at the bundled model's shape). Every block from the heap (no `mmap` at any
/// size: an MLP activation of the bundled model's update is 50 MB, over the largest
/// threshold glibc accepts), and freed memory kept for the next step, leave only the
/// first step's faults and shorten the update there at the same or a lower peak RSS
/// (docs/performance.md). A `GLIBC_TUNABLES` or `MALLOC_*` setting in the environment
/// wins.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        const M_MMAP_MAX: i32 = -4;
        let set_outside = std::env::vars_os().any(|(k, v)| {
            let (k, v) = (k.to_string_lossy(), v.to_string_lossy());
            k.starts_with("MALLOC_") || (k == "GLIBC_TUNABLES" && v.contains("malloc"))
        });
        if !set_outside {
            // SAFETY: mallopt only changes allocator parameters; called before any thread starts.
            unsafe {
                mallopt(M_MMAP_THRESHOLD, 32 << 20);
                mallopt(M_MMAP_MAX, 0);
                mallopt(M_TRIM_THRESHOLD, i32::MAX);
            }
        }
    }
}
