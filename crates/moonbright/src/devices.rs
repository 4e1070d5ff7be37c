//! Process-wide allocators, one per CUDA device, each created at its first use and made a peer
//! of the others: what a shared library that serves a whole process needs (the Python
//! extension's C entry points for PyTorch, the LD_PRELOAD interposer). Each owner keeps its own
//! table (`static DEVICES: Devices = Devices::new()`) and decides the options.

use std::sync::{Mutex, OnceLock};

use crate::Allocator;

/// Devices served: CUDA ordinals below this.
pub const MAX_DEVICES: usize = 64;

/// One lazily created allocator per device.
pub struct Devices {
    slots: [OnceLock<Allocator>; MAX_DEVICES],
    /// Held while an allocator is created, so that two threads never create one device's twice
    /// (the loser's would map nothing, but it would retain a context and start a worker).
    creating: Mutex<()>,
}

impl Default for Devices {
    fn default() -> Self {
        Self::new()
    }
}

impl Devices {
    pub const fn new() -> Self {
        Devices { slots: [const { OnceLock::new() }; MAX_DEVICES], creating: Mutex::new(()) }
    }

    /// `device` as an index into the table, or why it is not one.
    pub fn index(device: i32) -> std::result::Result<usize, String> {
        if device < 0 || device as usize >= MAX_DEVICES {
            return Err(format!("device {device} is not in 0..{MAX_DEVICES}"));
        }
        Ok(device as usize)
    }

    /// The allocator of `device` if it exists.
    pub fn get(&self, device: i32) -> Option<&Allocator> {
        Self::index(device).ok().and_then(|i| self.slots[i].get())
    }

    /// The allocator of `device`, created by `create` if it does not exist yet (its error is
    /// returned as it is, and a later call tries again), then made a peer
    /// of every other allocator here (unless its options say `peer_access: false`). A pair
    /// that cannot reach each other peer to peer is left alone and its message given to
    /// `peer_error`: the CUDA runtime copies between such GPUs through the host.
    pub fn get_or_create(
        &self,
        device: i32,
        create: impl FnOnce() -> std::result::Result<Allocator, String>,
        mut peer_error: impl FnMut(String),
    ) -> std::result::Result<&Allocator, String> {
        let i = Self::index(device)?;
        if let Some(a) = self.slots[i].get() {
            return Ok(a);
        }
        let _creating = self.creating.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = self.slots[i].get() {
            return Ok(a);
        }
        let a = create()?;
        let a = self.slots[i].get_or_init(|| a);
        self.peer_with_the_others(i, a, &mut peer_error);
        Ok(a)
    }

    /// Makes a new allocator's GPU and every other GPU here peers both ways, so that copies
    /// between them and kernels reading a peer's memory work as with `cudaMalloc`'s memory. A
    /// process on one GPU has no peers and pays nothing; with several, each later mapping sets
    /// access for each of them.
    fn peer_with_the_others(&self, i: usize, a: &Allocator, peer_error: &mut dyn FnMut(String)) {
        if a.device().is_none() || !a.options().peer_access {
            return;
        }
        for (j, other) in self.created().filter(|&(j, o)| j != i && o.device().is_some()) {
            for (x, peer) in [(a, j as i32), (other, i as i32)] {
                if let Err(e) = x.enable_peer_access(peer) {
                    peer_error(format!("device {peer} cannot access device {:?}: {e}", x.device()));
                }
            }
        }
    }

    /// The allocators that exist, with their device indices, lowest first.
    pub fn created(&self) -> impl Iterator<Item = (usize, &Allocator)> {
        self.slots.iter().enumerate().filter_map(|(i, a)| a.get().map(|a| (i, a)))
    }

    /// The allocator that holds the live allocation at `ptr`, with its device index.
    pub fn owner(&self, ptr: u64) -> Option<(usize, &Allocator)> {
        self.created().find(|(_, a)| a.usable_size(ptr).is_some())
    }
}

#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;
    use crate::Options;

    fn host() -> Result<Allocator, String> {
        Allocator::new(Options::host(64 << 20, 2 << 20)).map_err(|e| e.to_string())
    }

    #[test]
    fn creates_once_finds_owners_and_rejects_bad_devices() {
        let d = Devices::new();
        assert!(d.get(0).is_none());
        let mut made = 0;
        for _ in 0..2 {
            d.get_or_create(
                3,
                || {
                    made += 1;
                    host()
                },
                |m| panic!("peer error: {m}"),
            )
            .unwrap();
        }
        assert_eq!(made, 1, "the second call must find the first's allocator");
        let a = d.get(3).unwrap();
        let p = a.malloc(1000).unwrap();
        assert_eq!(d.owner(p).map(|(i, _)| i), Some(3));
        assert!(d.owner(p + 1).is_none(), "only an allocation's start is owned");
        a.free(p).unwrap();
        assert!(d.owner(p).is_none(), "a freed allocation has no owner");
        assert_eq!(d.created().map(|(i, _)| i).collect::<Vec<_>>(), vec![3]);
        for bad in [-1, MAX_DEVICES as i32] {
            let e = d.get_or_create(bad, host, |_| {}).err().unwrap();
            assert!(e.contains("is not in"), "{e}");
        }
    }

    #[test]
    fn a_failed_creation_is_reported_and_tried_again() {
        let d = Devices::new();
        let bad = || Allocator::new(Options::host(1 << 20, 3)).map_err(|e| e.to_string());
        let e = d.get_or_create(0, bad, |_| {}).err().unwrap();
        assert!(e.contains("host_page_size"), "{e}");
        assert!(d.get(0).is_none());
        assert!(d.get_or_create(0, host, |_| {}).is_ok(), "a later call may succeed");
    }
}
