use std::process::ExitCode;

use clap::Parser;
use turnstile_bench::Cli;

fn main() -> ExitCode {
    match turnstile_bench::main(Cli::parse().args) {
        Ok(_) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("turnstile-bench: {error:#}");
            ExitCode::FAILURE
        }
    }
}
