//! Where the rules come from: files (`--config`, or the reference's runtime layout, which
//! `check` and `explain` read too), or an xDS control plane; and how files are watched.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use super::{XdsArgs, duration};
use crate::config::Source;

/// The rule files, for `serve`, `check` and `explain` (no heading of its own: clap would
/// keep it for the flags that follow in `explain`).
#[derive(Debug, Args)]
pub struct RulesArgs {
    /// A rules file, or a directory whose *.yaml / *.yml files are loaded. Without it, the
    /// reference's layout is read: every file below RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/
    /// RUNTIME_APPDIRECTORY.
    #[arg(long, env = "TURNSTILE_CONFIG")]
    pub config: Option<PathBuf>,
    #[arg(
        long,
        env = "RUNTIME_ROOT",
        default_value = "/srv/runtime_data/current"
    )]
    pub runtime_root: PathBuf,
    #[arg(long, env = "RUNTIME_SUBDIRECTORY", default_value = "")]
    pub runtime_subdirectory: String,
    #[arg(long, env = "RUNTIME_APPDIRECTORY", default_value = "config")]
    pub runtime_appdirectory: String,
    /// Skip dotfiles and dot-directories in the runtime layout.
    #[arg(long, env = "RUNTIME_IGNOREDOTFILES")]
    pub runtime_ignoredotfiles: bool,
    /// Let one domain span several files (descriptors are merged; duplicates are errors).
    #[arg(long, env = "MERGE_DOMAIN_CONFIG")]
    pub merge_domain_config: bool,
}

impl RulesArgs {
    pub fn source(&self) -> Source {
        match &self.config {
            Some(path) => Source::path(path.clone(), self.merge_domain_config),
            None => Source::runtime(
                &self.runtime_root,
                &self.runtime_subdirectory,
                &self.runtime_appdirectory,
                self.runtime_ignoredotfiles,
                self.merge_domain_config,
            ),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConfigType {
    /// Rule files (--config or the runtime layout), reloaded when they change.
    #[value(name = "FILE")]
    File,
    /// Rules pushed by an xDS control plane (ADS, state of the world).
    #[value(name = "GRPC_XDS_SOTW")]
    GrpcXdsSotw,
}

/// `serve`'s rules: the files, or a control plane, and how they are kept current.
#[derive(Debug, Args)]
#[command(next_help_heading = "Rules")]
pub struct RuleSourceArgs {
    #[command(flatten)]
    pub files: RulesArgs,
    /// Where rules come from.
    #[arg(
        long,
        env = "CONFIG_TYPE",
        value_enum,
        ignore_case = true,
        default_value = "FILE"
    )]
    pub config_type: ConfigType,
    /// Poll the rules at this period instead of watching them with inotify (for file
    /// systems without change events). Either way, SIGHUP forces a reload.
    #[arg(long, env = "TURNSTILE_CONFIG_POLL_INTERVAL", value_parser = duration)]
    pub config_poll_interval: Option<Duration>,
    #[command(flatten)]
    pub xds: XdsArgs,
}
