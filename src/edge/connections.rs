//! Accepting connections, for the gRPC and the admin ports alike.
//!
//! tonic and axum accept every connection and keep it for as long as the peer likes, and
//! tonic retries a failing accept at once: at the open-files limit the process spun on
//! EMFILE and no port answered, not even `/healthcheck`. Here each port has a cap on open
//! connections, and one on those from each peer, so that one client cannot take them all
//! (the excess is closed at accept and counted); the caps of all ports together fit the
//! open-files limit, and a failing accept backs off. At its cap the gRPC port makes room
//! for a newcomer from a smaller peer by closing a spare connection of the biggest (`room`),
//! so that clients holding idle connections cannot keep the others out. A gRPC connection must finish
//! TLS and send the HTTP/2 preface within a timeout before it is served; once served, HTTP/2
//! keepalive pings find dead peers (`app::run`); on the admin ports hyper's header-read
//! timeout closes silent ones (`admin`), and a write that makes no progress for as long (a
//! peer that stopped reading) closes the connection.
//!
//! The gRPC port's connections are spread over serving threads (`spread`), each with a
//! runtime of its own that registers the socket and serves it to the end. Each call is told
//! who it comes from (`Caller`: the peer's address, and the calls that peer has in flight
//! over all its connections, which `grpc` bounds).
//!
//! A gRPC connection's writes are coalesced: the first write of a burst yields once, so the
//! answers finished in the same scheduler tick leave in one write instead of one each
//! (unless such yields keep gathering nothing, as for a client with one call at a time).

use std::future::Future;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use metrics::Gauge;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::{Instant, Sleep};
use tokio_rustls::TlsAcceptor;

use crate::edge::peers::Caller;
use crate::edge::room::{Place, Refused, Room};
use crate::ops::metrics::ConnectionMetrics;

/// What every HTTP/2 client sends first (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// Connections past their handshake that wait for the server to take them.
const READY_QUEUE: usize = 64;
/// Most bursts a connection writes at once after yields that gathered nothing (see
/// `Coalesce`).
const MAX_SKIPPED_YIELDS: u8 = 32;
/// Open files kept for all but client connections: listeners, Redis, statsd, rule files,
/// the runtime's own (about 16 with the memory backend).
const RESERVED_FILES: usize = 32;
/// A peer's connections are at most this fraction of a port's cap (whatever the flags say):
/// one peer alone never fills the port, so room for the others is left without closing
/// anything, while one big client (all of a host's Envoy workers) may still hold many.
const PEER_SHARE_DIVISOR: usize = 2;
/// Connections the kernel may hold for the accept loop (lowered to `net.core.somaxconn`):
/// past it a client's SYN is dropped and its connect waits a second for the retry, so a
/// burst of connections (a flood, or a fleet reconnecting) would delay everyone's.
const ACCEPT_BACKLOG: u32 = 4096;
/// Shortest time between two log lines about connections closed to make room.
const ROOM_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// How a port's connections begin before they are served.
pub enum Handshake {
    /// Served at once (the admin ports: hyper bounds how long headers may take).
    Http1,
    /// TLS when configured, then the HTTP/2 preface, all within `timeout`.
    Http2 {
        tls: Option<TlsAcceptor>,
        timeout: Duration,
    },
}

/// One listening port's limits.
pub struct Port {
    pub max_connections: usize,
    /// Most of them from one peer, so that one client cannot take every slot.
    pub max_per_peer: usize,
    /// At the cap, close a spare connection of the biggest peer for a newcomer from a
    /// smaller one (`room`), instead of refusing the newcomer.
    pub make_room: bool,
    pub handshake: Handshake,
    /// Close a connection whose writes make no progress for this long.
    pub write_stall: Option<Duration>,
    pub metrics: ConnectionMetrics,
}

/// A listener on `addr`, with room for a burst of connections waiting to be accepted.
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(ACCEPT_BACKLOG)
}

/// Accept on `listener` in the background, within `port`'s limits; the connections that
/// finished their handshake come out of the returned stream. Dropping it closes the listener.
pub fn incoming(listener: TcpListener, port: Port) -> Incoming {
    let (ready, rx) = mpsc::channel(READY_QUEUE);
    let port = Arc::new(port);
    tokio::spawn(accept(
        listener,
        port.clone(),
        Dispatch::Here { port, ready },
    ));
    Incoming { rx }
}

