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
    let cli = Cli::parse();
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
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
