//! The synchronisation primitives the crate uses, swapped for loom's under `cfg(loom)` so the
//! model checker sees every atomic and lock (the crossbeam/tokio habit).

#[cfg(loom)]
pub(crate) use loom::sync::{atomic, Mutex};

#[cfg(not(loom))]
pub(crate) use std::sync::{atomic, Mutex};
