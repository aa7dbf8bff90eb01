//! Shares per peer address: how many connections (`connections`) or RLQS streams one client
//! holds, and how many calls its connections have in flight together, so that no one client
//! can take all of what a process bounds.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// What peers hold by address (an IPv4 peer on an IPv6 socket counts as its IPv4 address).
/// Only addresses that hold something have an entry, so the map is bounded by what is held.
#[derive(Default, Clone)]
pub struct Peers(Arc<Mutex<HashMap<IpAddr, Held>>>);

/// What one peer address holds.
struct Held {
    count: usize,
    /// Its calls in flight, over everything it holds.
    calls: Arc<Calls>,
}

impl Peers {
    /// One more for `ip`, unless it holds `max` already.
    pub fn take(&self, ip: IpAddr, max: usize) -> Option<FromPeer> {
        let ip = ip.to_canonical();
        let mut open = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let held = open.entry(ip).or_insert_with(|| Held {
            count: 0,
            calls: Arc::default(),
        });
        if held.count >= max {
            if held.count == 0 {
                open.remove(&ip);
            }
            return None;
        }
        held.count += 1;
        Some(FromPeer {
            peers: self.clone(),
            ip,
            calls: Arc::clone(&held.calls),
        })
    }
}

/// Counts against its peer's share until it is dropped.
pub struct FromPeer {
    peers: Peers,
    ip: IpAddr,
    calls: Arc<Calls>,
}

impl FromPeer {
    /// What a call on this connection is told of its peer: `remote`, and the calls in flight
    /// of all the peer's connections.
    pub fn caller(&self, remote: SocketAddr) -> Caller {
        Caller {
            remote,
            calls: Arc::clone(&self.calls),
        }
    }
}

impl Drop for FromPeer {
    fn drop(&mut self) {
        let mut open = self.peers.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(held) = open.get_mut(&self.ip) {
            held.count -= 1;
            if held.count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// Who a call comes from, as the connection it came on knows: the peer's address, and the
/// calls in flight of all that peer's connections. The edge of the connection's stack holds
/// it, and gives it to other methods' calls in their extensions.
#[derive(Clone)]
pub struct Caller {
    pub remote: SocketAddr,
    calls: Arc<Calls>,
}

impl Caller {
    /// A place for one more call of this peer, unless it has `max` in flight already.
    pub fn call(&self, max: usize) -> Option<CallPlace<'_>> {
        if self.calls.0.fetch_add(1, Ordering::Relaxed) >= max {
            self.calls.0.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(CallPlace(&self.calls))
    }
}

/// One peer's calls in flight.
#[derive(Default)]
struct Calls(AtomicUsize);

/// A call's place among its peer's calls in flight, until it is dropped.
pub struct CallPlace<'a>(&'a Calls);

impl Drop for CallPlace<'_> {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's connections count against its share until they close; an IPv4 peer seen as
    /// an IPv4-mapped IPv6 address is the same peer, and a peer with none open has no entry.
    #[test]
    fn a_peer_takes_at_most_its_share_and_gives_it_back() {
        let peers = Peers::default();
        let v4 = IpAddr::from([10, 0, 0, 1]);
        let mapped = IpAddr::from([0, 0, 0, 0, 0, 0xffff, 0x0a00, 0x0001]);
        let other = IpAddr::from([10, 0, 0, 2]);
        let first = peers.take(v4, 2).expect("within the share");
        let second = peers.take(mapped, 2).expect("within the share");
        assert!(
            peers.take(v4, 2).is_none(),
            "the mapped address is the same peer"
        );
        let third = peers
            .take(other, 2)
            .expect("another peer has its own share");
        drop(first);
        let fourth = peers
            .take(v4, 2)
            .expect("a closed connection gives its place back");
        assert!(peers.take(v4, 0).is_none());
        drop((second, third, fourth));
        assert!(peers.0.lock().unwrap().is_empty());
    }

    /// A peer's calls in flight are counted over all its connections (two here, sharing a
    /// share of 3), another peer has its own count, and a call's place goes back when it ends.
    #[test]
    fn a_peer_has_at_most_its_share_of_calls_in_flight_over_all_its_connections() {
        let peers = Peers::default();
        let remote = |ip: [u8; 4]| SocketAddr::from((ip, 1));
        let (a, b) = ([10, 0, 0, 1], [10, 0, 0, 2]);
        let connections = [a, a, b].map(|ip| peers.take(ip.into(), 2).unwrap());
        let [first, second, other] =
            [(0, a), (1, a), (2, b)].map(|(n, ip)| connections[n].caller(remote(ip)));
        let one = first.call(3).expect("within the share");
        let two = second.call(3).expect("within the share");
        let three = first.call(3).expect("within the share");
        assert!(second.call(3).is_none(), "both connections count");
        assert!(other.call(3).is_some(), "another peer has its own share");
        drop(two);
        let four = second.call(3).expect("an ended call gives its place back");
        assert!(first.call(3).is_none());
        drop((one, three, four));
        assert_eq!(first.calls.0.load(Ordering::Relaxed), 0);
    }
}
