//! Shares per peer address: how many connections (the listener) or RLQS streams one client
//! holds, so that no one client can take all of what a process bounds.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

/// What peers hold by address (an IPv4 peer on an IPv6 socket counts as its IPv4 address).
/// Only addresses that hold something have an entry, so the map is bounded by what is held.
#[derive(Default, Clone)]
pub struct Peers(Arc<Mutex<HashMap<IpAddr, usize>>>);

impl Peers {
    /// One more for `ip`, unless it holds `max` already.
    pub fn take(&self, ip: IpAddr, max: usize) -> Option<FromPeer> {
        let ip = ip.to_canonical();
        let mut open = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let count = open.entry(ip).or_default();
        if *count >= max {
            if *count == 0 {
                open.remove(&ip);
            }
            return None;
        }
        *count += 1;
        Some(FromPeer {
            peers: self.clone(),
            ip,
        })
    }
}

/// Counts against its peer's share until it is dropped.
pub struct FromPeer {
    peers: Peers,
    ip: IpAddr,
}

impl Drop for FromPeer {
    fn drop(&mut self) {
        let mut open = self.peers.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
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
}