/// Accept on `listener` in the background, within `port`'s limits, and hand each connection
/// to the least loaded of `threads` serving threads: each returned [`Handoff`] goes to one
/// thread, whose own runtime then registers the socket, runs the handshake and serves it. A
/// connection's reads, writes and calls thus stay on one thread, with no wake-up of another
/// thread per call (with a work-stealing pool, that cost about a quarter of a call's CPU).
/// Dropping every handoff closes the listener.
pub fn spread(listener: TcpListener, port: Port, threads: usize) -> Vec<Handoff> {
    let port = Arc::new(port);
    let (targets, handoffs): (Vec<_>, Vec<_>) = (0..threads.max(1))
        .map(|_| {
            let (tx, rx) = mpsc::channel(READY_QUEUE);
            let open = Arc::new(AtomicUsize::new(0));
            let handoff = Handoff {
                rx,
                port: port.clone(),
            };
            (Target { tx, open }, handoff)
        })
        .unzip();
    tokio::spawn(accept(listener, port, Dispatch::Spread(targets)));
    handoffs
}

pub struct Incoming {
    rx: mpsc::Receiver<Conn>,
}

impl Incoming {
    pub async fn next(&mut self) -> Option<Conn> {
        self.rx.recv().await
    }
}

impl Stream for Incoming {
    type Item = io::Result<Conn>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx).map(|conn| conn.map(Ok))
    }
}

/// The connections accepted for one serving thread, not yet registered with any runtime.
pub struct Handoff {
    rx: mpsc::Receiver<Accepted>,
    port: Arc<Port>,
}

impl Handoff {
    /// The connections to serve here, past their handshake: to be called on the serving
    /// thread's runtime, which from then on drives their sockets.
    pub fn serve_here(self) -> Incoming {
        let (ready, rx) = mpsc::channel(READY_QUEUE);
        let Handoff {
            rx: mut accepted,
            port,
        } = self;
        tokio::spawn(async move {
            // Ends once the server drops its stream, so that the listener closes once every
            // serving thread stopped taking connections.
            while let Some(next) = tokio::select! {
                () = ready.closed() => None,
                next = accepted.recv() => next,
            } {
                match TcpStream::from_std(next.stream) {
                    Ok(stream) => {
                        let handshake = handshake(port.clone(), stream, next.peer, ready.clone());
                        tokio::spawn(handshake);
                    }
                    Err(error) => tracing::debug!(%error, "cannot register an accepted socket"),
                }
            }
        });
        Incoming { rx }
    }
}

/// A connection accepted for a serving thread.
struct Accepted {
    stream: std::net::TcpStream,
    peer: Peer,
}

/// What is known of an accepted connection before its handshake.
struct Peer {
    remote: SocketAddr,
    slot: Slot,
}

/// Where accepted connections go.
enum Dispatch {
    /// Handshake and serve on this runtime.
    Here {
        port: Arc<Port>,
        ready: mpsc::Sender<Conn>,
    },
    /// To serving threads, the least loaded first.
    Spread(Vec<Target>),
}

struct Target {
    tx: mpsc::Sender<Accepted>,
    /// Its open connections.
    open: Arc<AtomicUsize>,
}

impl Dispatch {
    /// Once nobody takes connections any more.
    async fn closed(&self) {
        match self {
            Dispatch::Here { ready, .. } => ready.closed().await,
            Dispatch::Spread(targets) => {
                futures_util::future::join_all(targets.iter().map(|t| t.tx.closed())).await;
            }
        }
    }

    async fn send(&self, stream: TcpStream, mut peer: Peer) {
        match self {
            Dispatch::Here { port, ready } => {
                tokio::spawn(handshake(port.clone(), stream, peer, ready.clone()));
            }
            Dispatch::Spread(targets) => {
                let Ok(stream) = stream.into_std() else {
                    return;
                };
                let live = targets.iter().filter(|t| !t.tx.is_closed());
                let Some(target) = live.min_by_key(|t| t.open.load(Ordering::Relaxed)) else {
                    return;
                };
                peer.slot.count_on(target.open.clone());
                let _ = target.tx.send(Accepted { stream, peer }).await;
            }
        }
    }
}

