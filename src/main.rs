use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;
use turnstile::cli::{Cli, Command, LogFormat};
use turnstile::{config, server};

fn init_logs(level: &str, format: LogFormat) {
    let filter = EnvFilter::try_new(level).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn check(args: &turnstile::cli::CheckArgs) -> ExitCode {
    match config::load(&args.config) {
        Ok(rules) => {
            for domain in rules.domains() {
                println!("domain {}: {} rules", domain.name(), domain.rule_count());
            }
            println!(
                "{}: OK (version {})",
                args.config.display(),
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
        Command::Serve(args) => {
            init_logs(&args.log_level, args.log_format);
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(runtime) => runtime,
                Err(error) => {
                    eprintln!("cannot start the runtime: {error}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(server::serve(*args)) {
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
