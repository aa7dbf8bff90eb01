//! The admin HTTP ports: the main one, and the reference's debug port (/rlconfig).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use clap::Args;

use super::duration;

#[derive(Debug, Args)]
#[command(next_help_heading = "Admin HTTP ports")]
pub struct HttpArgs {
    /// Admin HTTP listen host.
    #[arg(long, env = "HOST", default_value = "0.0.0.0")]
    pub http_host: IpAddr,
    /// Admin HTTP listen port.
    #[arg(long, env = "PORT", default_value_t = 8080)]
    pub http_port: u16,
    /// Admin HTTP listen address; overrides --http-host and --http-port.
    #[arg(long, env = "TURNSTILE_HTTP_ADDR")]
    pub http_addr: Option<SocketAddr>,
    /// Most open connections on each admin HTTP port (main, debug, Prometheus); past it new
    /// ones are closed at accept.
    #[arg(long, env = "TURNSTILE_HTTP_MAX_CONNECTIONS", default_value_t = 64)]
    pub http_max_connections: usize,
    /// Bound on reading a request's headers (and on an idle keep-alive connection), on
    /// reading its body and answering it, and on a write making no progress.
    #[arg(long, env = "TURNSTILE_HTTP_READ_TIMEOUT", value_parser = duration, default_value = "10s")]
    pub http_read_timeout: Duration,

    /// Debug listen host (serves /rlconfig, as the reference's debug port).
    #[arg(long, env = "DEBUG_HOST", default_value = "0.0.0.0")]
    pub debug_host: IpAddr,
    /// Debug listen port; 0 picks a free one.
    #[arg(long, env = "DEBUG_PORT", default_value_t = 6070)]
    pub debug_port: u16,
    /// Debug listen address; overrides --debug-host and --debug-port.
    #[arg(long, env = "TURNSTILE_DEBUG_ADDR")]
    pub debug_addr: Option<SocketAddr>,
    /// Do not open the debug port.
    #[arg(long, env = "TURNSTILE_NO_DEBUG_PORT")]
    pub no_debug_port: bool,
}

impl HttpArgs {
    pub fn addr(&self) -> SocketAddr {
        self.http_addr
            .unwrap_or(SocketAddr::new(self.http_host, self.http_port))
    }

    /// The debug port's address, unless it is turned off.
    pub fn debug_addr(&self) -> Option<SocketAddr> {
        (!self.no_debug_port).then(|| {
            self.debug_addr
                .unwrap_or(SocketAddr::new(self.debug_host, self.debug_port))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_serve;

    /// Rows: the command line, the main port's address, the debug port's.
    #[test]
    fn addresses_from_host_and_port_or_the_whole_address() {
        for (args, main, debug) in [
            (&[][..], "0.0.0.0:8080", Some("0.0.0.0:6070")),
            (
                &[
                    "--http-host",
                    "127.0.0.2",
                    "--http-port",
                    "1",
                    "--debug-port",
                    "2",
                ][..],
                "127.0.0.2:1",
                Some("0.0.0.0:2"),
            ),
            (
                &["--http-addr", "127.0.0.3:3", "--debug-addr", "127.0.0.4:4"][..],
                "127.0.0.3:3",
                Some("127.0.0.4:4"),
            ),
            (&["--no-debug-port"][..], "0.0.0.0:8080", None),
        ] {
            let http = parse_serve(args).unwrap().http;
            assert_eq!(http.addr().to_string(), main, "{args:?}");
            assert_eq!(
                http.debug_addr().map(|a| a.to_string()).as_deref(),
                debug,
                "{args:?}"
            );
        }
    }
}
