use std::process::ExitCode;

use clap::Parser;

/// Load a RateLimitService over gRPC and report throughput and latency.
#[derive(Parser)]
#[command(name = "turnstile-bench", version)]
struct Cli {
    #[command(flatten)]
    args: turnstile_bench::BenchArgs,
}

fn main() -> ExitCode {
    match turnstile_bench::main(Cli::parse().args) {
        Ok(_) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("turnstile-bench: {error:#}");
            ExitCode::FAILURE
        }
    }
}
