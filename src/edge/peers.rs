//! Peers, and shares per peer: how many RLQS streams one client holds (connections are counted
//! in `room`), and how many calls its connections have in flight together, so that
//! no one client can take all of what a process bounds.
//!
//! A peer is an address as a network sees clients: an IPv4 address on its own (an IPv4 peer
//! on an IPv6 socket counts as its IPv4 address), an IPv6 address with the rest of its /64,
//! since one host usually owns a whole /64 and could otherwise draw a new address for every
//! connection.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// The peer `ip` belongs to: itself for IPv4, its /64 for IPv6.
pub fn peer(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from_bits(v6.to_bits() & !u128::from(u64::MAX))),
        v4 => v4,
    }
}

/// How many of something each peer holds. Only peers that hold something have an entry, so
/// the map is bounded by what is held.
#[derive(Default, Clone)]
pub struct Peers(Arc<Mutex<HashMap<IpAddr, usize>>>);

impl Peers {
    /// One more for `ip`'s peer, unless it holds `max` already.
    pub fn take(&self, ip: IpAddr, max: usize) -> Option<FromPeer> {
        let peer = peer(ip);
        let mut held = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(peer).or_insert(0);
        if *count >= max {
            if *count == 0 {
                held.remove(&peer);
            }
            return None;
        }
        *count += 1;
        Some(FromPeer {
            peers: self.clone(),
            peer,
        })
    }
}

/// Counts against its peer's share until it is dropped.
pub struct FromPeer {
    peers: Peers,
    peer: IpAddr,
}

impl Drop for FromPeer {
    fn drop(&mut self) {
        let mut held = self.peers.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.peer) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.peer);
            }
        }
    }
}

/// Who a call comes from, as the connection it came on knows: the peer's address, the calls
/// in flight of all that peer's connections, and those of this connection (which tell
/// `room` whether closing it would cut calls). The edge of the connection's stack holds
/// it, and gives it to other methods' calls in their extensions.
#[derive(Clone)]
pub struct Caller {
    pub remote: SocketAddr,
    calls: Arc<Calls>,
    on_connection: Arc<Calls>,
}

impl Caller {
    /// The caller at `remote`, whose peer's calls are `calls` and its connection's
    /// `on_connection`.
    pub fn new(remote: SocketAddr, calls: Arc<Calls>, on_connection: Arc<Calls>) -> Caller {
        Caller {
            remote,
            calls,
            on_connection,
        }
    }

    /// A place for one more call of this peer, unless it has `max` in flight already.
    pub fn call(&self, max: usize) -> Option<CallPlace<'_>> {
        if self.calls.0.fetch_add(1, Ordering::Relaxed) >= max {
            self.calls.0.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        self.on_connection.0.fetch_add(1, Ordering::Relaxed);
        Some(CallPlace(self))
    }

    /// A stream that counts as a call in flight on this connection for as long as it is
    /// open (its peer's share of streams bounds how many a peer holds).
    pub fn stream(&self) -> StreamOpen {
        self.on_connection.0.fetch_add(1, Ordering::Relaxed);
        StreamOpen(Arc::clone(&self.on_connection))
    }
}

/// Calls in flight: a peer's, over all its connections, or one connection's.
#[derive(Default)]
pub struct Calls(AtomicUsize);

impl Calls {
    pub fn in_flight(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// A call's place among its peer's calls in flight and its connection's, until it is
/// dropped.
pub struct CallPlace<'a>(&'a Caller);

impl Drop for CallPlace<'_> {
    fn drop(&mut self) {
        self.0.calls.0.fetch_sub(1, Ordering::Relaxed);
        self.0.on_connection.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An open stream, counted among its connection's calls in flight until it is dropped.
pub struct StreamOpen(Arc<Calls>);

impl Drop for StreamOpen {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's holdings count against its share until dropped; a peer with none has no
    /// entry. Rows: two addresses, and whether they are one peer.
    #[test]
    fn a_peer_takes_at_most_its_share_and_gives_it_back() {
        let rows: [(&str, &str, bool); 5] = [
            ("10.0.0.1", "::ffff:10.0.0.1", true),
            ("10.0.0.1", "10.0.0.2", false),
            ("2001:db8:1:2::1", "2001:db8:1:2:ffff:ffff:ffff:ffff", true),
            ("2001:db8:1:2::1", "2001:db8:1:3::1", false),
            ("::ffff:10.0.0.1", "::1", false),
        ];
        for (a, b, same) in rows {
            let (a, b): (IpAddr, IpAddr) = (a.parse().unwrap(), b.parse().unwrap());
            let peers = Peers::default();
            let first = peers.take(a, 2).expect("within the share");
            let second = peers.take(b, 2).expect("within the share");
            assert_eq!(peers.take(a, 2).is_none(), same, "{a} and {b}");
            drop(first);
            let third = peers
                .take(a, 2)
                .expect("a dropped one gives its place back");
            assert!(peers.take(a, 0).is_none());
            drop((second, third));
            assert!(peers.0.lock().unwrap().is_empty());
        }
    }

    /// A peer's calls in flight are counted over all its connections (two here, sharing a
    /// share of 3), and each connection's on its own; another peer has its own count, and a
    /// call's place goes back when it ends.
    #[test]
    fn a_peer_has_at_most_its_share_of_calls_in_flight_over_all_its_connections() {
        let remote = SocketAddr::from(([10, 0, 0, 1], 1));
        let (a, b) = (Arc::new(Calls::default()), Arc::new(Calls::default()));
        let connections: [Arc<Calls>; 3] = Default::default();
        let [first, second, other] = [(&a, 0), (&a, 1), (&b, 2)]
            .map(|(peer, n)| Caller::new(remote, peer.clone(), connections[n].clone()));
        let on = || connections.each_ref().map(|c| c.in_flight());
        let one = first.call(3).expect("within the share");
        let two = second.call(3).expect("within the share");
        let three = first.call(3).expect("within the share");
        assert!(second.call(3).is_none(), "both connections count");
        assert_eq!(on(), [2, 1, 0]);
        assert!(other.call(3).is_some(), "another peer has its own share");
        drop(two);
        let four = second.call(3).expect("an ended call gives its place back");
        assert!(first.call(3).is_none());
        let stream = other.stream();
        assert_eq!(on(), [2, 1, 1]);
        drop((one, three, four, stream));
        assert_eq!((a.in_flight(), on()), (0, [0, 0, 0]));
    }
}