async fn accept(listener: TcpListener, port: Arc<Port>, dispatch: Dispatch) {
    let room = Room::new(port.max_connections, port.max_per_peer, port.make_room);
    let mut made_room = RoomLog::default();
    let mut backoff = FIRST_BACKOFF;
    loop {
        let accepted = tokio::select! {
            () = dispatch.closed() => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, remote) = match accepted {
            Ok(accepted) => accepted,
            // The peer left before it was accepted: nothing wrong here.
            Err(error) if is_peer_error(&error) => continue,
            // Out of files, buffers or memory: retrying at once would only spin.
            Err(error) => {
                tracing::warn!(%error, ?backoff, "cannot accept connections; retrying");
                tokio::select! {
                    () = dispatch.closed() => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        backoff = FIRST_BACKOFF;
        let place = match room.take(remote.ip()) {
            Ok((place, made)) => {
                if let Some(made) = made {
                    port.metrics.closed_to_make_room.increment(1);
                    made_room.closed(made, remote);
                }
                place
            }
            Err(refused) => {
                port.metrics.refused.increment(1);
                if refused == Refused::PeerShare {
                    tracing::debug!(%remote, "connection closed at accept: its peer has its share");
                }
                continue;
            }
        };
        let slot = Slot::new(place, port.metrics.open.clone());
        dispatch.send(stream, Peer { remote, slot }).await;
    }
}

/// Connections closed to make room, logged at most once per `ROOM_LOG_INTERVAL`: a flood
/// would otherwise log a line per connection.
#[derive(Default)]
struct RoomLog {
    last: Option<Instant>,
    /// Closed since the last line.
    unlogged: u64,
}

impl RoomLog {
    fn closed(&mut self, made: crate::edge::room::MadeRoom, newcomer: SocketAddr) {
        self.unlogged += 1;
        let now = Instant::now();
        if self.last.is_some_and(|last| now < last + ROOM_LOG_INTERVAL) {
            return;
        }
        self.last = Some(now);
        tracing::warn!(
            peer = %made.closed,
            holds = made.holds,
            %newcomer,
            closed = self.unlogged,
            "the port is full: closed connections of the peer holding the most to make room"
        );
        self.unlogged = 0;
    }
}

/// Run `port`'s handshake on `stream`, then hand the connection to the server (unless it
/// was closed to make room meanwhile).
async fn handshake(port: Arc<Port>, stream: TcpStream, peer: Peer, ready: mpsc::Sender<Conn>) {
    let Peer { remote, slot } = peer;
    let closed = std::future::poll_fn(|cx| slot.place.poll_closed(cx));
    let ran = tokio::select! {
        ran = port.handshake.run(stream) => ran,
        () = closed => return,
    };
    match ran {
        Ok((io, replay)) => {
            slot.place.served();
            let conn = Conn {
                io,
                replay,
                caller: slot.place.caller(remote),
                stall: port.write_stall.map(|limit| Stall { limit, timer: None }),
                coalesce: port.handshake.multiplexed().then(Coalesce::default),
                slot,
            };
            let _ = ready.send(conn).await;
        }
        Err(error) => {
            port.metrics.handshake_failed.increment(1);
            tracing::debug!(%remote, %error, "connection closed before it was served");
        }
    }
}

fn is_peer_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

impl Handshake {
    /// Whether the connection carries many calls at once (HTTP/2), whose answers can share
    /// a write.
    fn multiplexed(&self) -> bool {
        matches!(self, Handshake::Http2 { .. })
    }

    /// The connection ready to serve, and the bytes it already read that the server must see.
    async fn run(&self, stream: TcpStream) -> io::Result<(Box<dyn Io>, &'static [u8])> {
        let _ = stream.set_nodelay(true);
        let Handshake::Http2 { tls, timeout } = self else {
            return Ok((Box::new(stream), &[]));
        };
        let handshake = async {
            let mut io: Box<dyn Io> = match tls {
                Some(tls) => Box::new(tls.accept(stream).await?),
                None => Box::new(stream),
            };
            let mut preface = [0; PREFACE.len()];
            io.read_exact(&mut preface).await?;
            if preface != *PREFACE {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "not an HTTP/2 preface",
                ));
            }
            Ok((io, &PREFACE[..]))
        };
        tokio::time::timeout(*timeout, handshake)
            .await
            .unwrap_or_else(|_| {
                Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no HTTP/2 preface in time",
                ))
            })
    }
}

