//! Rules from an xDS control plane, with the reference's settings (names and defaults).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use super::{duration, read};
use crate::config::xds_client;

#[derive(Debug, Args)]
#[command(next_help_heading = "Rules from xDS")]
pub struct XdsArgs {
    /// The node id the control plane keys its snapshots by.
    #[arg(long, env = "CONFIG_GRPC_XDS_NODE_ID", default_value = "default")]
    pub xds_node_id: String,
    /// Node metadata, `key=value,key2=value2`.
    #[arg(long, env = "CONFIG_GRPC_XDS_NODE_METADATA", default_value = "")]
    pub xds_node_metadata: String,
    /// The control plane: `host:port` or a URL.
    #[arg(
        long,
        env = "CONFIG_GRPC_XDS_SERVER_URL",
        default_value = "localhost:18000"
    )]
    pub xds_server_url: String,
    /// Wait between failed connection attempts (±50%).
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", value_parser = duration, default_value = "3s")]
    pub xds_connect_retry_interval: Duration,
    /// Headers sent on the stream, `key:value,key2:value2`.
    #[arg(
        long,
        env = "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
        default_value = "",
        hide_env_values = true
    )]
    pub xds_headers: String,
    /// Connect to the control plane with TLS.
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_USE_TLS")]
    pub xds_tls: bool,
    /// PEM client certificate for mTLS to the control plane.
    #[arg(
        long,
        env = "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
        requires = "xds_tls_key"
    )]
    pub xds_tls_cert: Option<PathBuf>,
    #[arg(
        long,
        env = "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
        requires = "xds_tls_cert"
    )]
    pub xds_tls_key: Option<PathBuf>,
    /// PEM CA that signed the control plane's certificate (default: the public roots).
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_TLS_CACERT")]
    pub xds_tls_cacert: Option<PathBuf>,
    /// The name to verify in the control plane's certificate, when not the URL's host.
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_TLS_SAN")]
    pub xds_tls_san: Option<String>,
    /// Largest xDS response accepted (default: gRPC's 4 MiB).
    #[arg(long, env = "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES")]
    pub xds_max_message_bytes: Option<usize>,
    /// First wait before reconnecting after the stream broke; it doubles up to the maximum.
    #[arg(long, env = "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", value_parser = duration, default_value = "10s")]
    pub xds_backoff_initial: Duration,
    #[arg(long, env = "XDS_CLIENT_BACKOFF_MAX_INTERVAL", value_parser = duration, default_value = "60s")]
    pub xds_backoff_max: Duration,
    /// Each wait is randomized by up to this share, either way (with jitter on).
    #[arg(long, env = "XDS_CLIENT_BACKOFF_RANDOM_FACTOR", default_value_t = 0.5)]
    pub xds_backoff_random_factor: f64,
    #[arg(long, env = "XDS_CLIENT_BACKOFF_JITTER", default_value_t = true, action = clap::ArgAction::Set)]
    pub xds_backoff_jitter: bool,
}

impl XdsArgs {
    /// The xDS client's settings, checked (and its certificates read) before anything starts.
    pub fn settings(&self, merge_domains: bool) -> anyhow::Result<xds_client::Settings> {
        anyhow::ensure!(
            self.xds_backoff_random_factor >= 0.0,
            "XDS_CLIENT_BACKOFF_RANDOM_FACTOR must be a number from 0 (got {})",
            self.xds_backoff_random_factor
        );
        let tls = self.xds_tls.then(|| -> anyhow::Result<_> {
            let identity = match (&self.xds_tls_cert, &self.xds_tls_key) {
                (Some(cert), Some(key)) => Some((read(cert)?, read(key)?)),
                _ => None,
            };
            let ca = self.xds_tls_cacert.as_deref().map(read).transpose()?;
            Ok(xds_client::tls(ca, identity, self.xds_tls_san.as_deref()))
        });
        Ok(xds_client::Settings {
            server_url: self.xds_server_url.clone(),
            node: xds_client::node(&self.xds_node_id, &self.xds_node_metadata),
            headers: xds_client::headers(&self.xds_headers)
                .context("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS")?,
            tls: tls.transpose()?,
            connect_retry_interval: self.xds_connect_retry_interval,
            max_message_bytes: self.xds_max_message_bytes.filter(|&n| n > 0),
            backoff: xds_client::Backoff {
                initial: self.xds_backoff_initial,
                max: self.xds_backoff_max,
                random_factor: self.xds_backoff_random_factor,
                jitter: self.xds_backoff_jitter,
            },
            merge_domains,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_serve;

    /// Rows: the command line, then the error it gives (None: settings are made).
    #[test]
    fn settings_refuse_what_the_client_cannot_use() {
        for (args, error) in [
            (&[][..], None),
            (
                &["--xds-backoff-random-factor=-0.5"][..],
                Some("XDS_CLIENT_BACKOFF_RANDOM_FACTOR"),
            ),
            (
                &["--xds-tls", "--xds-tls-cacert", "/nonexistent/ca.pem"][..],
                Some("cannot read /nonexistent/ca.pem"),
            ),
        ] {
            let result = parse_serve(args).unwrap().rules.xds.settings(false);
            match (result, error) {
                (Ok(_), None) => {}
                (Err(e), Some(error)) => {
                    assert!(format!("{e:#}").contains(error), "{args:?}: {e:#}")
                }
                (result, _) => panic!("{args:?}: {:?}", result.map(|_| ())),
            }
        }
    }

    #[test]
    fn settings_carry_the_flags() {
        let line = [
            "--xds-server-url",
            "127.0.0.1:18001",
            "--xds-node-id",
            "n1",
            "--xds-max-message-bytes",
            "0",
            "--xds-backoff-initial",
            "2s",
        ];
        let settings = parse_serve(&line)
            .unwrap()
            .rules
            .xds
            .settings(true)
            .unwrap();
        assert_eq!(settings.server_url, "127.0.0.1:18001");
        assert_eq!(settings.node.id, "n1");
        assert_eq!(settings.max_message_bytes, None, "0 means gRPC's default");
        assert_eq!(settings.backoff.initial, std::time::Duration::from_secs(2));
        assert!(settings.tls.is_none());
        assert!(settings.merge_domains);
    }
}
