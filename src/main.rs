use std::process::ExitCode;

use clap::Parser;
use turnstile::app::cli::{Cli, Command};
use turnstile::{app::run, ops::telemetry};

// glibc's malloc spent about a quarter of a call's CPU in its slow paths (fast bins
// consolidated by every buffer-sized allocation); mimalloc keeps small allocations cheap.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn check(args: &turnstile::app::cli::CheckArgs) -> ExitCode {
    let source = args.rules.source();
    match source.load() {
        Ok(rules) => {
            for domain in rules.domains() {
                println!("domain {}: {} rules", domain.name(), domain.rule_count());
            }
            println!(
                "{}: OK (version {})",
                source.path.display(),
                rules.version()
            );
            ExitCode::SUCCESS
        }
        Err(errors) => {
            eprintln!("{errors}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check(args) => check(&args),
        Command::Explain(args) => turnstile::app::explain::main(&args),
        Command::RedisScript(args) => {
            // The text, and on stderr the name turnstile calls it by.
            let (text, name) = if args.library {
                turnstile::backend::redis::batch_library()
            } else {
                turnstile::backend::redis::batch_source()
            };
            print!("{text}");
            eprintln!("{name}");
            ExitCode::SUCCESS
        }
        Command::Serve(args) => {
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(runtime) => runtime,
                Err(error) => {
                    eprintln!("cannot start the runtime: {error}");
                    return ExitCode::FAILURE;
                }
            };
            // The trace exporter needs the runtime; it is flushed when dropped, at exit.
            let telemetry = {
                let _entered = runtime.enter();
                let observability = &args.observability;
                telemetry::init(
                    &observability.log_level,
                    observability.log_format,
                    &observability.tracing,
                )
            };
            let _telemetry = match telemetry {
                Ok(telemetry) => telemetry,
                Err(error) => {
                    eprintln!("turnstile: {error:#}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(run::serve(*args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    tracing::error!("{error:#}");
                    eprintln!("turnstile: {error:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
