//! A port's open connections by peer, and which one to close when a newcomer finds the port
//! full.
//!
//! Refusing newcomers at the cap let a few addresses holding idle connections keep every
//! other client out. So, on the gRPC port, a newcomer whose peer holds fewer connections
//! than the biggest holder takes the place of one of that holder's: the oldest still in its
//! handshake, else the oldest with no call in flight (as a web server drops idle keep-alive
//! connections first). A connection in its handshake has served nothing yet; an idle one
//! costs its client only a reconnect; one serving calls would cut them, so it is never
//! chosen. Oldest first, since a fresh connection has not had time to carry its first call.
//! When the biggest holder has nothing to spare the next biggest is tried, down to the
//! newcomer's own size; only then is the newcomer refused.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use futures_util::task::AtomicWaker;

use crate::edge::peers::{Caller, Calls, peer};

/// Connections closed to make room that have not closed yet, at most: each still holds its
/// file until its serving thread sees it closed, so they are bounded (within the files
/// `connections` keeps spare).
const MAX_CLOSING: usize = 16;

/// A port's open connections: at most `cap`, at most `per_peer` of them from one peer.
pub struct Room {
    cap: usize,
    per_peer: usize,
    /// Whether a newcomer at the cap may take an idle connection's place.
    make_room: bool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Connections counted against the cap (not those closing).
    open: usize,
    closing: usize,
    /// The next connection's number: numbers follow arrival, so the smallest is the oldest.
    next: u64,
    peers: HashMap<IpAddr, Holder>,
    /// Peers by how many connections they hold, to find the biggest.
    by_size: BTreeSet<(usize, IpAddr)>,
}

/// One peer's connections.
#[derive(Default)]
struct Holder {
    /// Its calls in flight, over all its connections.
    calls: Arc<Calls>,
    /// Those still in their handshake, and those being served, by number (oldest first).
    handshaking: BTreeMap<u64, Arc<Tenant>>,
    served: BTreeMap<u64, Arc<Tenant>>,
}

impl Holder {
    fn len(&self) -> usize {
        self.handshaking.len() + self.served.len()
    }

    /// The connection to close for a newcomer, if any may be: the oldest in its handshake,
    /// else the oldest with no call in flight. Busy ones are skipped: a peer has at most its
    /// share of calls in flight, so the scan is bounded too.
    fn spare(&self) -> Option<(u64, bool)> {
        if let Some(number) = self.handshaking.keys().next() {
            return Some((*number, false));
        }
        self.served
            .iter()
            .find(|(_, tenant)| tenant.calls.in_flight() == 0)
            .map(|(number, _)| (*number, true))
    }
}

/// One connection, as the room and the connection's own task both see it.
#[derive(Default)]
struct Tenant {
    /// Its calls in flight.
    calls: Arc<Calls>,
    /// Set (under the room's lock) once it was chosen to make room.
    closed: AtomicBool,
    waker: AtomicWaker,
}

/// Why a newcomer was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Its peer holds its share already.
    PeerShare,
    /// The port is full and no connection could be closed for it.
    Full,
}

/// A newcomer let in by closing another connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MadeRoom {
    /// The peer whose connection was closed, and how many it holds now.
    pub closed: IpAddr,
    pub holds: usize,
}

