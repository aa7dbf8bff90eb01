//! What an answer says beyond OK and OVER_LIMIT: how a refusal is charged, the rate-limit
//! headers and metadata it carries, and the reference's quota and shadow modes.

use clap::{Args, ValueEnum};

use crate::decision::Charging;
use crate::service::response::{Headers, MetadataOn, ResponseSettings};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ChargingArg {
    /// A refused request charges none of its descriptors.
    Atomic,
    /// Each admitted descriptor is charged even when another refuses (the reference).
    PerDescriptor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HeadersArg {
    Off,
    /// RateLimit-Limit / -Remaining / -Reset, as the reference.
    Legacy,
    /// RateLimit-Policy and RateLimit (IETF draft).
    Ietf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MetadataArg {
    /// Answers where a limit said no (OVER_LIMIT, or let through by shadow mode).
    Refusals,
    /// Every answer (`true`, the setting's old boolean, means this).
    #[value(alias = "true")]
    All,
    #[value(alias = "false")]
    Off,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Answers")]
pub struct AnswerArgs {
    /// What a refused request costs its other descriptors.
    #[arg(long, env = "TURNSTILE_CHARGING", value_enum, default_value = "atomic")]
    pub charging: ChargingArg,
    /// Rate-limit headers in answers.
    #[arg(
        long,
        env = "TURNSTILE_RESPONSE_HEADERS",
        value_enum,
        default_value = "off"
    )]
    pub response_headers: HeadersArg,
    /// The reference's switch for its headers: same as --response-headers legacy.
    #[arg(long, env = "LIMIT_RESPONSE_HEADERS_ENABLED")]
    pub limit_response_headers_enabled: bool,
    #[arg(long, env = "LIMIT_LIMIT_HEADER", default_value = "RateLimit-Limit")]
    pub limit_limit_header: String,
    #[arg(
        long,
        env = "LIMIT_REMAINING_HEADER",
        default_value = "RateLimit-Remaining"
    )]
    pub limit_remaining_header: String,
    #[arg(long, env = "LIMIT_RESET_HEADER", default_value = "RateLimit-Reset")]
    pub limit_reset_header: String,
    /// Which answers carry dynamic_metadata naming the deciding rule, its algorithm and the
    /// outcome.
    #[arg(
        long,
        env = "TURNSTILE_RESPONSE_METADATA",
        value_enum,
        default_value = "refusals"
    )]
    pub response_metadata: MetadataArg,
    /// The reference's dynamic metadata instead: the request echoed and the `metadata` of the
    /// rules that passed (plus the deciding rule's name, algorithm and outcome).
    #[arg(long, env = "RESPONSE_DYNAMIC_METADATA")]
    pub response_dynamic_metadata: bool,
    /// Every limit is soft (the reference's QUOTA_MODE): a request is refused only when all
    /// of its limits are over.
    #[arg(long, env = "QUOTA_MODE")]
    pub quota_mode: bool,
    /// Answer OK even when over a limit (statuses still say OVER_LIMIT).
    #[arg(long, env = "SHADOW_MODE")]
    pub shadow_mode: bool,
}

impl From<ChargingArg> for Charging {
    fn from(charging: ChargingArg) -> Charging {
        match charging {
            ChargingArg::Atomic => Charging::Atomic,
            ChargingArg::PerDescriptor => Charging::PerDescriptor,
        }
    }
}

impl From<MetadataArg> for MetadataOn {
    fn from(metadata: MetadataArg) -> MetadataOn {
        match metadata {
            MetadataArg::Refusals => MetadataOn::Refusals,
            MetadataArg::All => MetadataOn::All,
            MetadataArg::Off => MetadataOn::Off,
        }
    }
}

impl AnswerArgs {
    /// The headers: --response-headers, or the reference's switch for its own.
    pub fn headers(&self) -> Headers {
        match (self.response_headers, self.limit_response_headers_enabled) {
            (HeadersArg::Ietf, _) => Headers::Ietf,
            (HeadersArg::Legacy, _) | (HeadersArg::Off, true) => Headers::Legacy {
                limit: self.limit_limit_header.clone(),
                remaining: self.limit_remaining_header.clone(),
                reset: self.limit_reset_header.clone(),
            },
            (HeadersArg::Off, false) => Headers::Off,
        }
    }

    pub fn response(&self) -> ResponseSettings {
        ResponseSettings {
            headers: self.headers(),
            metadata: self.response_metadata.into(),
            reference_metadata: self.response_dynamic_metadata,
            global_shadow: self.shadow_mode,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_serve;
    use super::*;

    fn legacy(limit: &str) -> Headers {
        Headers::Legacy {
            limit: limit.into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
        }
    }

    /// Rows: the command line, and the headers answers carry.
    #[test]
    fn headers_from_either_switch() {
        for (args, headers) in [
            (&[][..], Headers::Off),
            (&["--response-headers", "ietf"][..], Headers::Ietf),
            (
                &["--response-headers", "legacy"][..],
                legacy("RateLimit-Limit"),
            ),
            (
                &["--limit-response-headers-enabled"][..],
                legacy("RateLimit-Limit"),
            ),
            (
                &[
                    "--limit-response-headers-enabled",
                    "--response-headers",
                    "ietf",
                ][..],
                Headers::Ietf,
            ),
            (
                &[
                    "--limit-response-headers-enabled",
                    "--limit-limit-header",
                    "X-Limit",
                ][..],
                legacy("X-Limit"),
            ),
        ] {
            assert_eq!(
                parse_serve(args).unwrap().answers.headers(),
                headers,
                "{args:?}"
            );
        }
    }

    /// Rows: the command line, and which answers carry metadata (`true`/`false`, the old
    /// boolean, still parse).
    #[test]
    fn metadata_takes_the_old_boolean_too() {
        for (args, metadata) in [
            (&[][..], MetadataOn::Refusals),
            (&["--response-metadata", "all"][..], MetadataOn::All),
            (&["--response-metadata", "true"][..], MetadataOn::All),
            (&["--response-metadata", "false"][..], MetadataOn::Off),
            (&["--response-metadata", "off"][..], MetadataOn::Off),
        ] {
            let response = parse_serve(args).unwrap().answers.response();
            assert_eq!(response.metadata, metadata, "{args:?}");
        }
        let response = parse_serve(&["--shadow-mode", "--response-dynamic-metadata"])
            .unwrap()
            .answers
            .response();
        assert!(response.global_shadow && response.reference_metadata);
    }
}