/// A plain or TLS stream.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Holds a connection's place in its port's room while the connection is open.
struct Slot {
    place: Place,
    open: Gauge,
    /// The open connections of the thread serving it.
    on_thread: Option<Arc<AtomicUsize>>,
}

impl Slot {
    fn new(place: Place, open: Gauge) -> Slot {
        open.increment(1.0);
        Slot {
            place,
            open,
            on_thread: None,
        }
    }

    fn count_on(&mut self, thread: Arc<AtomicUsize>) {
        thread.fetch_add(1, Ordering::Relaxed);
        self.on_thread = Some(thread);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.decrement(1.0);
        if let Some(thread) = &self.on_thread {
            thread.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// An accepted connection past its handshake.
pub struct Conn {
    io: Box<dyn Io>,
    /// Read during the handshake, not yet given to the server.
    replay: &'static [u8],
    /// Given to each of its calls.
    caller: Caller,
    stall: Option<Stall>,
    /// On multiplexed connections.
    coalesce: Option<Coalesce>,
    slot: Slot,
}

/// Writes of a multiplexed connection gathered into fewer syscalls. The HTTP/2 codec writes
/// as soon as one answer is ready; when the burst's first write yields once (the task woken
/// at once), the codec, polled again after the other ready tasks have run, has buffered the
/// answers they finished too, and one write sends them all. A yield costs a task switch,
/// often a wake-up of an idle worker: after one that gathered nothing, the next bursts are
/// written at once, 1, 2, 4 ... up to `MAX_SKIPPED_YIELDS` of them, until a yield pays again.
struct Coalesce {
    burst: Burst,
    /// Bursts still to write without yielding.
    skip: u8,
    /// How many to skip after the next yield that gathers nothing.
    penalty: u8,
}

impl Default for Coalesce {
    fn default() -> Coalesce {
        Coalesce {
            burst: Burst::Idle,
            skip: 0,
            penalty: 1,
        }
    }
}

#[derive(Clone, Copy)]
enum Burst {
    /// Nothing written since the last flush.
    Idle,
    /// The burst's first write yielded, with this many bytes to write.
    Yielded(usize),
    /// Writes go through until the next flush.
    Writing,
}

impl Coalesce {
    /// Before a write of `len` bytes: pending once at the start of a burst.
    fn before_write(&mut self, cx: &mut Context<'_>, len: usize) -> Poll<()> {
        match self.burst {
            Burst::Writing => {}
            Burst::Idle if self.skip > 0 => {
                self.skip -= 1;
                self.burst = Burst::Writing;
            }
            Burst::Idle => {
                self.burst = Burst::Yielded(len);
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Burst::Yielded(before) => {
                if len > before {
                    self.penalty = 1;
                } else {
                    self.skip = self.penalty;
                    self.penalty = (self.penalty * 2).min(MAX_SKIPPED_YIELDS);
                }
                self.burst = Burst::Writing;
            }
        }
        Poll::Ready(())
    }
}

/// How long writes may make no progress, and since when they have not.
struct Stall {
    limit: Duration,
    timer: Option<Pin<Box<Sleep>>>,
}

impl Conn {
    /// Who the connection's calls come from.
    pub fn caller(&self) -> Caller {
        self.caller.clone()
    }

    fn before_write(&mut self, cx: &mut Context<'_>, len: usize) -> Poll<()> {
        match &mut self.coalesce {
            Some(coalesce) => coalesce.before_write(cx, len),
            None => Poll::Ready(()),
        }
    }

    /// `poll`, a write's outcome, turned into an error once writes have been pending for
    /// longer than the stall limit.
    fn bound_stall<T>(
        &mut self,
        cx: &mut Context<'_>,
        poll: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        let Some(stall) = &mut self.stall else {
            return poll;
        };
        if poll.is_ready() {
            stall.timer = None;
            return poll;
        }
        let limit = stall.limit;
        let timer = stall
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer stopped reading",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.replay.is_empty() {
            // Checked on every read, so that a peer that keeps sending is closed too; the
            // waker only once a read waits.
            if self.slot.place.is_closed() {
                return Poll::Ready(Err(closed_to_make_room()));
            }
            let read = Pin::new(&mut *self.io).poll_read(cx, buf);
            if read.is_pending() && self.slot.place.poll_closed(cx).is_ready() {
                return Poll::Ready(Err(closed_to_make_room()));
            }
            return read;
        }
        let n = self.replay.len().min(buf.remaining());
        buf.put_slice(&self.replay[..n]);
        self.replay = &self.replay[n..];
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        std::task::ready!(self.before_write(cx, buf.len()));
        let poll = Pin::new(&mut *self.io).poll_write(cx, buf);
        self.bound_stall(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let len = bufs.iter().map(|b| b.len()).sum();
        std::task::ready!(self.before_write(cx, len));
        let poll = Pin::new(&mut *self.io).poll_write_vectored(cx, bufs);
        self.bound_stall(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let poll = Pin::new(&mut *self.io).poll_flush(cx);
        if let (Poll::Ready(_), Some(coalesce)) = (&poll, &mut self.coalesce) {
            coalesce.burst = Burst::Idle;
        }
        self.bound_stall(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.io).poll_shutdown(cx)
    }
}

fn closed_to_make_room() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "closed to make room for another peer's connection",
    )
}

/// The process's open-files limit, after raising its soft limit to the hard one (as Go
/// programs, the reference among them, do at start-up); None when unlimited.
pub fn open_files_limit() -> Option<usize> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed to them.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                ..limit
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    if limit.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    usize::try_from(limit.rlim_cur).ok()
}

/// The connection caps of the gRPC port and of each of `http_ports` admin ports: as
/// configured when they fit `open_files` with room for the rest of the process, else
/// lowered so that they do, three quarters of the room to gRPC. At the limit an accept fails
/// on every port, the admin ones included; below it every port keeps answering.
pub fn fit_caps(
    open_files: Option<usize>,
    grpc: usize,
    http: usize,
    http_ports: usize,
) -> (usize, usize) {
    let Some(open_files) = open_files else {
        return (grpc, http);
    };
    let room = open_files.saturating_sub(RESERVED_FILES).max(2);
    if grpc.saturating_add(http.saturating_mul(http_ports)) <= room {
        return (grpc, http);
    }
    let http = http.min(room / 4 / http_ports.max(1)).max(1);
    let grpc = grpc.min(room.saturating_sub(http * http_ports)).max(1);
    (grpc, http)
}

/// The most connections one peer may hold on a port whose cap is `cap`: `configured`, but
/// never more than the port's share for one peer (at least one).
pub fn peer_share(cap: usize, configured: usize) -> usize {
    configured.min(cap / PEER_SHARE_DIVISOR).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::task::{Wake, Waker};

    /// A socket that takes every write whole and counts the calls that reach it.
    #[derive(Default)]
    struct Socket {
        written: Arc<Mutex<Vec<u8>>>,
        writes: Arc<AtomicUsize>,
    }

    impl AsyncRead for Socket {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            _: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Poll::Pending
        }
    }

    impl AsyncWrite for Socket {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.writes.fetch_add(1, Ordering::Relaxed);
            self.written.lock().unwrap().extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_write_vectored(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<io::Result<usize>> {
            self.writes.fetch_add(1, Ordering::Relaxed);
            let mut written = self.written.lock().unwrap();
            bufs.iter().for_each(|b| written.extend_from_slice(b));
            Poll::Ready(Ok(bufs.iter().map(|b| b.len()).sum()))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[derive(Default)]
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// As the HTTP/2 codec writes: each poll first encodes every answer queued since, then
    /// writes its buffer and flushes.
    fn poll_codec(
        conn: &mut Conn,
        queued: &mut Vec<&[u8]>,
        buffer: &mut Vec<u8>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        queued.drain(..).for_each(|a| buffer.extend_from_slice(a));
        while !buffer.is_empty() {
            let n = std::task::ready!(
                Pin::new(&mut *conn).poll_write_vectored(cx, &[IoSlice::new(buffer)])
            )?;
            buffer.drain(..n);
        }
        Pin::new(&mut *conn).poll_flush(cx)
    }

    fn serving(handshake: &Handshake, socket: Socket) -> Conn {
        let remote = SocketAddr::from(([127, 0, 0, 1], 1));
        let (place, _) = Room::new(1, 1, false).take(remote.ip()).unwrap();
        Conn {
            io: Box::new(socket),
            replay: &[],
            caller: place.caller(remote),
            stall: None,
            coalesce: handshake.multiplexed().then(Coalesce::default),
            slot: Slot::new(place, Gauge::noop()),
        }
    }

    #[test]
    fn answers_finished_in_one_tick_leave_in_one_write() {
        let http2 = Handshake::Http2 {
            tls: None,
            timeout: Duration::from_secs(1),
        };
        let socket = Socket::default();
        let (written, writes) = (socket.written.clone(), socket.writes.clone());
        let mut conn = serving(&http2, socket);
        let wakes = Arc::new(Wakes::default());
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let (mut queued, mut buffer) = (Vec::new(), Vec::new());

        // The first answer wakes the codec; its write yields, the task woken to run again.
        queued.push(&b"one;"[..]);
        assert!(poll_codec(&mut conn, &mut queued, &mut buffer, &mut cx).is_pending());
        assert_eq!(
            (
                writes.load(Ordering::Relaxed),
                wakes.0.load(Ordering::Relaxed)
            ),
            (0, 1)
        );
        // Meanwhile the other tasks of the tick finish three more.
        queued.extend([&b"two;"[..], b"three;", b"four;"]);
        assert!(poll_codec(&mut conn, &mut queued, &mut buffer, &mut cx).is_ready());
        assert_eq!(writes.load(Ordering::Relaxed), 1, "four answers, one write");
        assert_eq!(&written.lock().unwrap()[..], b"one;two;three;four;");

        // The flush ended the burst: the next one yields again, once, and gathers nothing.
        queued.push(&b"five;"[..]);
        assert!(poll_codec(&mut conn, &mut queued, &mut buffer, &mut cx).is_pending());
        assert!(poll_codec(&mut conn, &mut queued, &mut buffer, &mut cx).is_ready());
        assert_eq!(writes.load(Ordering::Relaxed), 2);
        assert_eq!(wakes.0.load(Ordering::Relaxed), 2);

        // Answers that keep coming alone (one call at a time): after each yield that gathered
        // nothing, twice as many bursts are written at once, up to the cap; a yield that
        // gathers something yields on every burst again.
        let mut bursts_yielding = |conn: &mut Conn, bursts: usize, gather: bool| {
            let mut yielded = Vec::new();
            for _ in 0..bursts {
                queued.push(&b"alone;"[..]);
                let pending = poll_codec(conn, &mut queued, &mut buffer, &mut cx).is_pending();
                if pending {
                    if gather {
                        queued.push(&b"more;"[..]);
                    }
                    assert!(poll_codec(conn, &mut queued, &mut buffer, &mut cx).is_ready());
                }
                yielded.push(pending);
            }
            yielded
        };
        let (y, n) = (true, false);
        assert_eq!(
            bursts_yielding(&mut conn, 11, false),
            [n, y, n, n, y, n, n, n, n, y, n]
        );
        let skipped: Vec<bool> = bursts_yielding(&mut conn, 200, false);
        let gaps: Vec<usize> = skipped
            .split(|yielded| *yielded)
            .map(<[bool]>::len)
            .collect();
        assert_eq!(gaps, [7, 16, 32, 32, 32, 32, 32, 10]);
        let still_skipped = usize::from(MAX_SKIPPED_YIELDS) - 10;
        assert_eq!(
            bursts_yielding(&mut conn, still_skipped + 4, true),
            [vec![n; still_skipped], vec![y; 4]].concat()
        );

        // HTTP/1 answers one request at a time: nothing to wait for, written at once.
        let socket = Socket::default();
        let writes = socket.writes.clone();
        let mut conn = serving(&Handshake::Http1, socket);
        queued.push(&b"one;"[..]);
        assert!(poll_codec(&mut conn, &mut queued, &mut buffer, &mut cx).is_ready());
        assert_eq!(writes.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn caps_fit_the_open_files_limit() {
        // (open files, gRPC cap, HTTP cap, HTTP ports) -> (gRPC cap, HTTP cap)
        let rows = [
            ((None, 10_000, 64, 3), (10_000, 64)),
            ((Some(1 << 20), 10_000, 64, 3), (10_000, 64)),
            (
                (Some(10_000 + 3 * 64 + RESERVED_FILES), 10_000, 64, 3),
                (10_000, 64),
            ),
            ((Some(1024), 10_000, 64, 2), (864, 64)),
            ((Some(64), 10_000, 64, 2), (24, 4)),
            ((Some(64), 10, 64, 2), (10, 4)),
            ((Some(16), 10_000, 64, 3), (1, 1)),
        ];
        for ((files, grpc, http, ports), expected) in rows {
            let (g, h) = fit_caps(files, grpc, http, ports);
            assert_eq!((g, h), expected, "{files:?} {grpc} {http} {ports}");
            if let Some(files) = files.filter(|f| *f > RESERVED_FILES + 4) {
                assert!(
                    g + h * ports + RESERVED_FILES <= files,
                    "{files}: {g} + {h}x{ports}"
                );
            }
        }
    }

    #[test]
    fn a_peer_never_has_more_than_half_the_ports_connections() {
        // (port cap, configured per peer) -> per peer
        let rows = [
            ((10_000, 1_000), 1_000),
            ((168, 1_000), 84),
            ((3, 1_000), 1),
            ((1, 1_000), 1),
            ((168, 10), 10),
        ];
        for ((cap, configured), expected) in rows {
            assert_eq!(peer_share(cap, configured), expected, "{cap} {configured}");
        }
    }

    /// Serving threads each run their own runtime; here one runtime stands in for them,
    /// which is all the dispatch sees.
    #[tokio::test]
    async fn connections_go_to_the_least_loaded_serving_thread() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let port = Port {
            max_connections: 16,
            max_per_peer: 16,
            make_room: false,
            handshake: Handshake::Http2 {
                tls: None,
                timeout: Duration::from_secs(5),
            },
            write_stall: None,
            metrics: crate::ops::metrics::Metrics::new(0.8, 100).connections("grpc"),
        };
        let mut threads: Vec<Incoming> = spread(listener, port, 2)
            .into_iter()
            .map(Handoff::serve_here)
            .collect();
        let mut clients = Vec::new();
        // Connect, and see which thread serves the connection: (thread, connection).
        let mut connect = async || {
            let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
            tokio::io::AsyncWriteExt::write_all(&mut client, PREFACE)
                .await
                .unwrap();
            clients.push(client);
            let (a, b) = threads.split_at_mut(1);
            tokio::select! {
                Some(conn) = a[0].next() => (0, conn),
                Some(conn) = b[0].next() => (1, conn),
            }
        };
        let on = |served: &[(usize, Conn)], t| served.iter().filter(|(n, _)| *n == t).count();
        let mut served = Vec::new();
        for _ in 0..4 {
            served.push(connect().await);
        }
        assert_eq!((on(&served, 0), on(&served, 1)), (2, 2));
        // Two of thread 1's connections close: the next two go to it.
        let first_of_1 = served.iter().position(|(t, _)| *t == 1).unwrap();
        drop(served.remove(first_of_1));
        let next_of_1 = served.iter().position(|(t, _)| *t == 1).unwrap();
        drop(served.remove(next_of_1));
        for _ in 0..2 {
            let (thread, conn) = connect().await;
            assert_eq!(thread, 1, "went to the busier thread");
            served.push((thread, conn));
        }
        assert_eq!((on(&served, 0), on(&served, 1)), (2, 2));
    }
}
