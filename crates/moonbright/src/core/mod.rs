//! The allocator core: the physical chunk pool, the virtual-address space, the sub-page allocator,
//! statistics, and the heap that ties them together and runs the placement policies over them
//! (`heap/policy/`).

pub(crate) mod chunks;
pub(crate) mod graphs;
pub(crate) mod heap;
pub mod history;
pub(crate) mod mapping;
pub(crate) mod pool;
pub(crate) mod sizes;
pub(crate) mod sorted;
pub mod stats;
pub(crate) mod streams;
pub(crate) mod subpage;
pub(crate) mod vaspace;
pub(crate) mod window;

pub use heap::GrowableInfo;
pub use subpage::SUBPAGE_ALIGN;
