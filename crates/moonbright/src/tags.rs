//! Tags: names that allocations carry, so that a group of them (a model's weights, its KV cache)
//! can be put to sleep and woken together (`Allocator::sleep`, `Allocator::wake`).
//!
//! The tag of a new allocation is the calling thread's current tag, set by a scope
//! ([`scope`], or the call pair [`enter`] / [`restore`] for C and Python) and untagged outside
//! any. Names are interned process-wide, so one scope tags allocations on every device's
//! allocator alike.

use std::cell::Cell;
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::{Error, Result};

/// A tag's interned id: 0 is no tag.
pub(crate) type TagId = u32;

/// Longest tag name, in bytes.
pub const MAX_TAG_LEN: usize = 256;

/// Interned names; id `i` is `NAMES[i - 1]`.
static NAMES: Mutex<Vec<Arc<str>>> = Mutex::new(Vec::new());

thread_local! {
    static CURRENT: Cell<TagId> = const { Cell::new(0) };
}

fn names() -> std::sync::MutexGuard<'static, Vec<Arc<str>>> {
    NAMES.lock().unwrap_or_else(PoisonError::into_inner)
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_TAG_LEN {
        return Err(Error::InvalidArgument(format!(
            "a tag is a name of 1 to {MAX_TAG_LEN} bytes, not {name:?}"
        )));
    }
    Ok(())
}

/// The id of `name`, interned now if it is new.
pub(crate) fn intern(name: &str) -> Result<TagId> {
    check_name(name)?;
    let mut names = names();
    if let Some(i) = names.iter().position(|n| &**n == name) {
        return Ok(i as TagId + 1);
    }
    names.push(Arc::from(name));
    Ok(names.len() as TagId)
}

/// The name of tag `id` (not 0: ids come from `intern`).
pub(crate) fn name_of(id: TagId) -> Arc<str> {
    match names().get((id as usize).wrapping_sub(1)) {
        Some(name) => Arc::clone(name),
        None => Arc::from(format!("<tag {id}>")),
    }
}

/// The calling thread's current tag (0: none).
#[inline]
pub(crate) fn current() -> TagId {
    CURRENT.with(Cell::get)
}

/// The calling thread's current tag, by name.
pub fn current_name() -> Option<Arc<str>> {
    match current() {
        0 => None,
        id => Some(name_of(id)),
    }
}

/// Makes `name` the calling thread's tag; returns what to give [`restore`] to end it (the tag
/// before). For bindings whose scopes are call pairs; in Rust, [`scope`] ends itself.
pub fn enter(name: &str) -> Result<u32> {
    let id = intern(name)?;
    Ok(CURRENT.with(|c| c.replace(id)))
}

/// Makes the calling thread's allocations untagged, whatever scope encloses this one; returns
/// what to give [`restore`] to end it.
pub fn enter_untagged() -> u32 {
    CURRENT.with(|c| c.replace(0))
}

/// Ends a tag [`enter`] began: `previous` is what it returned. Refuses a value `enter` never
/// returned (and changes nothing then).
pub fn restore(previous: u32) -> Result<()> {
    if previous as usize > names().len() {
        return Err(Error::InvalidArgument(format!(
            "{previous} is not a tag `enter` returned (its result ends a tag)"
        )));
    }
    CURRENT.with(|c| c.set(previous));
    Ok(())
}

/// Checks a tag name as [`enter`] and every call taking one do: 1 to [`MAX_TAG_LEN`] bytes.
pub fn check(name: &str) -> Result<()> {
    check_name(name)
}

/// The calling thread's allocations carry `name` until the returned guard drops (scopes nest).
///
/// ```
/// let _weights = moonbright::tags::scope("weights")?;
/// // allocations made here, on this thread, carry the tag "weights"
/// # Ok::<(), moonbright::Error>(())
/// ```
pub fn scope(name: &str) -> Result<Scope> {
    Ok(Scope { previous: enter(name)? })
}

/// A tag in effect on this thread until dropped ([`scope`]).
#[must_use = "the tag ends when the scope drops"]
#[derive(Debug)]
pub struct Scope {
    previous: u32,
}

impl Drop for Scope {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.previous));
    }
}

/// What a tag holds, in [`crate::Allocator::tags`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TagInfo {
    pub name: Arc<str>,
    /// Live allocations carrying the tag.
    pub allocations: u64,
    /// Their bytes, as requested.
    pub bytes: u64,
    /// Asleep: its memory released (the addresses kept).
    pub asleep: bool,
    /// Asleep with its bytes in host memory (woken with them).
    pub backed_up: bool,
}

/// What becomes of a tag's bytes while it sleeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backup {
    /// Copied to pinned host memory, and back at wake.
    Host,
    /// Dropped: after wake the memory holds whatever the new pages held.
    Discard,
}

/// What [`crate::Allocator::sleep`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SleepReport {
    /// Bytes of mapped ranges taken out of service (the tag's allocations, with their pages'
    /// rounding and their sub-page arenas).
    pub bytes: u64,
    /// Device memory given back to the driver (less than `bytes` where an earlier mapping of a
    /// chunk still waited for other work: that chunk stays in MoonBright's pool).
    pub released: u64,
    /// Bytes copied to host memory.
    pub backed_up: u64,
    pub seconds: f64,
}

/// What [`crate::Allocator::wake`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WakeReport {
    /// Bytes mapped again.
    pub bytes: u64,
    /// Of them, newly created chunks (the rest came from MoonBright's free pool).
    pub created: u64,
    /// Bytes copied back from host memory.
    pub restored: u64,
    pub seconds: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_restore() {
        assert_eq!(current_name(), None);
        {
            let _a = scope("tags-test-a").unwrap();
            assert_eq!(current_name().as_deref(), Some("tags-test-a"));
            {
                let _b = scope("tags-test-b").unwrap();
                assert_eq!(current_name().as_deref(), Some("tags-test-b"));
            }
            assert_eq!(current_name().as_deref(), Some("tags-test-a"));
        }
        assert_eq!(current_name(), None);
        let _a = scope("tags-test-a").unwrap();
        let previous = enter_untagged();
        assert_eq!(current_name(), None);
        restore(previous).unwrap();
        assert_eq!(current_name().as_deref(), Some("tags-test-a"));
    }

    #[test]
    fn names_are_interned_once_and_checked() {
        let a = intern("tags-test-same").unwrap();
        assert_eq!(intern("tags-test-same").unwrap(), a);
        assert_ne!(intern("tags-test-other").unwrap(), a);
        assert!(scope("").is_err());
        assert!(restore(u32::MAX).is_err());
        assert!(scope(&"x".repeat(MAX_TAG_LEN + 1)).is_err());
    }

    #[test]
    fn the_tag_is_the_threads_own() {
        let _a = scope("tags-test-thread").unwrap();
        std::thread::spawn(|| assert_eq!(current_name(), None)).join().unwrap();
    }
}