impl Room {
    pub fn new(cap: usize, per_peer: usize, make_room: bool) -> Arc<Room> {
        Arc::new(Room {
            cap,
            per_peer,
            make_room,
            state: Mutex::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place for a new connection from `ip`, if its peer has not its share and the port
    /// has room, or room can be made.
    pub fn take(self: &Arc<Self>, ip: IpAddr) -> Result<(Place, Option<MadeRoom>), Refused> {
        let peer = peer(ip);
        let mut state = self.lock();
        let size = state.peers.get(&peer).map_or(0, Holder::len);
        if size >= self.per_peer {
            return Err(Refused::PeerShare);
        }
        let made = if state.open < self.cap {
            None
        } else if self.make_room && state.closing < MAX_CLOSING {
            Some(state.close_one_bigger_than(size).ok_or(Refused::Full)?)
        } else {
            return Err(Refused::Full);
        };
        let number = state.next;
        state.next += 1;
        state.open += 1;
        let tenant = Arc::new(Tenant::default());
        state.resize(peer, |holder| {
            holder.handshaking.insert(number, tenant.clone());
        });
        let calls = state.peers[&peer].calls.clone();
        drop(state);
        let place = Place {
            room: self.clone(),
            peer,
            number,
            tenant,
            calls,
        };
        Ok((place, made))
    }
}

impl State {
    /// Change `peer`'s connections with `change`, keeping `by_size` in step; how many it
    /// holds then (a peer holding none has no entry).
    fn resize(&mut self, peer: IpAddr, change: impl FnOnce(&mut Holder)) -> usize {
        let holder = self.peers.entry(peer).or_default();
        let before = holder.len();
        change(holder);
        let after = holder.len();
        if after == 0 {
            self.peers.remove(&peer);
        }
        if before != after {
            self.by_size.remove(&(before, peer));
            if after > 0 {
                self.by_size.insert((after, peer));
            }
        }
        after
    }

    /// Close a spare connection of a peer holding more than `size`, the biggest first.
    fn close_one_bigger_than(&mut self, size: usize) -> Option<MadeRoom> {
        let (peer, number, served) = self
            .by_size
            .iter()
            .rev()
            .take_while(|(held, _)| *held > size)
            .find_map(|(_, peer)| {
                let (number, served) = self.peers[peer].spare()?;
                Some((*peer, number, served))
            })?;
        let mut closed = None;
        let holds = self.resize(peer, |holder| {
            let from = if served {
                &mut holder.served
            } else {
                &mut holder.handshaking
            };
            closed = from.remove(&number);
        });
        let tenant = closed?;
        tenant.closed.store(true, Ordering::Relaxed);
        tenant.waker.wake();
        self.open -= 1;
        self.closing += 1;
        Some(MadeRoom {
            closed: peer,
            holds,
        })
    }
}

/// A connection's place in its port's room, until it is dropped.
pub struct Place {
    room: Arc<Room>,
    peer: IpAddr,
    number: u64,
    tenant: Arc<Tenant>,
    /// Its peer's calls in flight.
    calls: Arc<Calls>,
}

impl Place {
    /// The connection finished its handshake: from now on it is closed for a newcomer only
    /// while it has no call in flight.
    pub fn served(&self) {
        let mut state = self.room.lock();
        if self.tenant.closed.load(Ordering::Relaxed) {
            return;
        }
        state.resize(self.peer, |holder| {
            if let Some(tenant) = holder.handshaking.remove(&self.number) {
                holder.served.insert(self.number, tenant);
            }
        });
    }

    /// What the connection's calls are told of who they come from.
    pub fn caller(&self, remote: SocketAddr) -> Caller {
        Caller::new(remote, self.calls.clone(), self.tenant.calls.clone())
    }

    /// Ready once the connection was closed to make room.
    pub fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.is_closed() {
            return Poll::Ready(());
        }
        self.tenant.waker.register(cx.waker());
        if self.is_closed() {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// Whether the connection was closed to make room.
    pub fn is_closed(&self) -> bool {
        self.tenant.closed.load(Ordering::Relaxed)
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut state = self.room.lock();
        if self.tenant.closed.load(Ordering::Relaxed) {
            state.closing -= 1;
            return;
        }
        state.open -= 1;
        state.resize(self.peer, |holder| {
            holder.handshaking.remove(&self.number);
            holder.served.remove(&self.number);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    /// Each row: the port's connections before (peer, served, calls in flight), oldest
    /// first, then who comes, and which of those connections closes (by index) or why the
    /// newcomer is refused.
    #[test]
    fn a_newcomer_takes_the_place_of_the_biggest_peers_oldest_spare_connection() {
        type Row = (
            &'static str,
            Vec<(u8, bool, usize)>,
            u8,
            Result<Option<usize>, Refused>,
        );
        let rows: Vec<Row> = vec![
            (
                "room left: nobody closes",
                vec![(2, true, 0), (2, true, 0)],
                1,
                Ok(None),
            ),
            (
                "the biggest peer's oldest in its handshake, before its older idle one",
                vec![(2, true, 0), (2, false, 0), (2, false, 0), (3, false, 0)],
                1,
                Ok(Some(1)),
            ),
            (
                "the biggest peer's oldest idle, not its busy ones nor a smaller peer's",
                vec![(3, false, 0), (2, true, 1), (2, true, 0), (2, true, 0)],
                1,
                Ok(Some(2)),
            ),
            (
                "the biggest peer all busy: the next biggest",
                vec![(2, true, 1), (2, true, 3), (2, true, 1), (3, true, 0)],
                1,
                Ok(Some(3)),
            ),
            (
                "every connection busy: refused",
                vec![(2, true, 1), (2, true, 1), (3, true, 1), (4, true, 1)],
                1,
                Err(Refused::Full),
            ),
            (
                "the newcomer's peer is as big as any: refused",
                vec![(2, true, 0), (2, true, 0), (3, true, 0), (3, true, 0)],
                3,
                Err(Refused::Full),
            ),
            (
                "only a peer of the newcomer's own size has spares: refused",
                vec![(2, true, 1), (2, true, 1), (3, true, 0), (1, true, 0)],
                1,
                Err(Refused::Full),
            ),
            (
                "the newcomer's peer has its share",
                vec![(1, true, 0), (1, true, 0), (1, true, 0)],
                1,
                Err(Refused::PeerShare),
            ),
        ];
        for (name, before, newcomer, expected) in rows {
            let room = Room::new(4, 3, true);
            let remote = |last| SocketAddr::new(ip(last), 1);
            let held: Vec<(Place, Caller)> = before
                .iter()
                .map(|&(peer, served, _)| {
                    let (place, made) = room.take(ip(peer)).expect("room for it");
                    assert_eq!(made, None, "{name}");
                    if served {
                        place.served();
                    }
                    let caller = place.caller(remote(peer));
                    (place, caller)
                })
                .collect();
            let places: Vec<Vec<_>> = held
                .iter()
                .zip(&before)
                .map(|((_, caller), &(_, _, calls))| {
                    (0..calls).map(|_| caller.call(10).unwrap()).collect()
                })
                .collect();
            let got = room.take(ip(newcomer)).map(|(_, made)| {
                made.map(|made| {
                    let closed: Vec<usize> =
                        (0..held.len()).filter(|&n| held[n].0.is_closed()).collect();
                    assert_eq!(closed.len(), 1, "{name}: {closed:?}");
                    let peer = before[closed[0]].0;
                    let holds = before.iter().filter(|c| c.0 == peer).count() - 1;
                    assert_eq!(
                        made,
                        MadeRoom {
                            closed: ip(peer),
                            holds
                        },
                        "{name}"
                    );
                    closed[0]
                })
            });
            assert_eq!(got, expected, "{name}");
            drop(places);
        }
    }

    /// A connection closed to make room keeps a place among those closing until it is
    /// dropped, and no more than `MAX_CLOSING` are; every place comes back once dropped.
    #[test]
    fn connections_closing_are_bounded_and_every_place_comes_back() {
        let room = Room::new(MAX_CLOSING + 1, MAX_CLOSING + 1, true);
        let flood: Vec<Place> = (0..=MAX_CLOSING)
            .map(|_| room.take(ip(2)).unwrap().0)
            .collect();
        let mut newcomers = Vec::new();
        for n in 0..MAX_CLOSING {
            let (place, made) = room.take(ip(10 + n as u8)).expect("room made");
            assert!(made.is_some());
            newcomers.push(place);
        }
        assert_eq!(room.take(ip(100)).err(), Some(Refused::Full));
        // One of the closed ones closes: there is room to close another.
        let closed = flood.iter().position(Place::is_closed).unwrap();
        let mut flood = flood;
        drop(flood.remove(closed));
        newcomers.push(room.take(ip(100)).expect("room made again").0);
        drop((flood, newcomers));
        let state = room.lock();
        assert_eq!((state.open, state.closing), (0, 0));
        assert!(state.peers.is_empty() && state.by_size.is_empty());
    }

    /// A connection's task sees it closed: woken, then ready.
    #[test]
    fn a_closed_connection_is_woken() {
        let room = Room::new(1, 1, true);
        let (place, _) = room.take(ip(2)).unwrap();
        let waker = Arc::new(Woken::default());
        let waker_ref = std::task::Waker::from(waker.clone());
        let mut cx = Context::from_waker(&waker_ref);
        assert!(place.poll_closed(&mut cx).is_pending());
        let (_newcomer, made) = room.take(ip(1)).unwrap();
        assert!(made.is_some());
        assert!(waker.0.load(Ordering::Relaxed));
        assert!(place.poll_closed(&mut cx).is_ready());
    }

    #[derive(Default)]
    struct Woken(AtomicBool);

    impl std::task::Wake for Woken {
        fn wake(self: Arc<Self>) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}
